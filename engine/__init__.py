"""The engine (installed as `pagedllm_integrations.engine`): see docs/architecture.md."""

if __name__ == "engine":  # the checkout root on sys.path (Python run there without -P)
    raise ImportError(
        "this is pagedllm's engine/ folder, found as a top-level `engine` because Python runs "
        "with the pagedllm checkout's root on sys.path; import `pagedllm_integrations.engine`"
    )

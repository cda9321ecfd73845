"""Attention kernels: Triton on CUDA, torch references on CPU (see `ops` for the dispatch)."""

if __name__ == "kernels":
    # Imported as the top-level `kernels` from the checkout root (Python run without -P):
    # the caller means Hugging Face's package of that name, not this folder.
    from ._hub_kernels import hand_over

    hand_over()
else:
    from .ops import paged_attention, reshape_and_cache, resolve_backend

    __all__ = ["paged_attention", "reshape_and_cache", "resolve_backend"]

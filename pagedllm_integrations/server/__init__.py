"""OpenAI-compatible HTTP server over the pagedllm engine, with Prometheus /metrics.

`create_app(engine, ...)` lives in `pagedllm_integrations.server.app`; `pagedllm serve` in
`server.cli`. Nothing is imported here, so importing the package stays cheap.
"""

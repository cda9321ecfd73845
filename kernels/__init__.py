"""Attention kernels: Triton on CUDA, torch references on CPU (see `ops` for the dispatch)."""

from .ops import paged_attention, reshape_and_cache, resolve_backend

__all__ = ["paged_attention", "reshape_and_cache", "resolve_backend"]

"""Weight formats for pagedllm: GGUF blocks read in place (gguf_tensor, gguf_blocks), the
fast path's packed tiles (packed, packed_linear), and AWQ INT4: the AutoAWQ gemm format
(awq_format), Triton kernels (awq_triton), the engine's quantized linear layer (awq_linear)
and the quantizer (awq_search, quantizer) behind `pagedllm quantize`
(pagedllm_integrations/cli_quantize.py). Nothing is imported here: import the module you
need."""

if __name__ == "quant":  # the checkout root on sys.path (Python run there without -P)
    raise ImportError(
        "this is pagedllm's quant/ folder, found as a top-level `quant` because Python runs "
        "with the pagedllm checkout's root on sys.path; import `pagedllm_integrations.quant`"
    )

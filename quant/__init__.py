"""AWQ INT4 for pagedllm: the AutoAWQ gemm format (awq_format), Triton kernels (awq_triton),
the engine's quantized linear layer (awq_linear), the quantizer (awq_search, quantizer) and
the `pagedllm quantize` command (cli). Nothing is imported here: import the module you need."""

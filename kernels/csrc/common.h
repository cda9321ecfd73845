// Shared by the C++ CPU kernels of pagedllm's fast path (see cpu_ext.py for the build).
//
// Every file is compiled with -O3 -march=native -ffp-contract=off: plain C++ expressions
// round like torch's eager ops, and fused multiply-adds appear only where written as
// intrinsics (or std::fma), so the arithmetic of each kernel is exactly what its source says.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PAGEDLLM_AVX512 1
#if defined(__AVX512BF16__)
#define PAGEDLLM_AVX512BF16 1
#endif
#endif

namespace pagedllm {

using at::Tensor;
using bf16 = c10::BFloat16;

inline void check_cpu_contiguous(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace pagedllm

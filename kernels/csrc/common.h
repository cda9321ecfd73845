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

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "thread_pool.h"

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

// float32 [numel] in pages of its own (mmap), returned to the system when the last tensor
// using them goes. Not from malloc: glibc raises its mmap threshold to the size of every
// mmapped block it frees, after which blocks of that size come from the heap, and the holes
// they leave there between steps stay resident (30-50 MiB after a few large jobs). Mapping
// is not cheap either (12.6 MB mapped per step cost the LM head 3-5 ms at 64 rows, in page
// faults): such blocks are kept and reused (decoder.cpp's step workspace).
inline Tensor page_backed_floats(int64_t numel) {
  const size_t bytes = std::max<size_t>(static_cast<size_t>(numel) * sizeof(float), 1);
  void* pages = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(pages != MAP_FAILED, "cannot map ", bytes, " bytes");
  return at::from_blob(
      pages, {numel}, [bytes](void* p) { munmap(p, bytes); }, at::TensorOptions(at::kFloat));
}

// A kernel's float32 output [rows, cols]: `out` when the caller passes one (decoder.cpp
// hands in buffers it reuses from step to step), else a new tensor.
inline Tensor float_output(Tensor* out, int64_t rows, int64_t cols,
                           const at::TensorOptions& options) {
  if (out == nullptr) return at::empty({rows, cols}, options.dtype(at::kFloat));
  TORCH_CHECK(out->dim() == 2 && out->size(0) == rows && out->size(1) == cols &&
                  out->is_contiguous() && out->scalar_type() == at::kFloat,
              "out must be contiguous float32 [", rows, ", ", cols, "]");
  return *out;
}

#ifdef PAGEDLLM_AVX512
// The sum of 16 lanes, always paired the same way: halves, quarters, pairs, last two.
inline float reduce16(__m512 v) {
  const __m256 v8 = _mm256_add_ps(_mm512_castps512_ps256(v),
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps(v8, 1));
  const __m128 v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
  const __m128 v1 = _mm_add_ss(v2, _mm_shuffle_ps(v2, v2, 1));
  return _mm_cvtss_f32(v1);
}
#endif

#ifdef PAGEDLLM_AVX512
// e^x, 1-2 ulp: 2^n * p(r), x = n ln2 + r (e^-inf = 0, large x overflows to inf).
inline __m512 exp512(__m512 x) {
  const __m512 lowest = _mm512_set1_ps(-87.0f);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, lowest, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lowest);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(~underflow, _mm512_scalef_ps(p, n));
}

// tanh(x) = 1 - 2 / (e^{2x} + 1), through exp512 on -2|x| (<= 0), sign restored.
inline __m512 tanh512(__m512 x) {
  const __m512 sign = _mm512_and_ps(x, _mm512_set1_ps(-0.0f));
  const __m512 e = exp512(_mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(-2.0f)));
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(_mm512_set1_ps(1.0f), e),
                                 _mm512_add_ps(_mm512_set1_ps(1.0f), e));
  return _mm512_or_ps(t, sign);
}
#endif

inline void check_cpu_contiguous(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace pagedllm

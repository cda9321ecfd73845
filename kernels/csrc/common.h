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

// The instruction set each kernel is written for, chosen at compile time (-march=native):
//   PAGEDLLM_AVX512  AVX512F + BW (Skylake-SP and later Xeons, Zen 4 and 5)
//   PAGEDLLM_AVX2    AVX2 + FMA + F16C without AVX-512 (most laptops and desktops: Intel
//                    Core before and since Ice Lake's client parts, Zen 1-3); 8-lane code
//                    that runs, lane for lane, the same float32 operations as the 16-lane
//                    code, so both give the same bits
//   neither          plain C++, the same recipe one element at a time (slow)
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PAGEDLLM_AVX512 1
#if defined(__AVX512BF16__)
#define PAGEDLLM_AVX512BF16 1
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PAGEDLLM_AVX2 1
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
// e^x, 1-2 ulp: 2^n * p(r), x = n ln2 + r (e^-inf = 0, e^x = inf from x = 89 up).
inline __m512 exp512(__m512 x) {
  const __m512 lowest = _mm512_set1_ps(-87.0f);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, lowest, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lowest);
  // e^89 is inf already; without the clamp, x above ~2.4e38 gave NaN (inf - inf in the
  // reduction), so a silu gate below -2.4e38 gave NaN instead of -0.
  x = _mm512_min_ps(x, _mm512_set1_ps(89.0f));
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

#ifdef PAGEDLLM_AVX2
// ------------------------------------------------- AVX2 forms of the helpers above
// A 16-lane float vector as two 8-lane halves: lo holds lanes 0..7, hi lanes 8..15.

// The sum of 8 lanes, paired as reduce16 pairs its last eight: quarters, pairs, last two.
inline float reduce8(__m256 v8) {
  const __m128 v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps(v8, 1));
  const __m128 v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
  const __m128 v1 = _mm_add_ss(v2, _mm_shuffle_ps(v2, v2, 1));
  return _mm_cvtss_f32(v1);
}

// reduce16 of the 16 lanes (lo, hi): the same additions in the same order, the same bits.
inline float reduce16(__m256 lo, __m256 hi) { return reduce8(_mm256_add_ps(lo, hi)); }

// The largest of 8 lanes.
inline float reduce_max8(__m256 v8) {
  const __m128 v4 = _mm_max_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps(v8, 1));
  const __m128 v2 = _mm_max_ps(v4, _mm_movehl_ps(v4, v4));
  return _mm_cvtss_f32(_mm_max_ss(v2, _mm_shuffle_ps(v2, v2, 1)));
}

// e^x as exp512 computes it, lane for lane the same bits: the same reduction and
// polynomial, and p * 2^n rounded once. AVX2 has no vscalefps, so 2^n is applied in two
// exact steps, 2^(n/2) and 2^(n - n/2): each factor is a normal float for every n that
// reaches it (-126..128), and only the last product can round (to a subnormal or to inf).
inline __m256 exp256(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-87.0f);
  const __m256 underflow = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lowest);
  x = _mm256_min_ps(x, _mm256_set1_ps(89.0f));  // as exp512; also keeps n <= 128
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(ni, 1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 scale1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const __m256 scale2 = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), bias), 23));
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(_mm256_mul_ps(p, scale1), scale2));
}

// tanh(x) as tanh512: 1 - 2 / (e^{2x} + 1) through exp256 on -2|x|, sign restored.
inline __m256 tanh256(__m256 x) {
  const __m256 sign = _mm256_and_ps(x, _mm256_set1_ps(-0.0f));
  const __m256 abs = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
  const __m256 e = exp256(_mm256_mul_ps(abs, _mm256_set1_ps(-2.0f)));
  const __m256 t = _mm256_div_ps(_mm256_sub_ps(_mm256_set1_ps(1.0f), e),
                                 _mm256_add_ps(_mm256_set1_ps(1.0f), e));
  return _mm256_or_ps(t, sign);
}

// 8 values in float32: bf16 widens exactly (a 16-bit shift), float16 through F16C.
inline __m256 load8_float(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8_float(const bf16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8_float(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

// Forces GCC to inline a function called from a kernel's inner loop. A call there costs
// more than the call: every vector register is caller-saved, so the caller keeps its
// accumulators in memory across it, loads and stores in every iteration.
#define PAGEDLLM_INLINE __attribute__((always_inline))

// Index checks at the ops' boundary. The engine computes every slot, position and block
// table entry; a fault of its own there must stop the op with an error, not write outside
// a cache. Each op checks its indices once per call, before its threads start (O(rows +
// blocks used): microseconds against the step's milliseconds), so the checks stay on.
// A build with -DPAGEDLLM_DEBUG_BOUNDS (PAGEDLLM_DEBUG_KERNELS=1, see cpu_ext.py) also
// checks each cache access in the kernels' inner loops.
#ifdef PAGEDLLM_DEBUG_BOUNDS
#define PAGEDLLM_DEBUG_CHECK(cond, ...) TORCH_CHECK(cond, __VA_ARGS__)
#else
#define PAGEDLLM_DEBUG_CHECK(cond, ...) ((void)0)
#endif

inline void check_cpu_contiguous(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace pagedllm

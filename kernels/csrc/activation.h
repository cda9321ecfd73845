// The gated activations of the MLPs, shared by gated_act (ops.cpp) and the fused gate_up
// linears (linear_packed.cpp), so that both give the same bits.
#pragma once

#include "common.h"

namespace pagedllm {

// silu(g) * u and gelu_tanh(g) * u, the scalar forms of the vector code below.
//   silu(g)      = g / (1 + e^-g)
//   gelu_tanh(g) = 0.5 g (1 + tanh(z)) = g / (1 + e^-2z),  z = sqrt(2/pi) (g + 0.044715 g^3)
// The second form is the same function without the cancellation of 1 + tanh(z) as
// tanh(z) nears -1 (where torch's form loses most of its digits).
// The tail's e^x is the vector code's, so a row's last elements get the bits a full vector
// would give them (std::exp differs from exp512 in the last bit or two).
#ifdef PAGEDLLM_AVX512
inline float exp_of(float x) { return _mm512_cvtss_f32(exp512(_mm512_set1_ps(x))); }
#elif defined(PAGEDLLM_AVX2)
inline float exp_of(float x) { return _mm256_cvtss_f32(exp256(_mm256_set1_ps(x))); }
#else
inline float exp_of(float x) { return std::exp(x); }
#endif
constexpr float kGeluK0 = 0.7978845608028654f, kGeluK1 = 0.044715f;  // sqrt(2/pi)
inline float silu_times(float g, float u) { return (g / (1.0f + exp_of(-g))) * u; }
inline float gelu_times(float g, float u) {
  const float minus_2z = -2.0f * (kGeluK0 * (g + kGeluK1 * g * g * g));
  return (g / (1.0f + exp_of(minus_2z))) * u;
}

// out[r] = silu(gate[r]) * up[r] over `width` values, for rows r < rows (gate and up rows
// `in_stride` apart, out rows `out_stride` apart; gelu_tanh when `gelu` is set). The one
// loop of gated_act and of the fused gate_up linears (linear_packed.cpp): the same bits.
inline void gated_rows(const float* gate_rows, const float* up_rows, int64_t in_stride,
                       float* out, int64_t out_stride, int64_t rows, int64_t width,
                       bool gelu) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = gate_rows + r * in_stride;
    const float* up = up_rows + r * in_stride;
    float* o = out + r * out_stride;
    int64_t i = 0;
#ifdef PAGEDLLM_AVX512
    // The scalar expressions lane-wise, in the same order (so the tail agrees).
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= width; i += 16) {
      const __m512 g = _mm512_loadu_ps(gate + i), u = _mm512_loadu_ps(up + i);
      __m512 minus;  // the exponent: -g (silu) or -2z (gelu_tanh)
      if (gelu) {
        const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(kGeluK1), g), g), g);
        const __m512 z = _mm512_mul_ps(_mm512_set1_ps(kGeluK0), _mm512_add_ps(g, cube));
        minus = _mm512_mul_ps(_mm512_set1_ps(-2.0f), z);
      } else {
        minus = _mm512_sub_ps(_mm512_setzero_ps(), g);
      }
      const __m512 y = _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, exp512(minus))), u);
      _mm512_storeu_ps(o + i, y);
    }
#elif defined(PAGEDLLM_AVX2)
    // The AVX-512 loop 8 lanes at a time: the same operations, so the same bits.
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= width; i += 8) {
      const __m256 g = _mm256_loadu_ps(gate + i), u = _mm256_loadu_ps(up + i);
      __m256 minus;
      if (gelu) {
        const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(kGeluK1), g), g), g);
        const __m256 z = _mm256_mul_ps(_mm256_set1_ps(kGeluK0), _mm256_add_ps(g, cube));
        minus = _mm256_mul_ps(_mm256_set1_ps(-2.0f), z);
      } else {
        minus = _mm256_sub_ps(_mm256_setzero_ps(), g);
      }
      const __m256 y = _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, exp256(minus))), u);
      _mm256_storeu_ps(o + i, y);
    }
#endif
    for (; i < width; ++i) o[i] = gelu ? gelu_times(gate[i], up[i]) : silu_times(gate[i], up[i]);
  }
}

}  // namespace pagedllm

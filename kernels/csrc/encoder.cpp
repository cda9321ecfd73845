// Bidirectional attention of the encoders (embedding models: engine/models/bert.py), one op
// for a whole step: every sequence attends to all of its own rows and none of the others'.
//
//   qkv float32 [T, 3, H, D]  (q | k | v of each row, the stacked linear's output)
//   cu_seqlens int64 [B + 1]  (sequence b is rows cu[b] .. cu[b + 1])
//   -> out float32 [T, H, D]
//
//   out[i, h] = sum_j softmax_j((scale * q[i, h]) . k[j, h]) v[j, h]  over j in i's sequence
//
// gelu_erf_: x * Phi(x) (BERT's exact gelu) in place, with erf from Abramowitz and Stegun's
// 7.1.26 (absolute error below 1.5e-7 in erf: the result is within 2e-7 * |x| of the exact
// gelu, below the bf16 rounding of the linears around it); torch's gelu took 3 ns an element.
//
// encoder_layer.cpp composes these ops and the layer's Linears into one call a layer.
//
// add_layer_norm: LayerNorm(y + x) of every row, the post-norm residual of a BERT layer, in
// one pass over the rows spread over the pool (torch took a quarter of an embedding step
// for it: the add, a copy and the norm, each a pass of its own).
//
// One work item is one (sequence, head), claimed from the pool's counter, so short and long
// sequences balance over the threads and nothing depends on which thread ran an item. For
// an item the keys are copied transposed (kt [D, L], 16 keys per vector) and the values
// contiguous; then for 4 query rows at a time: their scores against 32 keys per pass (8
// independent FMA chains over D), the softmax numerators (max, e^(s - max), sum), and the
// weighted values, 32 of D per pass, divided by the sum at the end. Before this op the step ran two torch.bmm and a softmax per sequence: most of an
// embedding step once its linears moved to AMX (MKL's small batched GEMMs and their OpenMP
// regions).

#include "kernels.h"

namespace pagedllm {
namespace {

constexpr int64_t kQueryRows = 4;

// The buffers of one item, kept by each thread between items.
struct ItemScratch {
  std::vector<float> kt, v, scores;
  void size_for(int64_t padded, int64_t d) {
    if (static_cast<int64_t>(kt.size()) < padded * d) kt.resize(padded * d);
    if (static_cast<int64_t>(v.size()) < padded * d) v.resize(padded * d);
    if (static_cast<int64_t>(scores.size()) < kQueryRows * padded) scores.resize(kQueryRows * padded);
  }
};

// Rows first .. first + rows (rows <= kQueryRows) of one (sequence, head), L keys.
// q: the first query row's q (row stride q_stride); out: its output (row stride o_stride).
void attend_rows(const float* q, int64_t q_stride, int64_t rows, const float* kt,
                 const float* v, int64_t keys, int64_t padded, int64_t d, float scale,
                 float* scores, float* out, int64_t o_stride) {
  // scale * q (as torch's q * scale rounds it), [kQueryRows, d]; rows past `rows` zero
  thread_local std::vector<float> qs;
  if (static_cast<int64_t>(qs.size()) < kQueryRows * d) qs.resize(kQueryRows * d);
  for (int64_t r = 0; r < kQueryRows; ++r)
    for (int64_t e = 0; e < d; ++e) qs[r * d + e] = r < rows ? q[r * q_stride + e] * scale : 0.0f;
  // Scores: 4 rows x 32 keys per pass, 8 independent FMA chains over d.
#ifdef PAGEDLLM_AVX512
  for (int64_t j = 0; j < padded; j += 32) {
    const bool two = j + 32 <= padded;
    __m512 acc[kQueryRows][2];
    for (int64_t r = 0; r < kQueryRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t e = 0; e < d; ++e) {
      const __m512 k0 = _mm512_loadu_ps(kt + e * padded + j);
      const __m512 k1 = two ? _mm512_loadu_ps(kt + e * padded + j + 16) : _mm512_setzero_ps();
      for (int64_t r = 0; r < kQueryRows; ++r) {
        const __m512 qv = _mm512_set1_ps(qs[r * d + e]);
        acc[r][0] = _mm512_fmadd_ps(qv, k0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(qv, k1, acc[r][1]);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      _mm512_storeu_ps(scores + r * padded + j, acc[r][0]);
      if (two) _mm512_storeu_ps(scores + r * padded + j + 16, acc[r][1]);
    }
  }
#else  // loops over contiguous keys, which the compiler vectorizes (AVX2)
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * padded;
    std::fill(s, s + keys, 0.0f);
    for (int64_t e = 0; e < d; ++e) {
      const float qe = qs[r * d + e];
      const float* k_row = kt + e * padded;
      for (int64_t j = 0; j < keys; ++j) s[j] += qe * k_row[j];
    }
  }
#endif
  for (int64_t r = rows; r < kQueryRows; ++r)  // the value pass below reads all 4 rows
    std::fill(scores + r * padded, scores + r * padded + keys, 0.0f);
  // Softmax numerators e^(s - max) in place, and their sums.
  float sums[kQueryRows] = {};
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * padded;
#ifdef PAGEDLLM_AVX512
    auto lanes_at = [keys](int64_t j) {
      return keys - j >= 16 ? static_cast<__mmask16>(0xFFFF)
                            : static_cast<__mmask16>((1u << (keys - j)) - 1);
    };
    __m512 top_v = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < keys; j += 16)
      top_v = _mm512_mask_max_ps(top_v, lanes_at(j), top_v, _mm512_loadu_ps(s + j));
    top_v = _mm512_set1_ps(_mm512_reduce_max_ps(top_v));
    __m512 sum_v = _mm512_setzero_ps();
    for (int64_t j = 0; j < keys; j += 16) {
      const __m512 e = _mm512_maskz_mov_ps(lanes_at(j), exp512(_mm512_sub_ps(_mm512_loadu_ps(s + j), top_v)));
      _mm512_storeu_ps(s + j, e);
      sum_v = _mm512_add_ps(sum_v, e);
    }
    sums[r] = reduce16(sum_v);
#else
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < keys; ++j) top = std::max(top, s[j]);
    int64_t j = 0;
#ifdef PAGEDLLM_AVX2
    for (; j + 8 <= keys; j += 8)
      _mm256_storeu_ps(s + j, exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(top))));
#endif
    for (; j < keys; ++j) s[j] = std::exp(s[j] - top);
    for (j = 0; j < keys; ++j) sums[r] += s[j];
#endif
  }
  // Weighted values: 4 rows x 32 values of d per pass, then / sum.
#ifdef PAGEDLLM_AVX512
  if (d % 16 == 0) {
    for (int64_t e0 = 0; e0 < d; e0 += 32) {
      const bool two = e0 + 32 <= d;
      __m512 acc[kQueryRows][2];
      for (int64_t r = 0; r < kQueryRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
      for (int64_t j = 0; j < keys; ++j) {
        const __m512 v0 = _mm512_loadu_ps(v + j * d + e0);
        const __m512 v1 = two ? _mm512_loadu_ps(v + j * d + e0 + 16) : _mm512_setzero_ps();
        for (int64_t r = 0; r < kQueryRows; ++r) {  // rows past `rows`: zero weights
          const __m512 p = _mm512_set1_ps(scores[r * padded + j]);
          acc[r][0] = _mm512_fmadd_ps(p, v0, acc[r][0]);
          acc[r][1] = _mm512_fmadd_ps(p, v1, acc[r][1]);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const __m512 inv = _mm512_set1_ps(1.0f / sums[r]);
        _mm512_storeu_ps(out + r * o_stride + e0, _mm512_mul_ps(acc[r][0], inv));
        if (two) _mm512_storeu_ps(out + r * o_stride + e0 + 16, _mm512_mul_ps(acc[r][1], inv));
      }
    }
    return;
  }
#endif
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + r * o_stride;
    std::fill(o, o + d, 0.0f);
    for (int64_t j = 0; j < keys; ++j) {
      const float p = scores[r * padded + j];
      for (int64_t e = 0; e < d; ++e) o[e] += p * v[j * d + e];
    }
    const float inv = 1.0f / sums[r];
    for (int64_t e = 0; e < d; ++e) o[e] *= inv;
  }
}

// LayerNorm(y + x) of one row of h values: two passes (mean, then the centred squares).
void add_norm_row(const float* x, const float* y, const float* w, const float* b, int64_t h,
                  float eps, float* out) {
  float mean = 0.0f, var = 0.0f;
#ifdef PAGEDLLM_AVX512
  if (h % 16 == 0) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < h; i += 16) {
      const __m512 s = _mm512_add_ps(_mm512_loadu_ps(y + i), _mm512_loadu_ps(x + i));
      _mm512_storeu_ps(out + i, s);
      sum = _mm512_add_ps(sum, s);
    }
    mean = reduce16(sum) / static_cast<float>(h);
    const __m512 mean_v = _mm512_set1_ps(mean);
    __m512 squares = _mm512_setzero_ps();
    for (int64_t i = 0; i < h; i += 16) {
      const __m512 c = _mm512_sub_ps(_mm512_loadu_ps(out + i), mean_v);
      squares = _mm512_add_ps(squares, _mm512_mul_ps(c, c));
    }
    var = reduce16(squares) / static_cast<float>(h);
    const __m512 rstd = _mm512_set1_ps(1.0f / std::sqrt(var + eps));
    for (int64_t i = 0; i < h; i += 16) {
      const __m512 c = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(out + i), mean_v), rstd);
      _mm512_storeu_ps(out + i, _mm512_add_ps(_mm512_mul_ps(c, _mm512_loadu_ps(w + i)),
                                              _mm512_loadu_ps(b + i)));
    }
    return;
  }
#endif
  for (int64_t i = 0; i < h; ++i) {
    out[i] = y[i] + x[i];
    mean += out[i];
  }
  mean /= static_cast<float>(h);
  for (int64_t i = 0; i < h; ++i) var += (out[i] - mean) * (out[i] - mean);
  var /= static_cast<float>(h);
  const float rstd = 1.0f / std::sqrt(var + eps);
  for (int64_t i = 0; i < h; ++i) out[i] = (out[i] - mean) * rstd * w[i] + b[i];
}

// erf(z) = sign(z) (1 - poly(t) e^(-z^2)), t = 1 / (1 + p |z|) (A&S 7.1.26)
constexpr float kErfP = 0.3275911f;
constexpr float kErfA[5] = {0.254829592f, -0.284496736f, 1.421413741f, -1.453152027f,
                            1.061405429f};

inline float gelu_erf(float x) {
  const float z = x * 0.70710678118654752f, a = std::fabs(z);
  const float t = 1.0f / (1.0f + kErfP * a);
  float poly = kErfA[4];
  for (int i = 3; i >= 0; --i) poly = poly * t + kErfA[i];
  const float erf_abs = 1.0f - poly * t * std::exp(-a * a);
  return 0.5f * x * (1.0f + std::copysign(erf_abs, z));
}

#ifdef PAGEDLLM_AVX512
inline __m512 gelu_erf512(__m512 x) {
  const __m512 z = _mm512_mul_ps(x, _mm512_set1_ps(0.70710678118654752f));
  const __m512 a = _mm512_abs_ps(z);
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 t = _mm512_div_ps(one, _mm512_fmadd_ps(_mm512_set1_ps(kErfP), a, one));
  __m512 poly = _mm512_set1_ps(kErfA[4]);
  for (int i = 3; i >= 0; --i) poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(kErfA[i]));
  const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(a, a)));
  const __m512 erf_abs = _mm512_fnmadd_ps(_mm512_mul_ps(poly, t), e, one);
  const __m512 sign = _mm512_and_ps(z, _mm512_set1_ps(-0.0f));
  const __m512 erf = _mm512_or_ps(erf_abs, sign);
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), _mm512_add_ps(one, erf));
}
#endif

}  // namespace

namespace api {

void gelu_erf_(Tensor& x) {
  check_cpu_contiguous(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "gelu_erf_ takes float32");
  float* p = x.data_ptr<float>();
  parallel_for(0, x.numel(), 16384, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
#ifdef PAGEDLLM_AVX512
    for (; i + 16 <= end; i += 16) _mm512_storeu_ps(p + i, gelu_erf512(_mm512_loadu_ps(p + i)));
#endif
    for (; i < end; ++i) p[i] = gelu_erf(p[i]);
  });
}

Tensor add_layer_norm(const Tensor& x, const Tensor& y, const Tensor& weight, const Tensor& bias,
                      double eps) {
  for (const Tensor* t : {&x, &y, &weight, &bias}) {
    check_cpu_contiguous(*t, "add_layer_norm operand");
    TORCH_CHECK(t->scalar_type() == at::kFloat, "add_layer_norm takes float32 tensors");
  }
  TORCH_CHECK(x.dim() == 2 && y.sizes() == x.sizes(), "x and y must be [T, H] alike, got ",
              x.sizes(), " and ", y.sizes());
  const int64_t rows = x.size(0), h = x.size(1);
  TORCH_CHECK(weight.numel() == h && bias.numel() == h, "weight and bias must be [", h, "]");
  Tensor out = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *yp = y.data_ptr<float>();
  const float *wp = weight.data_ptr<float>(), *bp = bias.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      add_norm_row(xp + r * h, yp + r * h, wp, bp, h, e, op + r * h);
  });
  return out;
}

Tensor encoder_attention(const Tensor& qkv, const Tensor& cu_seqlens, double scale) {
  check_cpu_contiguous(qkv, "qkv");
  check_cpu_contiguous(cu_seqlens, "cu_seqlens");
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && qkv.dim() == 4 && qkv.size(1) == 3,
              "qkv must be float32 [T, 3, H, D], got ", qkv.scalar_type(), " ", qkv.sizes());
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kLong && cu_seqlens.dim() == 1 &&
                  cu_seqlens.size(0) >= 1,
              "cu_seqlens must be int64 [B + 1]");
  const int64_t rows = qkv.size(0), heads = qkv.size(2), d = qkv.size(3);
  TORCH_CHECK(d <= 1024, "encoder_attention: head size ", d, " above 1024");
  const int64_t batch = cu_seqlens.size(0) - 1;
  const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
  TORCH_CHECK(cu[0] == 0 && cu[batch] == rows, "cu_seqlens must run from 0 to ", rows);
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(cu[b] <= cu[b + 1], "cu_seqlens must not decrease");
  Tensor out = at::empty({rows, heads, d}, qkv.options());
  const float* x = qkv.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t row_stride = 3 * heads * d;
  const float s = static_cast<float>(scale);
  run_chunks(batch * heads, [&](int64_t item) {
    const int64_t b = item / heads, h = item % heads;
    const int64_t first = cu[b], keys = cu[b + 1] - cu[b];
    if (keys == 0) return;
    const int64_t padded = (keys + 15) / 16 * 16;
    thread_local ItemScratch scratch;
    scratch.size_for(padded, d);
    float* kt = scratch.kt.data();
    float* v = scratch.v.data();
    for (int64_t j = 0; j < padded; ++j) {
      const float* k_row = x + (first + j) * row_stride + heads * d + h * d;
      for (int64_t e = 0; e < d; ++e) kt[e * padded + j] = j < keys ? k_row[e] : 0.0f;
      if (j < keys) std::copy(k_row + heads * d, k_row + heads * d + d, v + j * d);
    }
    for (int64_t i = 0; i < keys; i += kQueryRows) {
      const int64_t count = std::min(kQueryRows, keys - i);
      attend_rows(x + (first + i) * row_stride + h * d, row_stride, count, kt, v, keys, padded,
                  d, s, scratch.scores.data(), o + ((first + i) * heads + h) * d, heads * d);
    }
  });
  return out;
}

}  // namespace api

}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  // qkv float32 [T, 3, H, D], cu_seqlens int64 [B + 1] -> out float32 [T, H, D]
  m.def("encoder_attention(Tensor qkv, Tensor cu_seqlens, float scale) -> Tensor",
        &pagedllm::api::encoder_attention);
  // x float32 (any shape) -> x * Phi(x), in place
  m.def("gelu_erf_(Tensor(a!) x) -> ()", &pagedllm::api::gelu_erf_);
  // x, y float32 [T, H], weight, bias float32 [H] -> LayerNorm(y + x) [T, H]
  m.def("add_layer_norm(Tensor x, Tensor y, Tensor weight, Tensor bias, float eps) -> Tensor",
        &pagedllm::api::add_layer_norm);
}

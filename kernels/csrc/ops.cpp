// Fused element-wise kernels of the CPU fast path: RMSNorm (with the residual add),
// neox rotary embedding in place, gated activations, and KV cache writes.

#include "kernels.h"
#include "activation.h"

namespace pagedllm {
namespace {

// --------------------------------------------------------------- RMSNorm
// The sum of squares of a row in double. The vector paths share one order: 32 lanes,
// element i in lane i % 32 (then a scalar tail), reduced as GCC's _mm512_reduce_add_pd
// does, so AVX-512 and AVX2 give the same double; the scalar fallback adds in element order.
// Each square is exact in double, so two orders' sums differ only by the roundings of their
// additions (a few ulp of a double), and the float mean (sum / h rounded to float) differs
// only where the exact mean lies that close to a float rounding boundary: at most about
// h * 2^-29 of rows (1e-6 at h = 576; none of 200,000 random rows at h = 576 differed
// between the vector and the scalar order).
inline double sum_of_squares(const float* x, int64_t h) {
  int64_t i = 0;
  double sum = 0.0;
#ifdef PAGEDLLM_AVX512
  // Four independent 8-lane accumulators: the one serial chain of double adds took a
  // decode step over 64 sequences 2 ms (the norms of 30 layers), more than its loads.
  __m512d acc[4] = {_mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd(),
                    _mm512_setzero_pd()};
  for (; i + 32 <= h; i += 32)
    for (int a = 0; a < 4; ++a) {
      const __m512d v = _mm512_cvtps_pd(_mm256_loadu_ps(x + i + 8 * a));
      acc[a] = _mm512_fmadd_pd(v, v, acc[a]);
    }
  sum = _mm512_reduce_add_pd(
      _mm512_add_pd(_mm512_add_pd(acc[0], acc[1]), _mm512_add_pd(acc[2], acc[3])));
#elif defined(PAGEDLLM_AVX2)
  // The AVX-512 code's 32 lanes as eight 4-lane accumulators: acc[a] holds lanes 4a..4a+3
  // (AVX-512's acc[a / 2], low or high half). Eight chains also cover the FMA latency.
  __m256d acc[8];
  for (int a = 0; a < 8; ++a) acc[a] = _mm256_setzero_pd();
  for (; i + 32 <= h; i += 32)
    for (int a = 0; a < 8; ++a) {
      const __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4 * a));
      acc[a] = _mm256_fmadd_pd(v, v, acc[a]);
    }
  // AVX-512's additions lane for lane: (acc0 + acc1) + (acc2 + acc3) in each half, then
  // reduce_add's tree: the halves, the 128-bit quarters, the last pair.
  const __m256d lo = _mm256_add_pd(_mm256_add_pd(acc[0], acc[2]), _mm256_add_pd(acc[4], acc[6]));
  const __m256d hi = _mm256_add_pd(_mm256_add_pd(acc[1], acc[3]), _mm256_add_pd(acc[5], acc[7]));
  const __m256d v4 = _mm256_add_pd(hi, lo);
  const __m128d v2 = _mm_add_pd(_mm256_extractf128_pd(v4, 1), _mm256_castpd256_pd128(v4));
  sum = _mm_cvtsd_f64(v2) + _mm_cvtsd_f64(_mm_unpackhi_pd(v2, v2));
#endif
  for (; i < h; ++i) sum += static_cast<double>(x[i]) * x[i];
  return sum;
}

// One row: out = weight * (x / sqrt(mean(x^2) + eps)), as transformers' float32 RMSNorm.
inline void rms_norm_row(const float* x, const float* w, float* out, int64_t h, double eps) {
  const double sum = sum_of_squares(x, h);
  const float mean = static_cast<float>(sum / static_cast<double>(h));
  const float inv = 1.0f / std::sqrt(mean + static_cast<float>(eps));
  for (int64_t i = 0; i < h; ++i) out[i] = w[i] * (x[i] * inv);
}

// x [T, H] float32, weight [H] float32 -> out [T, H]
Tensor rms_norm(const Tensor& x_in, const Tensor& weight, double eps,
                Tensor* out_buffer = nullptr) {
  Tensor x = x_in.contiguous();
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "rms_norm runs on float32");
  const int64_t h = x.size(-1), rows = x.numel() / h;
  Tensor out = out_buffer ? float_output(out_buffer, rows, h, x.options()) : at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * h, wp, op + r * h, h, eps);
  });
  return out;
}

// residual += x (in place); returns rms_norm(residual): the pre-norm of the next sub-layer.
Tensor add_rms_norm(const Tensor& x_in, Tensor& residual, const Tensor& weight, double eps,
                    Tensor* out_buffer = nullptr) {
  Tensor x = x_in.contiguous();
  TORCH_CHECK(residual.is_contiguous() && residual.scalar_type() == at::kFloat,
              "residual must be contiguous float32");
  const int64_t h = x.size(-1), rows = x.numel() / h;
  Tensor out = out_buffer ? float_output(out_buffer, rows, h, x.options()) : at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* res = rp + r * h;
      for (int64_t i = 0; i < h; ++i) res[i] += xp[r * h + i];
      rms_norm_row(res, wp, op + r * h, h, eps);
    }
  });
  return out;
}

// RMSNorm over each head of x [T, H, D] in place (rows may be strided, heads contiguous):
// the q/k norms of Qwen3 and Gemma 3, each head computed as rms_norm computes a row.
void head_rms_norm_(Tensor& x, const Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1 &&
                  x.stride(1) == x.size(2),
              "head_rms_norm_: x must be float32 [T, H, D] with contiguous heads");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.numel() == x.size(2),
              "head_rms_norm_: weight must be float32 [D]");
  const int64_t heads = x.size(1), d = x.size(2), stride = x.stride(0);
  float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  parallel_for(0, x.size(0) * heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = xp + (i / heads) * stride + (i % heads) * d;
      rms_norm_row(row, wp, row, d, eps);  // reads the row whole before writing it
    }
  });
}

// ----------------------------------------------------------------- rotary
// Neox rotary (rotate_half) in place on q [T, Hq, D] and k [T, Hkv, D] (views into a
// [T, (Hq + 2 Hkv) D] qkv row are fine: rows may be strided, heads contiguous),
// cos/sin [P, W] float32 looked up at positions [T]. The first 2W features of each head
// turn (W = D/2: all of them; less: a partial rotary, as Phi-4-mini's), the rest pass.
void rotary_neox_(Tensor& q, Tensor& k, const Tensor& positions, const Tensor& cos,
                  const Tensor& sin) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat,
              "rotary runs on float32");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && q.stride(1) == q.size(2) &&
                  k.stride(1) == k.size(2),
              "q and k heads must be contiguous");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
                  cos.dim() == 2 && 2 * cos.size(1) <= q.size(2) &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rotary tables must be contiguous float32 [positions, <= head_dim / 2]");
  Tensor pos = positions.to(at::kLong).contiguous();
  const int64_t t = q.size(0), hq = q.size(1), hk = k.size(1), d = q.size(2);
  const int64_t half = cos.size(1);
  TORCH_CHECK(pos.numel() == t && k.size(0) == t, "rotary: ", pos.numel(), " positions for ",
              t, " rows of q and ", k.size(0), " of k");
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(pos.data_ptr<int64_t>()[i] >= 0 && pos.data_ptr<int64_t>()[i] < cos.size(0),
                "rotary: position ", pos.data_ptr<int64_t>()[i], " of row ", i,
                " is outside the tables' ", cos.size(0), " positions");
  const int64_t* pp = pos.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  const int64_t q_stride = q.stride(0), k_stride = k.stride(0);
  auto rotate = [&](float* x, const float* c, const float* s) {
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = x[i], x2 = x[i + half];
      x[i] = x1 * c[i] - x2 * s[i];
      x[i + half] = x2 * c[i] + x1 * s[i];
    }
  };
  parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* c = cp + pp[i] * half;
      const float* s = sp + pp[i] * half;
      for (int64_t h = 0; h < hq; ++h) rotate(qp + i * q_stride + h * d, c, s);
      for (int64_t h = 0; h < hk; ++h) rotate(kp + i * k_stride + h * d, c, s);
    }
  });
}

// ------------------------------------------------------------- activation
// (the row loop, gated_rows, is in activation.h: the fused gate_up linears share it)

// x [T, 2I] = [gate | up] -> silu(gate) * up  [T, I]  (gelu_tanh when `gelu` is set)
Tensor gated_act(const Tensor& x_in, bool gelu, Tensor* out_buffer = nullptr) {
  Tensor x = x_in.contiguous();
  TORCH_CHECK(x.scalar_type() == at::kFloat, "gated_act runs on float32");
  const int64_t t = x.size(0), inner = x.size(1) / 2;
  Tensor out = float_output(out_buffer, t, inner, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  parallel_for(0, t, 4, [&](int64_t begin, int64_t end) {
    gated_rows(xp + begin * 2 * inner, xp + begin * 2 * inner + inner, 2 * inner,
               op + begin * inner, inner, end - begin, inner, gelu);
  });
  return out;
}

// ----------------------------------------------------------- KV cache write
template <typename CacheT>
inline void store(CacheT* dst, float value) {
  *dst = static_cast<CacheT>(value);
}

// k, v [T, Hkv, D] float32 (rows may be strided, heads contiguous) into the fast path's
// cache layout: k_cache [num_blocks, Hkv, D, block_size], v_cache [num_blocks, Hkv,
// block_size, D] (see attention.cpp). Slot s is block s / block_size, position s % block_size.
void write_kv_cache_(const Tensor& k, const Tensor& v, Tensor& k_cache, Tensor& v_cache,
                     const Tensor& slot_mapping) {
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 &&
                  v.stride(1) == v.size(2),
              "k and v heads must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t t = k.size(0), heads = k.size(1), d = k.size(2), bs = k_cache.size(3);
  TORCH_CHECK(k_cache.size(1) == heads && k_cache.size(2) == d && v_cache.size(2) == bs,
              "caches must be k [blocks, Hkv, D, block_size] and v [blocks, Hkv, block_size, D]");
  TORCH_CHECK(slots.numel() == t, "slot_mapping has ", slots.numel(), " slots for ", t, " rows");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t capacity = k_cache.size(0) * bs;  // slots in the cache; -1: a padding row
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(sp[i] >= -1 && sp[i] < capacity, "write_kv_cache_: slot ", sp[i], " of row ", i,
                " is outside the cache's ", capacity, " slots");
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t ks = k.stride(0), vs = v.stride(0), head_stride = d * bs;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, k_cache.scalar_type(), "write_kv_cache", [&] {
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    // A row's key lands in D cache lines per head (one dimension every block_size
    // positions), mostly not cached: a decode step's rows miss on ~100 lines each. So the
    // rows are split over the threads and each row asks for the next row's lines before
    // writing its own, so that the misses overlap instead of queueing behind the stores
    // (64 decode rows x 30 layers, Zen 4: 1.69 -> 1.11 ms; a 512-row prompt: 2.22 -> 1.44).
    const int64_t line = 64 / static_cast<int64_t>(sizeof(scalar_t));  // elements per line
    // Where row i's key and value of KV head h start (row i is not padding).
    auto key_at = [&](int64_t i, int64_t h) {
      PAGEDLLM_DEBUG_CHECK(sp[i] >= 0 && sp[i] < capacity, "write_kv_cache_: slot ", sp[i]);
      return kc + (sp[i] / bs * heads + h) * head_stride + sp[i] % bs;
    };
    auto value_at = [&](int64_t i, int64_t h) {
      return vc + (sp[i] / bs * heads + h) * head_stride + sp[i] % bs * d;
    };
    auto request_lines = [&](int64_t i) {
      if (sp[i] < 0) return;
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t x = 0; x < d; x += std::max<int64_t>(1, line / bs))
          __builtin_prefetch(key_at(i, h) + x * bs, 1, 3);
        for (int64_t x = 0; x < d; x += line) __builtin_prefetch(value_at(i, h) + x, 1, 3);
      }
    };
    parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
      request_lines(begin);
      for (int64_t i = begin; i < end; ++i) {
        if (i + 1 < end) request_lines(i + 1);
        if (sp[i] < 0) continue;  // padding
        for (int64_t h = 0; h < heads; ++h) {
          scalar_t* kdst = key_at(i, h);
          scalar_t* vdst = value_at(i, h);
          for (int64_t x = 0; x < d; ++x) {
            store(kdst + x * bs, kp[i * ks + h * d + x]);
            store(vdst + x, vp[i * vs + h * d + x]);
          }
        }
      }
    });
  });
}

// ----------------------------------------------------------- router logits
// out [T, E] = x [T, H] . w [E, H]^T in float32 (an MoE router), every element by one
// recipe: 16 partial sums, element h of the dot product into partial h % 16 with an exact
// fused multiply-add, then the partials added pairwise, 8, 4, 2 and 1 apart. torch's
// float32 matmul chooses its blocking by T, so a token's logits moved in their last bits
// with the tokens beside it, and the softmax and top-k after them gave a token other
// expert weights (at times other experts) alone than in a batch. With one recipe per
// element a row's logits are the same whatever shares its step, and the same on every
// instruction set: the vector code runs the 16 partials as lanes (one 16-lane register,
// or two of 8), the scalar code as an array, each partial seeing the same operations.
constexpr int kRouterLanes = 16;
constexpr int kRouterRows = 4;  // weight rows per pass: 4 independent chains share x's loads

// Partials [kRouterLanes] -> their sum, in the recipe's order.
inline float sum_partials(float (&part)[kRouterLanes]) {
  for (int width = kRouterLanes / 2; width >= 1; width /= 2)
    for (int l = 0; l < width; ++l) part[l] += part[l + width];
  return part[0];
}

// Dot products of x (H floats) with `rows` (<= kRouterRows) weight rows, H apart -> out.
inline void router_dots(const float* x, const float* w, int rows, int64_t h, float* out) {
  float part[kRouterRows][kRouterLanes] = {};
  int64_t i = 0;
#ifdef PAGEDLLM_AVX512
  __m512 acc[kRouterRows];
  for (int r = 0; r < kRouterRows; ++r) acc[r] = _mm512_setzero_ps();
  for (; i + kRouterLanes <= h; i += kRouterLanes) {
    const __m512 xv = _mm512_loadu_ps(x + i);
    for (int r = 0; r < rows; ++r)
      acc[r] = _mm512_fmadd_ps(xv, _mm512_loadu_ps(w + r * h + i), acc[r]);
  }
  for (int r = 0; r < rows; ++r) _mm512_storeu_ps(part[r], acc[r]);
#elif defined(PAGEDLLM_AVX2)
  __m256 lo[kRouterRows], hi[kRouterRows];  // lanes 0..7 and 8..15
  for (int r = 0; r < kRouterRows; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (; i + kRouterLanes <= h; i += kRouterLanes) {
    const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
    for (int r = 0; r < rows; ++r) {
      lo[r] = _mm256_fmadd_ps(x0, _mm256_loadu_ps(w + r * h + i), lo[r]);
      hi[r] = _mm256_fmadd_ps(x1, _mm256_loadu_ps(w + r * h + i + 8), hi[r]);
    }
  }
  for (int r = 0; r < rows; ++r) {
    _mm256_storeu_ps(part[r], lo[r]);
    _mm256_storeu_ps(part[r] + 8, hi[r]);
  }
#endif
  for (int r = 0; r < rows; ++r) {
    for (int64_t j = i; j < h; ++j) {  // the rest (all of it without vectors), lane j % 16
      float& p = part[r][j % kRouterLanes];
      p = std::fma(x[j], w[r * h + j], p);
    }
    out[r] = sum_partials(part[r]);
  }
}

Tensor router_logits(const Tensor& x_in, const Tensor& w_in) {
  Tensor x = x_in.contiguous(), w = w_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.scalar_type() == at::kFloat &&
                  w.scalar_type() == at::kFloat && x.size(1) == w.size(1),
              "router_logits needs float32 x [T, H] and weight [E, H]");
  const int64_t tokens = x.size(0), experts = w.size(0), h = x.size(1);
  Tensor out = at::empty({tokens, experts}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t passes = (experts + kRouterRows - 1) / kRouterRows;  // per token
  parallel_for(0, tokens * passes, 8, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / passes, e = (item % passes) * kRouterRows;
      const int rows = static_cast<int>(std::min<int64_t>(kRouterRows, experts - e));
      router_dots(xp + t * h, wp + e * h, rows, h, op + t * experts + e);
    }
  });
  return out;
}

// ----------------------------------------------------------------- argmax
// x [R, V] float32 -> int64 [R]: the index of each row's first maximum, as torch's
// max(dim=-1).indices (a NaN counts as the maximum: the first NaN's index).
Tensor argmax_rows(const Tensor& x_in) {
  Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0,
              "argmax_rows needs float32 [R, V] with V > 0");
  const int64_t rows = x.size(0), v = x.size(1);
  Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * v;
      float best = row[0];
      bool nan = std::isnan(best);
      int64_t i = 1;
#ifdef PAGEDLLM_AVX512
      // Pass 1: the maximum (and whether there is a NaN), 16 lanes at a time.
      __m512 m = _mm512_set1_ps(best);
      __mmask16 unordered = 0;
      for (; i + 16 <= v; i += 16) {
        const __m512 y = _mm512_loadu_ps(row + i);
        unordered |= _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q);
        m = _mm512_max_ps(m, y);
      }
      nan = nan || unordered != 0;
      best = std::max(best, _mm512_reduce_max_ps(m));
#elif defined(PAGEDLLM_AVX2)
      // Pass 1 as above, 8 lanes at a time (a maximum does not depend on the order).
      __m256 m = _mm256_set1_ps(best);
      __m256 unordered = _mm256_setzero_ps();
      for (; i + 8 <= v; i += 8) {
        const __m256 y = _mm256_loadu_ps(row + i);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(y, y, _CMP_UNORD_Q));
        m = _mm256_max_ps(m, y);
      }
      nan = nan || _mm256_movemask_ps(unordered) != 0;
      best = std::max(best, reduce_max8(m));
#endif
      for (; i < v; ++i) {
        nan = nan || std::isnan(row[i]);
        best = std::max(best, row[i]);
      }
      // Pass 2: the first index holding it (or the first NaN).
      int64_t at = 0;
      if (nan) {
        while (!std::isnan(row[at])) ++at;
      } else {
        while (row[at] != best) ++at;
      }
      op[r] = at;
    }
  });
  return out;
}

// The largest of x[0 .. n) (NaNs ignored where a finite value is beside them).
inline float row_max(const float* x, int64_t n) {
  int64_t i = 0;
  float m = -INFINITY;
#ifdef PAGEDLLM_AVX512
  __m512 vm = _mm512_set1_ps(-INFINITY);
  for (; i + 16 <= n; i += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(x + i));
  m = _mm512_reduce_max_ps(vm);
#elif defined(PAGEDLLM_AVX2)
  __m256 vm = _mm256_set1_ps(-INFINITY);
  for (; i + 8 <= n; i += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(x + i));
  m = reduce_max8(vm);
#endif
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// e^((x[i] - m) * inv_t) for the 16 positions of x from `x` (`lanes` of them valid; the
// others give 0) -> out[16]; returns their sum (reduce16's order).
inline float scaled_exp16(const float* x, int lanes, float m, float inv_t, float* out) {
#ifdef PAGEDLLM_AVX512
  const __mmask16 valid = static_cast<__mmask16>((1u << lanes) - 1);
  const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), valid, x);
  const __m512 e = exp512(_mm512_mul_ps(_mm512_sub_ps(v, _mm512_set1_ps(m)), _mm512_set1_ps(inv_t)));
  _mm512_storeu_ps(out, e);
  return reduce16(e);
#elif defined(PAGEDLLM_AVX2)
  alignas(32) float padded[16];
  for (int i = 0; i < 16; ++i) padded[i] = i < lanes ? x[i] : -INFINITY;
  const __m256 shift = _mm256_set1_ps(m), scale = _mm256_set1_ps(inv_t);
  const __m256 lo = exp256(_mm256_mul_ps(_mm256_sub_ps(_mm256_load_ps(padded), shift), scale));
  const __m256 hi = exp256(_mm256_mul_ps(_mm256_sub_ps(_mm256_load_ps(padded + 8), shift), scale));
  _mm256_storeu_ps(out, lo);
  _mm256_storeu_ps(out + 8, hi);
  return reduce16(lo, hi);
#else
  float sum = 0.f;
  for (int i = 0; i < 16; ++i) {
    out[i] = i < lanes ? std::exp((x[i] - m) * inv_t) : 0.f;
    sum += out[i];
  }
  return sum;
#endif
}

// One token per row of logits [R, V] float32, drawn from softmax(logits / temperature[r])
// by the inverse of its cumulative distribution at u[r] in [0, 1): the first token whose
// cumulative mass exceeds u * total. Tokens of zero probability (-inf logits) are never
// drawn. Each row is computed on its own, in a fixed order, so a row's token depends on
// nothing else in the batch (a seeded request draws the same token in any step).
//
// Per row: the maximum; the exponentials 16 at a time, each group's sum kept; the total as
// the groups' sums added in order; then the walk over the groups' sums to the group that
// crosses u * total, and over its 16 tokens. Where rounding leaves the crossing inside no
// token (the tokens' own running sum in the crossing group, or the total, fall just
// short), the last token of positive mass so far is drawn. The temperature is applied as
// a product with its inverse. Replaces softmax, a cumulative sum and a search per row in
// torch on one thread (~10 ms a step for 64 rows of a 49k vocabulary).
Tensor sample_rows(const Tensor& logits_in, const Tensor& temperature_in, const Tensor& u_in) {
  Tensor logits = logits_in.contiguous();
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "sample_rows needs float32 logits [R, V] with V > 0");
  const int64_t rows = logits.size(0), v = logits.size(1);
  Tensor temperature = temperature_in.to(at::kFloat).contiguous();
  Tensor u = u_in.to(at::kFloat).contiguous();
  TORCH_CHECK(temperature.numel() == rows && u.numel() == rows,
              "sample_rows needs one temperature and one uniform per row");
  Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* xp = logits.data_ptr<float>();
  const float* tp = temperature.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t groups = (v + 15) / 16;
  auto group_lanes = [v](int64_t g) { return static_cast<int>(std::min<int64_t>(16, v - 16 * g)); };
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(tp[r] > 0.f, "sample_rows: temperatures must be positive, got ", tp[r]);
  parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> group_sums;
    group_sums.resize(groups);
    alignas(64) float e[16];
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * v;
      const float m = row_max(row, v), inv_t = 1.f / tp[r];
      int64_t chosen = 0;  // every logit -inf (or NaN): the first token
      if (m == INFINITY) {  // a token of infinite logit takes all the mass: the first one
        while (row[chosen] != INFINITY) ++chosen;
      } else if (std::isfinite(m)) {
        float total = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          group_sums[g] = scaled_exp16(row + 16 * g, group_lanes(g), m, inv_t, e);
          total += group_sums[g];
        }
        const float target = up[r] * total;
        float below = 0.f;  // the mass of the groups before g
        int64_t last_group = -1, crossing = -1;
        for (int64_t g = 0; g < groups && crossing < 0; ++g) {
          if (!(group_sums[g] > 0.f)) continue;
          last_group = g;
          if (below + group_sums[g] > target) {
            scaled_exp16(row + 16 * g, group_lanes(g), m, inv_t, e);
            float mass = below;
            for (int i = 0; i < group_lanes(g); ++i) {
              if (!(e[i] > 0.f)) continue;
              crossing = 16 * g + i;  // the crossing token, or the group's last positive
              mass += e[i];
              if (mass > target) break;
            }
          }
          below += group_sums[g];
        }
        if (crossing >= 0) {
          chosen = crossing;
        } else if (last_group >= 0) {  // u * total rounded up to the total
          scaled_exp16(row + 16 * last_group, group_lanes(last_group), m, inv_t, e);
          for (int i = group_lanes(last_group) - 1; i >= 0; --i)
            if (e[i] > 0.f) {
              chosen = 16 * last_group + i;
              break;
            }
        }
      }
      op[r] = chosen;
    }
  });
  return out;
}

}  // namespace

namespace api {
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps, Tensor* out) {
  return pagedllm::rms_norm(x, weight, eps, out);
}
Tensor add_rms_norm(const Tensor& x, Tensor& residual, const Tensor& weight, double eps,
                    Tensor* out) {
  return pagedllm::add_rms_norm(x, residual, weight, eps, out);
}
void rotary_neox_(Tensor& q, Tensor& k, const Tensor& positions, const Tensor& cos,
                  const Tensor& sin) {
  pagedllm::rotary_neox_(q, k, positions, cos, sin);
}
Tensor gated_act(const Tensor& x, bool gelu, Tensor* out) {
  return pagedllm::gated_act(x, gelu, out);
}
void head_rms_norm_(Tensor& x, const Tensor& weight, double eps) {
  pagedllm::head_rms_norm_(x, weight, eps);
}
void write_kv_cache_(const Tensor& k, const Tensor& v, Tensor& k_cache, Tensor& v_cache,
                     const Tensor& slot_mapping) {
  pagedllm::write_kv_cache_(k, v, k_cache, v_cache, slot_mapping);
}
Tensor router_logits(const Tensor& x, const Tensor& weight) {
  return pagedllm::router_logits(x, weight);
}
}  // namespace api
}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
        [](const at::Tensor& x, const at::Tensor& weight, double eps) {
          return pagedllm::rms_norm(x, weight, eps);
        });
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor",
        [](const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
          return pagedllm::add_rms_norm(x, residual, weight, eps);
        });
  m.def("rotary_neox_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin) -> ()",
        &pagedllm::rotary_neox_);
  m.def("head_rms_norm_(Tensor(a!) x, Tensor weight, float eps) -> ()",
        &pagedllm::head_rms_norm_);
  m.def("gated_act(Tensor x, bool gelu) -> Tensor",
        [](const at::Tensor& x, bool gelu) { return pagedllm::gated_act(x, gelu); });
  m.def("argmax_rows(Tensor x) -> Tensor", &pagedllm::argmax_rows);
  m.def("router_logits(Tensor x, Tensor weight) -> Tensor", &pagedllm::router_logits);
  m.def("sample_rows(Tensor logits, Tensor temperature, Tensor u) -> Tensor",
        &pagedllm::sample_rows);
  m.def(
      "write_kv_cache_(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping) -> ()",
      &pagedllm::write_kv_cache_);
}

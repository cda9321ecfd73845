// Packed quantized linears (and dense bf16 ones) of the CPU fast path.
//
// Shapes (N out features, K in features, G group size, M rows of x):
//   u4   w[n, k] = scale[n, g] * q[n, k] + min[n, g],  g = k / 32, q in 0..15
//        qweight uint8 [N, K/2]: per group of 32 weights, 16 bytes, byte j = q[j] | q[j+16] << 4
//        (GGUF's own nibble order for Q4_0 / Q4_1 blocks); scales, mins [N, K/32]
//   i8   w[n, k] = scale[n, g] * q[n, k] (+ min[n, g]),  g = k / G, G in {16, 32}
//        qweight int8 [N, K]; scales [N, K/G]; mins [N, K/G] or empty
//   scales and mins float32, or float16 where every value is exact in float16
//   x float32 [M, K] -> y float32 [M, N]

#include "common.h"

namespace pagedllm {
namespace {

// --------------------------------------------------------------- packed linears
// Numerics of the fast path: weights dequantized exactly in fp32 and rounded to bf16,
// activations rounded to bf16, products summed in fp32 by vdpbf16ps into one 16-lane
// accumulator per output element, over the K groups of 32 in order, then reduced by a
// fixed tree (reduce16). Every kernel below follows that one recipe, so an output element
// is bitwise the same whatever the batch size and whichever kernel computed it: a
// request's tokens never depend on what it was batched with.
//
//   few rows (M <= kDirectRows): each weight group is decoded in registers and dotted
//     with every row;
//   more rows: each thread decodes a tile of kTileRows weight rows into a bf16 buffer
//     once, then runs a 4 x 4 register-blocked kernel over all M rows.

constexpr int64_t kDirectRows = 2;
constexpr int64_t kTileRows = 16;
constexpr int64_t kU4Group = 32;

#ifdef PAGEDLLM_AVX512BF16

// 32 fp32 weights (lo = w[0..15], hi = w[16..31]) as 32 bf16 in natural order.
inline __m512bh to_bf16x32(__m512 lo, __m512 hi) { return _mm512_cvtne2ps_pbh(hi, lo); }

inline __m512bh load_bf16x32(const bf16* p) {
  return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
}

// The sum of 16 lanes, always paired the same way: halves, quarters, pairs, last two.
inline float reduce16(__m512 v) {
  const __m256 v8 = _mm256_add_ps(_mm512_castps512_ps256(v),
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps(v8, 1));
  const __m128 v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
  const __m128 v1 = _mm_add_ss(v2, _mm_shuffle_ps(v2, v2, 1));
  return _mm_cvtss_f32(v1);
}

// Group decoders: group g (32 values) of one weight row as 32 bf16, natural order.
// S: the scales' type (float, or at::Half where every scale and min is exact in fp16).
template <typename S>
struct U4Row {
  const uint8_t* q;
  const S* scale;
  const S* mins;
  inline __m512bh operator()(int64_t g) const {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + g * 16));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m512 s = _mm512_set1_ps(static_cast<float>(scale[g]));
    const __m512 mn = _mm512_set1_ps(static_cast<float>(mins[g]));
    const __m512 q_lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask)));
    const __m512 q_hi =
        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)));
    return to_bf16x32(_mm512_fmadd_ps(q_lo, s, mn), _mm512_fmadd_ps(q_hi, s, mn));
  }
};

template <typename S>
struct I8Row {  // groups of `group` values (16 or 32) read 32 at a time
  const int8_t* q;
  const S* scale;
  const S* mins;  // may be null
  int64_t group;
  inline __m512 sixteen(int64_t start) const {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + start));
    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
    const int64_t g = start / group;
    const __m512 s = _mm512_set1_ps(static_cast<float>(scale[g]));
    return mins != nullptr ? _mm512_fmadd_ps(v, s, _mm512_set1_ps(static_cast<float>(mins[g])))
                           : _mm512_mul_ps(v, s);
  }
  inline __m512bh operator()(int64_t g32) const {
    return to_bf16x32(sixteen(g32 * 32), sixteen(g32 * 32 + 16));
  }
};

struct Bf16Row {  // a dense bf16 weight row: nothing to decode
  const bf16* w;
  inline __m512bh operator()(int64_t g) const { return load_bf16x32(w + g * 32); }
};

// out[r * out_stride + j] = dot(x row r, weight row first + j) for r < M, j < J, decoding
// each group once. J rows at a time keep J * M independent accumulator chains in flight
// (one chain alone waits on vdpbf16ps's latency); each output still has its own chain.
template <int M, int J, typename MakeRow>
inline void dot_direct(const MakeRow& make_row, int64_t first, const bf16* xb, int64_t k,
                       float* out, int64_t out_stride) {
  decltype(make_row(first)) rows[J];
  for (int j = 0; j < J; ++j) rows[j] = make_row(first + j);
  __m512 acc[M][J];
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < k / 32; ++g) {
    __m512bh xv[M];
    for (int r = 0; r < M; ++r) xv[r] = load_bf16x32(xb + r * k + g * 32);
    for (int j = 0; j < J; ++j) {
      const __m512bh w = rows[j](g);
      for (int r = 0; r < M; ++r) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], w, xv[r]);
    }
  }
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < J; ++j) out[r * out_stride + first + j] = reduce16(acc[r][j]);
}

template <int M, typename MakeRow>
inline void dot_direct_rows(const MakeRow& make_row, int64_t begin, int64_t end, const bf16* xb,
                            int64_t k, float* out, int64_t out_stride) {
  int64_t row = begin;
  for (; row + 4 <= end; row += 4) dot_direct<M, 4>(make_row, row, xb, k, out, out_stride);
  for (; row < end; ++row) dot_direct<M, 1>(make_row, row, xb, k, out, out_stride);
}

// R x rows against J decoded weight rows of a tile: R * J accumulators in registers.
template <int R, int J>
inline void micro_kernel(const bf16* xb, const bf16* tile, int64_t k, float* out,
                         int64_t out_stride) {
  __m512 acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < k / 32; ++g) {
    __m512bh w[J];
    for (int j = 0; j < J; ++j) w[j] = load_bf16x32(tile + j * k + g * 32);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = load_bf16x32(xb + r * k + g * 32);
      for (int j = 0; j < J; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], w[j], xv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) out[r * out_stride + j] = reduce16(acc[r][j]);
}

template <int R>
inline void micro_rows(int64_t j_count, const bf16* xb, const bf16* tile, int64_t k, float* out,
                       int64_t out_stride) {
  switch (j_count) {
    case 4: return micro_kernel<R, 4>(xb, tile, k, out, out_stride);
    case 3: return micro_kernel<R, 3>(xb, tile, k, out, out_stride);
    case 2: return micro_kernel<R, 2>(xb, tile, k, out, out_stride);
    default: return micro_kernel<R, 1>(xb, tile, k, out, out_stride);
  }
}

// out[:, n0:n0+rows] for all m x rows, from `rows` weight rows decoded into `tile`.
inline void tile_gemm(const bf16* xb, int64_t m, int64_t k, const bf16* tile, int64_t rows,
                      float* out, int64_t out_stride) {
  for (int64_t r0 = 0; r0 < m; r0 += 4) {
    const int64_t r_count = std::min<int64_t>(4, m - r0);
    for (int64_t j0 = 0; j0 < rows; j0 += 4) {
      const int64_t j_count = std::min<int64_t>(4, rows - j0);
      const bf16* x = xb + r0 * k;
      const bf16* w = tile + j0 * k;
      float* o = out + r0 * out_stride + j0;
      switch (r_count) {
        case 4: micro_rows<4>(j_count, x, w, k, o, out_stride); break;
        case 3: micro_rows<3>(j_count, x, w, k, o, out_stride); break;
        case 2: micro_rows<2>(j_count, x, w, k, o, out_stride); break;
        default: micro_rows<1>(j_count, x, w, k, o, out_stride); break;
      }
    }
  }
}

template <typename MakeRow>
void decode_rows(MakeRow make_row, int64_t first, int64_t count, int64_t k, bf16* dst) {
  for (int64_t j = 0; j < count; ++j) {
    const auto row = make_row(first + j);
    for (int64_t g = 0; g < k / 32; ++g)
      _mm512_storeu_si512(reinterpret_cast<void*>(dst + j * k + g * 32), (__m512i)row(g));
  }
}

#else  // no AVX512-BF16: the same recipe in scalar code (slow; the engine avoids it)

template <typename S>
struct U4Row {
  const uint8_t* q;
  const S* scale;
  const S* mins;
  inline void operator()(int64_t g, bf16* w) const {
    const float s = static_cast<float>(scale[g]), mn = static_cast<float>(mins[g]);
    for (int j = 0; j < 16; ++j) {
      w[j] = bf16(std::fma(static_cast<float>(q[g * 16 + j] & 0x0F), s, mn));
      w[j + 16] = bf16(std::fma(static_cast<float>(q[g * 16 + j] >> 4), s, mn));
    }
  }
};

template <typename S>
struct I8Row {
  const int8_t* q;
  const S* scale;
  const S* mins;
  int64_t group;
  inline void operator()(int64_t g32, bf16* w) const {
    for (int j = 0; j < 32; ++j) {
      const int64_t i = g32 * 32 + j, g = i / group;
      const float v = static_cast<float>(q[i]), s = static_cast<float>(scale[g]);
      w[j] = bf16(mins != nullptr ? std::fma(v, s, static_cast<float>(mins[g])) : v * s);
    }
  }
};

struct Bf16Row {
  const bf16* w;
  inline void operator()(int64_t g, bf16* out) const {
    for (int j = 0; j < 32; ++j) out[j] = w[g * 32 + j];
  }
};

template <typename MakeRow>
void decode_rows(MakeRow make_row, int64_t first, int64_t count, int64_t k, bf16* dst) {
  for (int64_t j = 0; j < count; ++j) {
    const auto row = make_row(first + j);
    for (int64_t g = 0; g < k / 32; ++g) row(g, dst + j * k + g * 32);
  }
}

inline void tile_gemm(const bf16* xb, int64_t m, int64_t k, const bf16* tile, int64_t rows,
                      float* out, int64_t out_stride) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < rows; ++j) {
      float lanes[16] = {0};
      for (int64_t i = 0; i < k; ++i)
        lanes[(i % 32) / 2] += static_cast<float>(tile[j * k + i]) * static_cast<float>(xb[r * k + i]);
      float sum = 0.f;
      for (float v : lanes) sum += v;
      out[r * out_stride + j] = sum;
    }
}
#endif

// x [M, K] float32 -> bf16 [M, K] (round to nearest even, as Tensor.to(torch.bfloat16)),
// into a buffer kept by the calling thread (no allocation per call).
const bf16* activations_bf16(const Tensor& x_in) {
  Tensor x = x_in.scalar_type() == at::kFloat ? x_in.contiguous() : x_in.to(at::kFloat).contiguous();
  thread_local std::vector<bf16> buffer;
  const int64_t count = x.numel();
  if (static_cast<int64_t>(buffer.size()) < count) buffer.resize(count);
  const float* src = x.data_ptr<float>();
  for (int64_t i = 0; i < count; ++i) buffer[i] = bf16(src[i]);
  return buffer.data();
}

// y [M, N] float32 = x [M, K] @ W^T for a weight of N rows given by make_row(n).
template <typename MakeRow>
Tensor packed_matmul(const Tensor& x_in, int64_t n, int64_t k, MakeRow make_row) {
  TORCH_CHECK(x_in.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(x_in.size(1) == k, "x has ", x_in.size(1), " features, the weight ", k);
  TORCH_CHECK(k % 32 == 0, "K must be a multiple of 32, got ", k);
  const int64_t m = x_in.size(0);
  const bf16* xp = activations_bf16(x_in);
  Tensor out = at::empty({m, n}, x_in.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const int64_t num_tiles = (n + kTileRows - 1) / kTileRows;
#ifdef PAGEDLLM_AVX512BF16
  if (m <= kDirectRows) {
    at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
      const int64_t first = begin * kTileRows, last = std::min(n, end * kTileRows);
      if (m == 1)
        dot_direct_rows<1>(make_row, first, last, xp, k, op, n);
      else
        dot_direct_rows<2>(make_row, first, last, xp, k, op, n);
    });
    return out;
  }
#endif
  at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<bf16> tile;
    tile.resize(kTileRows * k);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t first = t * kTileRows, rows = std::min(kTileRows, n - first);
      decode_rows(make_row, first, rows, k, tile.data());
      tile_gemm(xp, m, k, tile.data(), rows, op + first, n);
    }
  });
  return out;
}

void check_scales(const Tensor& scales, const Tensor& mins) {
  check_cpu_contiguous(scales, "scales");
  TORCH_CHECK(scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf,
              "scales must be float32 or float16");
  TORCH_CHECK(mins.numel() == 0 || (mins.is_contiguous() && mins.sizes() == scales.sizes() &&
                                    mins.scalar_type() == scales.scalar_type()),
              "mins must be empty or shaped and typed like scales");
}

void check_u4(const Tensor& qweight, const Tensor& scales, const Tensor& mins) {
  check_cpu_contiguous(qweight, "qweight");
  check_scales(scales, mins);
  TORCH_CHECK(mins.numel() > 0, "u4 weights need mins");
  TORCH_CHECK(qweight.scalar_type() == at::kByte, "u4 qweight must be uint8 [N, K/2]");
  const int64_t n = qweight.size(0), groups = qweight.size(1) * 2 / kU4Group;
  TORCH_CHECK(scales.size(0) == n && scales.size(1) == groups, "scales must be [N, K/32]");
  TORCH_CHECK(mins.size(0) == n && mins.size(1) == groups, "mins must be [N, K/32]");
}

void check_i8(const Tensor& qweight, const Tensor& scales, const Tensor& mins, int64_t group) {
  check_cpu_contiguous(qweight, "qweight");
  check_scales(scales, mins);
  TORCH_CHECK(qweight.scalar_type() == at::kChar, "i8 qweight must be int8 [N, K]");
  TORCH_CHECK((group == 16 || group == 32) && qweight.size(1) % 32 == 0,
              "i8 groups must be 16 or 32 values and K a multiple of 32");
  const int64_t n = qweight.size(0), groups = qweight.size(1) / group;
  TORCH_CHECK(scales.size(0) == n && scales.size(1) == groups, "scales must be [N, K/G]");
}

template <typename S>
U4Row<S> u4_row(const Tensor& qweight, const Tensor& scales, const Tensor& mins, int64_t row) {
  const int64_t k = qweight.size(1) * 2, groups = k / kU4Group;
  return U4Row<S>{qweight.data_ptr<uint8_t>() + row * (k / 2),
                  scales.data_ptr<S>() + row * groups, mins.data_ptr<S>() + row * groups};
}

template <typename S>
I8Row<S> i8_row(const Tensor& qweight, const Tensor& scales, const Tensor& mins, int64_t group,
                int64_t row) {
  const int64_t k = qweight.size(1), groups = k / group;
  return I8Row<S>{qweight.data_ptr<int8_t>() + row * k, scales.data_ptr<S>() + row * groups,
                  mins.numel() > 0 ? mins.data_ptr<S>() + row * groups : nullptr, group};
}

// Calls body(make_row) with the row maker of a u4 / i8 weight, for its scales' type.
template <typename Body>
auto with_u4_rows(const Tensor& qweight, const Tensor& scales, const Tensor& mins, Body body) {
  check_u4(qweight, scales, mins);
  if (scales.scalar_type() == at::kHalf)
    return body([&](int64_t row) { return u4_row<at::Half>(qweight, scales, mins, row); });
  return body([&](int64_t row) { return u4_row<float>(qweight, scales, mins, row); });
}

template <typename Body>
auto with_i8_rows(const Tensor& qweight, const Tensor& scales, const Tensor& mins, int64_t group,
                  Body body) {
  check_i8(qweight, scales, mins, group);
  if (scales.scalar_type() == at::kHalf)
    return body([&](int64_t row) { return i8_row<at::Half>(qweight, scales, mins, group, row); });
  return body([&](int64_t row) { return i8_row<float>(qweight, scales, mins, group, row); });
}

// x [M, K] float32; qweight uint8 [N, K/2]; scales, mins [N, K/32] -> [M, N] float32
Tensor u4_linear(const Tensor& x, const Tensor& qweight, const Tensor& scales,
                 const Tensor& mins) {
  return with_u4_rows(qweight, scales, mins, [&](auto make_row) {
    return packed_matmul(x, qweight.size(0), qweight.size(1) * 2, make_row);
  });
}

// x [M, K] float32; qweight int8 [N, K]; scales [N, K/G]; mins [N, K/G] or empty.
Tensor i8_linear(const Tensor& x, const Tensor& qweight, const Tensor& scales,
                 const Tensor& mins, int64_t group) {
  return with_i8_rows(qweight, scales, mins, group, [&](auto make_row) {
    return packed_matmul(x, qweight.size(0), qweight.size(1), make_row);
  });
}

// x [M, K] float32; weight bf16 [N, K] -> [M, N] float32
Tensor bf16_linear(const Tensor& x, const Tensor& weight) {
  check_cpu_contiguous(weight, "weight");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "weight must be bf16");
  const int64_t k = weight.size(1);
  const bf16* wp = weight.data_ptr<bf16>();
  return packed_matmul(x, weight.size(0), k, [&](int64_t row) { return Bf16Row{wp + row * k}; });
}

// The bf16 [N, K] weight the kernels multiply (tests; dense exports).
template <typename MakeRow>
Tensor decode_all(int64_t n, int64_t k, MakeRow make_row, const at::TensorOptions& options) {
  Tensor out = at::empty({n, k}, options.dtype(at::kBFloat16));
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, n, kTileRows, [&](int64_t begin, int64_t end) {
    decode_rows(make_row, begin, end - begin, k, op + begin * k);
  });
  return out;
}

Tensor u4_dequant_bf16(const Tensor& qweight, const Tensor& scales, const Tensor& mins) {
  return with_u4_rows(qweight, scales, mins, [&](auto make_row) {
    return decode_all(qweight.size(0), qweight.size(1) * 2, make_row, qweight.options());
  });
}

Tensor i8_dequant_bf16(const Tensor& qweight, const Tensor& scales, const Tensor& mins,
                       int64_t group) {
  return with_i8_rows(qweight, scales, mins, group, [&](auto make_row) {
    return decode_all(qweight.size(0), qweight.size(1), make_row, qweight.options());
  });
}

// Rows of a packed i8 weight, dequantized to float32: the embedding lookup of a quantized
// table. ids [T] int64 -> [T, K] float32 (scale * q + min in one rounding, not bf16).
Tensor i8_embedding(const Tensor& ids_in, const Tensor& qweight, const Tensor& scales,
                    const Tensor& mins, int64_t group) {
  check_i8(qweight, scales, mins, group);
  Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t t = ids.numel(), k = qweight.size(1), n = qweight.size(0), num_groups = k / group;
  const bool has_mins = mins.numel() > 0;
  Tensor out = at::empty({t, k}, qweight.options().dtype(at::kFloat));
  const int64_t* idp = ids.data_ptr<int64_t>();
  const int8_t* qp = qweight.data_ptr<int8_t>();
  float* op = out.data_ptr<float>();
  auto lookup = [&](const auto* sp, const auto* mp) {
    for (int64_t i = 0; i < t; ++i) {
      const int64_t row = idp[i];
      TORCH_CHECK(row >= 0 && row < n, "token id ", row, " is outside the table of ", n);
      for (int64_t g = 0; g < num_groups; ++g) {
        const float s = static_cast<float>(sp[row * num_groups + g]);
        const float mn = has_mins ? static_cast<float>(mp[row * num_groups + g]) : 0.f;
        for (int64_t j = 0; j < group; ++j)
          op[i * k + g * group + j] =
              std::fma(static_cast<float>(qp[row * k + g * group + j]), s, mn);
      }
    }
  };
  if (scales.scalar_type() == at::kHalf)
    lookup(scales.data_ptr<at::Half>(), has_mins ? mins.data_ptr<at::Half>() : nullptr);
  else
    lookup(scales.data_ptr<float>(), has_mins ? mins.data_ptr<float>() : nullptr);
  return out;
}

}  // namespace
}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("u4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor mins) -> Tensor",
        &pagedllm::u4_linear);
  m.def("u4_dequant_bf16(Tensor qweight, Tensor scales, Tensor mins) -> Tensor",
        &pagedllm::u4_dequant_bf16);
  m.def("i8_linear(Tensor x, Tensor qweight, Tensor scales, Tensor mins, int group) -> Tensor",
        &pagedllm::i8_linear);
  m.def("i8_dequant_bf16(Tensor qweight, Tensor scales, Tensor mins, int group) -> Tensor",
        &pagedllm::i8_dequant_bf16);
  m.def("bf16_linear(Tensor x, Tensor weight) -> Tensor", &pagedllm::bf16_linear);
  m.def("i8_embedding(Tensor ids, Tensor qweight, Tensor scales, Tensor mins, int group) -> Tensor",
        &pagedllm::i8_embedding);
}

// Linears of the CPU fast path: packed quantized weights (GGUF, AWQ) and dense bf16 ones.
//
// Shapes (N out features, K in features, M rows of x):
//   u4    w[n, k] = scale[n, g] * q[n, k] + min[n, g],  g = k / 32, q in 0..15
//         qweight uint8 [N, K/2]: per group of 32 weights, 16 bytes, byte j = q[j] | q[j+16] << 4
//         (GGUF's own nibble order for Q4_0 / Q4_1 blocks); scales, mins [N, K/32]
//   i8    w[n, k] = scale[n, g] * q[n, k] (+ min[n, g]),  g = k / G, G in {16, 32}
//         qweight int8 [N, K]; scales [N, K/G]; mins [N, K/G] or empty
//   bf16  weight bf16 [N, K]
//   scales and mins float32, or float16 where every value is exact in float16
//   x float32 [M, K] -> y float32 [M, N];  K a multiple of 32
//
// The recipe: a weight is dequantized exactly (fma(q, scale, min) in float32, the value
// llama.cpp dequantizes to) and rounded to bf16; x is rounded to bf16; y[m, n] is summed by
// vdpbf16ps into one 16-lane float32 accumulator over the K groups of 32 in order, then
// reduced by a fixed tree (reduce16). Both kernels run that one sequence of operations for
// every output element, so an element is bitwise the same whatever the batch size and
// whichever kernel computed it: a request's tokens never depend on what shares its step.
//
//   few rows (M <= kDirectRows): each weight group is decoded in registers and dotted with
//     every row, four weight rows at a time (independent accumulator chains);
//   more rows: each thread decodes kTileRows weight rows into a bf16 tile once, then runs
//     a 4 x 4 register-blocked kernel over all M rows.

#include "common.h"

namespace pagedllm {
namespace {

constexpr int64_t kDirectRows = 2;
constexpr int64_t kTileRows = 16;

// x [M, K] float32 -> bf16 [M, K] (round to nearest even, as Tensor.to(torch.bfloat16)) in
// a buffer kept by the calling thread.
const bf16* activations_bf16(const Tensor& x) {
  thread_local std::vector<bf16> buffer;
  const int64_t count = x.numel();
  if (static_cast<int64_t>(buffer.size()) < count) buffer.resize(count);
  const float* src = x.data_ptr<float>();
  for (int64_t i = 0; i < count; ++i) buffer[i] = bf16(src[i]);
  return buffer.data();
}

template <typename S>
inline float as_float(S v) {
  if constexpr (std::is_same_v<S, at::Half>) {
#ifdef PAGEDLLM_AVX512
    return _cvtsh_ss(v.x);  // one F16C instruction
#endif
  }
  return static_cast<float>(v);
}

#ifdef PAGEDLLM_AVX512
// 32 bf16 values in one 512-bit register, natural order: 32-bit lane l holds elements
// 2l (low half) and 2l + 1 (high half). dot_bf16x32(acc, a, b) adds, in each lane l,
// a[2l] * b[2l] and a[2l + 1] * b[2l + 1] to acc[l], as vdpbf16ps does.
#ifdef PAGEDLLM_AVX512BF16
using bf16x32 = __m512bh;

// 32 float32 weights (lo = w[0..15], hi = w[16..31]) as 32 bf16 in natural order.
inline bf16x32 to_bf16x32(__m512 lo, __m512 hi) { return _mm512_cvtne2ps_pbh(hi, lo); }

inline bf16x32 load_bf16x32(const bf16* p) {
  return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
}

inline __m512 dot_bf16x32(__m512 acc, bf16x32 a, bf16x32 b) { return _mm512_dpbf16_ps(acc, a, b); }
#else
// AVX-512 without the BF16 extension (e.g. Cascade Lake): the same products in float32
// FMAs. A bf16 widens to float32 exactly (the high half of a lane is already its float32
// bit pattern once the low half is masked off; the low half is shifted up), and the
// product of two bf16 values is exact in float32, so each fma rounds once: the sum of a
// pair is rounded the way the vdpbf16ps emulation in the scalar fallback rounds it. About
// 2x the instructions of vdpbf16ps: decode, which reads the weights, barely notices.
using bf16x32 = __m512i;

// 16 float32 -> 16 bf16 (round to nearest even) in the low half of each 32-bit lane. The
// inputs are finite (decoded weights); activations are rounded by c10::BFloat16.
inline __m512i round_to_bf16_lanes(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF));
  return _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
}

inline bf16x32 to_bf16x32(__m512 lo, __m512 hi) {
  const __m256i low = _mm512_cvtepi32_epi16(round_to_bf16_lanes(lo));
  const __m256i high = _mm512_cvtepi32_epi16(round_to_bf16_lanes(hi));
  return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
}

inline bf16x32 load_bf16x32(const bf16* p) {
  return _mm512_loadu_si512(reinterpret_cast<const void*>(p));
}

inline __m512 dot_bf16x32(__m512 acc, bf16x32 a, bf16x32 b) {
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512 a_even = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16));
  const __m512 b_even = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
  const __m512 a_odd = _mm512_castsi512_ps(_mm512_and_si512(a, high_half));
  const __m512 b_odd = _mm512_castsi512_ps(_mm512_and_si512(b, high_half));
  return _mm512_fmadd_ps(a_odd, b_odd, _mm512_fmadd_ps(a_even, b_even, acc));
}
#endif

// Row decoders: group g (32 weights) of one weight row as 32 bf16 in K order.
template <typename S>
struct U4Row {
  const uint8_t* q;
  const S* scale;
  const S* mins;
  inline bf16x32 operator()(int64_t g) const {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + g * 16));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m512 s = _mm512_set1_ps(as_float(scale[g]));
    const __m512 mn = _mm512_set1_ps(as_float(mins[g]));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask)));
    const __m512 hi =
        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)));
    return to_bf16x32(_mm512_fmadd_ps(lo, s, mn), _mm512_fmadd_ps(hi, s, mn));
  }
};

template <typename S, int G>
struct I8Row {
  const int8_t* q;
  const S* scale;
  const S* mins;  // may be null
  inline __m512 sixteen(int64_t start) const {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + start));
    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
    const int64_t g = start / G;
    const __m512 s = _mm512_set1_ps(as_float(scale[g]));
    return mins != nullptr ? _mm512_fmadd_ps(v, s, _mm512_set1_ps(as_float(mins[g])))
                           : _mm512_mul_ps(v, s);
  }
  inline bf16x32 operator()(int64_t g32) const {
    return to_bf16x32(sixteen(g32 * 32), sixteen(g32 * 32 + 16));
  }
};

struct Bf16Row {
  const bf16* w;
  inline bf16x32 operator()(int64_t g) const { return load_bf16x32(w + g * 32); }
};

// Outputs first .. first + J for x rows 0 .. M.
template <int M, int J, typename MakeRow>
inline void dot_direct(const MakeRow& make_row, int64_t first, const bf16* xb, int64_t k,
                       float* out, int64_t out_stride) {
  decltype(make_row(first)) rows[J];
  for (int j = 0; j < J; ++j) rows[j] = make_row(first + j);
  __m512 acc[M][J];
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < k / 32; ++g) {
    bf16x32 xv[M];
    for (int r = 0; r < M; ++r) xv[r] = load_bf16x32(xb + r * k + g * 32);
    for (int j = 0; j < J; ++j) {
      const bf16x32 w = rows[j](g);
      for (int r = 0; r < M; ++r) acc[r][j] = dot_bf16x32(acc[r][j], w, xv[r]);
    }
  }
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < J; ++j) out[r * out_stride + first + j] = reduce16(acc[r][j]);
}

// R x rows against J rows of a decoded tile: R * J accumulators in registers.
template <int R, int J>
inline void block_kernel(const bf16* xb, const bf16* tile, int64_t k, float* out,
                         int64_t out_stride) {
  __m512 acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < k / 32; ++g) {
    bf16x32 w[J];
    for (int j = 0; j < J; ++j) w[j] = load_bf16x32(tile + j * k + g * 32);
    for (int r = 0; r < R; ++r) {
      const bf16x32 xv = load_bf16x32(xb + r * k + g * 32);
      for (int j = 0; j < J; ++j) acc[r][j] = dot_bf16x32(acc[r][j], w[j], xv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) out[r * out_stride + j] = reduce16(acc[r][j]);
}

template <int R>
inline void block_rows(int64_t j_count, const bf16* xb, const bf16* tile, int64_t k, float* out,
                       int64_t out_stride) {
  switch (j_count) {
    case 4: return block_kernel<R, 4>(xb, tile, k, out, out_stride);
    case 3: return block_kernel<R, 3>(xb, tile, k, out, out_stride);
    case 2: return block_kernel<R, 2>(xb, tile, k, out, out_stride);
    default: return block_kernel<R, 1>(xb, tile, k, out, out_stride);
  }
}

// out[:, first : first + rows] for all M x rows from a tile of `rows` decoded weight rows.
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
        case 4: block_rows<4>(j_count, x, w, k, o, out_stride); break;
        case 3: block_rows<3>(j_count, x, w, k, o, out_stride); break;
        case 2: block_rows<2>(j_count, x, w, k, o, out_stride); break;
        default: block_rows<1>(j_count, x, w, k, o, out_stride); break;
      }
    }
  }
}

template <typename MakeRow>
void decode_rows(const MakeRow& make_row, int64_t first, int64_t count, int64_t k, bf16* dst) {
  for (int64_t j = 0; j < count; ++j) {
    const auto row = make_row(first + j);
    for (int64_t g = 0; g < k / 32; ++g)
      _mm512_storeu_si512(reinterpret_cast<void*>(dst + j * k + g * 32), (__m512i)row(g));
  }
}

#else  // no AVX-512: the same recipe in plain C++ (slow; the engine avoids this path)

template <typename S>
struct U4Row {
  const uint8_t* q;
  const S* scale;
  const S* mins;
  inline void operator()(int64_t g, bf16* w) const {
    const float s = as_float(scale[g]), mn = as_float(mins[g]);
    for (int j = 0; j < 16; ++j) {
      w[j] = bf16(std::fma(static_cast<float>(q[g * 16 + j] & 0x0F), s, mn));
      w[j + 16] = bf16(std::fma(static_cast<float>(q[g * 16 + j] >> 4), s, mn));
    }
  }
};

template <typename S, int G>
struct I8Row {
  const int8_t* q;
  const S* scale;
  const S* mins;
  inline void operator()(int64_t g32, bf16* w) const {
    for (int j = 0; j < 32; ++j) {
      const int64_t i = g32 * 32 + j, g = i / G;
      const float v = static_cast<float>(q[i]), s = as_float(scale[g]);
      w[j] = bf16(mins != nullptr ? std::fma(v, s, as_float(mins[g])) : v * s);
    }
  }
};

struct Bf16Row {
  const bf16* w;
  inline void operator()(int64_t g, bf16* out) const { std::copy(w + g * 32, w + g * 32 + 32, out); }
};

template <typename MakeRow>
void decode_rows(const MakeRow& make_row, int64_t first, int64_t count, int64_t k, bf16* dst) {
  for (int64_t j = 0; j < count; ++j) {
    const auto row = make_row(first + j);
    for (int64_t g = 0; g < k / 32; ++g) row(g, dst + j * k + g * 32);
  }
}

// Emulates the 16 lanes of vdpbf16ps (lane l sums pairs 2l, 2l + 1 of each group).
inline void tile_gemm(const bf16* xb, int64_t m, int64_t k, const bf16* tile, int64_t rows,
                      float* out, int64_t out_stride) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < rows; ++j) {
      float lanes[16] = {0};
      for (int64_t i = 0; i < k; ++i)
        lanes[(i % 32) / 2] += static_cast<float>(tile[j * k + i]) * static_cast<float>(xb[r * k + i]);
      float v8[8], v4[4];
      for (int l = 0; l < 8; ++l) v8[l] = lanes[l] + lanes[l + 8];
      for (int l = 0; l < 4; ++l) v4[l] = v8[l] + v8[l + 4];
      out[r * out_stride + j] = ((v4[0] + v4[2]) + (v4[1] + v4[3]));
    }
}
#endif

// y [M, N] float32 = x [M, K] @ W^T for a weight of N rows given by make_row(n).
template <typename MakeRow>
Tensor packed_matmul(const Tensor& x_in, int64_t n, int64_t k, const MakeRow& make_row) {
  TORCH_CHECK(x_in.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(x_in.size(1) == k, "x has ", x_in.size(1), " features, the weight ", k);
  TORCH_CHECK(k % 32 == 0, "K must be a multiple of 32, got ", k);
  Tensor x = x_in.scalar_type() == at::kFloat ? x_in.contiguous() : x_in.to(at::kFloat).contiguous();
  const int64_t m = x.size(0);
  const bf16* xb = activations_bf16(x);
  Tensor out = at::empty({m, n}, x.options());
  float* op = out.data_ptr<float>();
  const int64_t num_tiles = (n + kTileRows - 1) / kTileRows;
#ifdef PAGEDLLM_AVX512
  if (m <= kDirectRows) {
    at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
      const int64_t last = std::min(n, end * kTileRows);
      int64_t row = begin * kTileRows;
      for (; row + 4 <= last; row += 4) {
        if (m == 1) dot_direct<1, 4>(make_row, row, xb, k, op, n);
        else dot_direct<2, 4>(make_row, row, xb, k, op, n);
      }
      for (; row < last; ++row) {
        if (m == 1) dot_direct<1, 1>(make_row, row, xb, k, op, n);
        else dot_direct<2, 1>(make_row, row, xb, k, op, n);
      }
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
      tile_gemm(xb, m, k, tile.data(), rows, op + first, n);
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
  const int64_t n = qweight.size(0), groups = qweight.size(1) * 2 / 32;
  TORCH_CHECK(scales.size(0) == n && scales.size(1) == groups, "scales must be [N, K/32]");
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
  const int64_t k = qweight.size(1) * 2, groups = k / 32;
  return U4Row<S>{qweight.data_ptr<uint8_t>() + row * (k / 2),
                  scales.data_ptr<S>() + row * groups, mins.data_ptr<S>() + row * groups};
}

template <typename S, int G>
I8Row<S, G> i8_row(const Tensor& qweight, const Tensor& scales, const Tensor& mins,
                   int64_t row) {
  const int64_t k = qweight.size(1), groups = k / G;
  return I8Row<S, G>{qweight.data_ptr<int8_t>() + row * k, scales.data_ptr<S>() + row * groups,
                     mins.numel() > 0 ? mins.data_ptr<S>() + row * groups : nullptr};
}

// Calls body(make_row) with the row maker of a weight, for its scales' type and group.
template <typename Body>
Tensor with_u4_rows(const Tensor& qweight, const Tensor& scales, const Tensor& mins, Body body) {
  check_u4(qweight, scales, mins);
  if (scales.scalar_type() == at::kHalf)
    return body([&](int64_t r) { return u4_row<at::Half>(qweight, scales, mins, r); });
  return body([&](int64_t r) { return u4_row<float>(qweight, scales, mins, r); });
}

template <typename Body>
Tensor with_i8_rows(const Tensor& qweight, const Tensor& scales, const Tensor& mins,
                    int64_t group, Body body) {
  check_i8(qweight, scales, mins, group);
  const bool half = scales.scalar_type() == at::kHalf;
  if (group == 16) {
    if (half) return body([&](int64_t r) { return i8_row<at::Half, 16>(qweight, scales, mins, r); });
    return body([&](int64_t r) { return i8_row<float, 16>(qweight, scales, mins, r); });
  }
  if (half) return body([&](int64_t r) { return i8_row<at::Half, 32>(qweight, scales, mins, r); });
  return body([&](int64_t r) { return i8_row<float, 32>(qweight, scales, mins, r); });
}

// x [M, K] float32; qweight uint8 [N, K/2]; scales, mins [N, K/32] -> [M, N] float32
Tensor u4_linear(const Tensor& x, const Tensor& qweight, const Tensor& scales,
                 const Tensor& mins) {
  return with_u4_rows(qweight, scales, mins, [&](const auto& make_row) {
    return packed_matmul(x, qweight.size(0), qweight.size(1) * 2, make_row);
  });
}

// x [M, K] float32; qweight int8 [N, K]; scales [N, K/G]; mins [N, K/G] or empty.
Tensor i8_linear(const Tensor& x, const Tensor& qweight, const Tensor& scales,
                 const Tensor& mins, int64_t group) {
  return with_i8_rows(qweight, scales, mins, group, [&](const auto& make_row) {
    return packed_matmul(x, qweight.size(0), qweight.size(1), make_row);
  });
}

// x [M, K] float32; weight bf16 [N, K] -> [M, N] float32
Tensor bf16_linear(const Tensor& x, const Tensor& weight) {
  check_cpu_contiguous(weight, "weight");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "weight must be bf16");
  const int64_t k = weight.size(1);
  const bf16* wp = weight.data_ptr<bf16>();
  return packed_matmul(x, weight.size(0), k, [&](int64_t r) { return Bf16Row{wp + r * k}; });
}

// The bf16 [N, K] weight the kernels multiply by (for tests).
template <typename MakeRow>
Tensor decode_all(int64_t n, int64_t k, const MakeRow& make_row, const at::TensorOptions& opts) {
  Tensor out = at::empty({n, k}, opts.dtype(at::kBFloat16));
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, n, kTileRows, [&](int64_t begin, int64_t end) {
    decode_rows(make_row, begin, end - begin, k, op + begin * k);
  });
  return out;
}

Tensor u4_dequant_bf16(const Tensor& qweight, const Tensor& scales, const Tensor& mins) {
  return with_u4_rows(qweight, scales, mins, [&](const auto& make_row) {
    return decode_all(qweight.size(0), qweight.size(1) * 2, make_row, qweight.options());
  });
}

Tensor i8_dequant_bf16(const Tensor& qweight, const Tensor& scales, const Tensor& mins,
                       int64_t group) {
  return with_i8_rows(qweight, scales, mins, group, [&](const auto& make_row) {
    return decode_all(qweight.size(0), qweight.size(1), make_row, qweight.options());
  });
}

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
  m.def("i8_linear(Tensor x, Tensor qweight, Tensor scales, Tensor mins, int group) -> Tensor",
        &pagedllm::i8_linear);
  m.def("bf16_linear(Tensor x, Tensor weight) -> Tensor", &pagedllm::bf16_linear);
  m.def("u4_dequant_bf16(Tensor qweight, Tensor scales, Tensor mins) -> Tensor",
        &pagedllm::u4_dequant_bf16);
  m.def("i8_dequant_bf16(Tensor qweight, Tensor scales, Tensor mins, int group) -> Tensor",
        &pagedllm::i8_dequant_bf16);
  m.def("i8_embedding(Tensor ids, Tensor qweight, Tensor scales, Tensor mins, int group) -> Tensor",
        &pagedllm::i8_embedding);
}

// Linears of the CPU fast path over dense bf16 weights (float checkpoints held in bf16;
// packed quantized weights have their own kernels in linear_packed.cpp).
//
// Shapes (N out features, K in features, M rows of x):
//   weight bf16 [N, K];  x float32 [M, K] -> y float32 [M, N];  K a multiple of 32
//
// The recipe: x is rounded to bf16; y[m, n] is summed by vdpbf16ps into one 16-lane float32
// accumulator over the K groups of 32 in order, then reduced by a fixed tree (reduce16).
// Both kernels run that one sequence of operations for every output element, so an element
// is bitwise the same whatever the batch size and whichever kernel computed it: a request's
// tokens never depend on what shares its step.
//
//   few rows (M <= kDirectRows): each weight group is loaded in registers and dotted with
//     every row, four weight rows at a time (independent accumulator chains);
//   more rows: each thread copies kTileRows weight rows into a tile once, then runs a
//     4 x 4 register-blocked kernel over all M rows.
// AVX2 sums the same lanes as halves of 8 (see its section), reading the weight rows in
// place, kTileRows at a time.

#include "kernels.h"

namespace pagedllm {
namespace {

constexpr int64_t kDirectRows = 2;
constexpr int64_t kTileRows = 16;

#ifndef PAGEDLLM_AVX2  // the AVX2 kernels take activations_split's form (below)
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
#endif

#ifdef PAGEDLLM_AVX512
// 32 bf16 values in one 512-bit register, natural order: 32-bit lane l holds elements
// 2l (low half) and 2l + 1 (high half). dot_bf16x32(acc, a, b) adds, in each lane l,
// a[2l + 1] * b[2l + 1] to acc[l], rounds, then adds a[2l] * b[2l] and rounds: what
// vdpbf16ps does (the odd element first, as Intel's definition of it says; checked on
// Zen 4 over 3.2 million random lanes, where the even-first order differed in 5% of them).
// The emulations below (AVX-512 without BF16, AVX2, plain C++) keep that order, so every
// build gives the same bits; they do not flush denormal inputs or results to zero, as the
// instruction does, which hidden states and weights of a working model do not reach.
#ifdef PAGEDLLM_AVX512BF16
using bf16x32 = __m512bh;

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
// 2x the instructions of vdpbf16ps.
using bf16x32 = __m512i;

inline bf16x32 load_bf16x32(const bf16* p) {
  return _mm512_loadu_si512(reinterpret_cast<const void*>(p));
}

inline __m512 dot_bf16x32(__m512 acc, bf16x32 a, bf16x32 b) {
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512 a_even = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16));
  const __m512 b_even = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
  const __m512 a_odd = _mm512_castsi512_ps(_mm512_and_si512(a, high_half));
  const __m512 b_odd = _mm512_castsi512_ps(_mm512_and_si512(b, high_half));
  return _mm512_fmadd_ps(a_even, b_even, _mm512_fmadd_ps(a_odd, b_odd, acc));
}
#endif

// Group g (32 weights) of one bf16 weight row.
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

#elif defined(PAGEDLLM_AVX2)
// AVX2 has 8-lane registers, 16 of them. Each 16-lane accumulator of the AVX-512 code is
// two halves: lo, lanes 0..7 (elements 0..15 of every group of 32), and hi, lanes 8..15
// (elements 16..31). Every lane runs the AVX-512 emulation's two FMAs per group, odd
// element first, and reduce16(lo, hi) adds the lanes as reduce16 does: the same bits. The
// halves never meet before that, so they may be summed in separate passes over K:
//   one row of x (a decode step, the weights streaming from memory): both halves in one
//     pass over 4 weight rows (8 accumulators, 4 registers of x), the rows two blocks
//     ahead prefetched (the 49152 x 576 LM head ran 1.3-1.9x faster so on Zen 3 than with
//     the two-pass kernel below);
//   more rows: the lo lanes in one pass, then the hi lanes (the rows are in L1 by then),
//     in blocks of 4 x rows by 2 weight rows: 8 accumulators and 4 registers for the
//     weights' even and odd values (3 x 3 and 5 x 2 blocks measured slower).

// Weight row r. bf16 rows need no decoding: the kernels read them in place, row r + j at
// w + j * K.
struct Bf16Row {
  const bf16* w;
};

// bf16(x) as float32 (low 16 bits zero), 8 lanes: round to nearest even, a NaN to 0x7FC0,
// as c10::BFloat16(float) rounds (Tensor.to(torch.bfloat16)).
inline __m256 round_to_bf16(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i sum = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256 rounded =
      _mm256_castsi256_ps(_mm256_and_si256(sum, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  const __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000));
  return _mm256_blendv_ps(rounded, nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

// x [M, K] float32 -> float32 [M, K] in a buffer kept by the calling thread: bf16(x) widened
// back (exactly), each 16 values reordered as [the 8 at even positions | the 8 at odd
// ones], the operands of one half group's even and odd FMAs.
const float* activations_split(const Tensor& x) {
  thread_local std::vector<float> buffer;
  const int64_t count = x.numel();  // a multiple of 16: K is one of 32
  if (static_cast<int64_t>(buffer.size()) < count) buffer.resize(count);
  const float* src = x.data_ptr<float>();
  float* dst = buffer.data();
  for (int64_t i = 0; i < count; i += 16) {
    const __m256 a = round_to_bf16(_mm256_loadu_ps(src + i));
    const __m256 b = round_to_bf16(_mm256_loadu_ps(src + i + 8));
    // shuffle_ps works within 128-bit halves: [a0 a2 b0 b2 | a4 a6 b4 b6]; the 64-bit
    // permute (0 2 1 3) puts them in order: [a0 a2 a4 a6 b0 b2 b4 b6] (odd: 1 3 ... 15).
    auto in_order = [](__m256 v) {
      return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(v), _MM_SHUFFLE(3, 1, 2, 0)));
    };
    _mm256_storeu_ps(dst + i, in_order(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0))));
    _mm256_storeu_ps(dst + i + 8, in_order(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1))));
  }
  return buffer.data();
}

// The accumulators of halves first .. first + H - 1 (0: lo, 1: hi) for x rows r < R (split,
// row stride K) against weight rows j < J (bf16, row stride K), over all K. `prefetch`: when
// not 0, how many elements ahead of the rows to prefetch (past the weight's end is harmless:
// a prefetch never faults).
template <int R, int J, int H>
inline void lane_sums(const float* xs, const bf16* w, int64_t k, int first, int64_t prefetch,
                      __m256 (&sums)[H][R][J]) {
  const __m256i high_half = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc[H][R][J];
  for (int h = 0; h < H; ++h)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < J; ++j) acc[h][r][j] = _mm256_setzero_ps();
  for (int64_t group = 0; group < k; group += 32) {
    if (prefetch != 0)
      for (int j = 0; j < J; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + j * k + group + prefetch), _MM_HINT_T0);
    for (int h = 0; h < H; ++h) {
      const int64_t at = group + 16 * (first + h);
      // 32-bit lane l of a raw load holds elements 2l (low bits) and 2l + 1 (high bits):
      // the low one shifted up, or the high one with the low bits cleared, is its float32.
      __m256 w_even[J], w_odd[J];
      for (int j = 0; j < J; ++j) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * k + at));
        w_even[j] = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
        w_odd[j] = _mm256_castsi256_ps(_mm256_and_si256(raw, high_half));
      }
      for (int r = 0; r < R; ++r) {
        const __m256 x_even = _mm256_loadu_ps(xs + r * k + at);
        const __m256 x_odd = _mm256_loadu_ps(xs + r * k + at + 8);
        for (int j = 0; j < J; ++j)
          acc[h][r][j] =
              _mm256_fmadd_ps(w_even[j], x_even, _mm256_fmadd_ps(w_odd[j], x_odd, acc[h][r][j]));
      }
    }
  }
  for (int h = 0; h < H; ++h)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < J; ++j) sums[h][r][j] = acc[h][r][j];
}

// out[j] for one x row and weight rows j < J, both halves in one pass.
template <int J>
inline void dot_row(const float* xs, const bf16* w, int64_t k, int64_t prefetch, float* out) {
  __m256 sums[2][1][J];
  lane_sums<1, J, 2>(xs, w, k, 0, prefetch, sums);
  for (int j = 0; j < J; ++j) out[j] = reduce16(sums[0][0][j], sums[1][0][j]);
}

// out[r * out_stride + j] for x rows r < R and weight rows j < J, one pass per half.
template <int R, int J>
inline void dot_block(const float* xs, const bf16* w, int64_t k, float* out, int64_t out_stride) {
  __m256 lo[1][R][J], hi[1][R][J];
  lane_sums<R, J, 1>(xs, w, k, 0, 0, lo);
  lane_sums<R, J, 1>(xs, w, k, 1, 0, hi);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) out[r * out_stride + j] = reduce16(lo[0][r][j], hi[0][r][j]);
}

template <int J>
inline void dot_rows(int64_t r_count, const float* xs, const bf16* w, int64_t k, float* out,
                     int64_t out_stride) {
  switch (r_count) {
    case 4: return dot_block<4, J>(xs, w, k, out, out_stride);
    case 3: return dot_block<3, J>(xs, w, k, out, out_stride);
    case 2: return dot_block<2, J>(xs, w, k, out, out_stride);
    default: return dot_block<1, J>(xs, w, k, out, out_stride);
  }
}

// out[:, 0 : rows] for all M x rows (split) from `rows` weight rows at w.
inline void tile_gemm(const float* xs, int64_t m, int64_t k, const bf16* w, int64_t rows,
                      float* out, int64_t out_stride) {
  if (m == 1) {
    int64_t j = 0;
    for (; j + 4 <= rows; j += 4) dot_row<4>(xs, w + j * k, k, 8 * k, out + j);
    for (; j < rows; ++j) dot_row<1>(xs, w + j * k, k, 0, out + j);
    return;
  }
  for (int64_t r0 = 0; r0 < m; r0 += 4) {
    const int64_t r_count = std::min<int64_t>(4, m - r0);
    for (int64_t j0 = 0; j0 < rows; j0 += 2) {
      const float* x = xs + r0 * k;
      float* o = out + r0 * out_stride + j0;
      if (j0 + 2 <= rows) dot_rows<2>(r_count, x, w + j0 * k, k, o, out_stride);
      else dot_rows<1>(r_count, x, w + j0 * k, k, o, out_stride);
    }
  }
}

#else  // neither AVX-512 nor AVX2: the same recipe in plain C++ (slow)

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
      for (int64_t i = 0; i < k; i += 2)  // each pair: the odd product first
        for (int64_t e : {i + 1, i})
          lanes[(e % 32) / 2] += static_cast<float>(tile[j * k + e]) * static_cast<float>(xb[r * k + e]);
      float v8[8], v4[4];
      for (int l = 0; l < 8; ++l) v8[l] = lanes[l] + lanes[l + 8];
      for (int l = 0; l < 4; ++l) v4[l] = v8[l] + v8[l + 4];
      out[r * out_stride + j] = ((v4[0] + v4[2]) + (v4[1] + v4[3]));
    }
}
#endif

// y [M, N] float32 = x [M, K] @ W^T for a weight of N rows given by make_row(n).
template <typename MakeRow>
Tensor packed_matmul(const Tensor& x_in, int64_t n, int64_t k, const MakeRow& make_row,
                     Tensor* out_buffer = nullptr) {
  TORCH_CHECK(x_in.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(x_in.size(1) == k, "x has ", x_in.size(1), " features, the weight ", k);
  TORCH_CHECK(k % 32 == 0, "K must be a multiple of 32, got ", k);
  Tensor x = x_in.scalar_type() == at::kFloat ? x_in.contiguous() : x_in.to(at::kFloat).contiguous();
  const int64_t m = x.size(0);
#ifdef PAGEDLLM_AVX2
  const float* xs = activations_split(x);
#else
  const bf16* xb = activations_bf16(x);
#endif
  Tensor out = float_output(out_buffer, m, n, x.options());
  float* op = out.data_ptr<float>();
  const int64_t num_tiles = (n + kTileRows - 1) / kTileRows;
#ifdef PAGEDLLM_AVX2
  parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t first = t * kTileRows, rows = std::min(kTileRows, n - first);
      tile_gemm(xs, m, k, make_row(first).w, rows, op + first, n);
    }
  });
  return out;
#else
#ifdef PAGEDLLM_AVX512
  if (m <= kDirectRows) {
    parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
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
  parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<bf16> tile;
    tile.resize(kTileRows * k);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t first = t * kTileRows, rows = std::min(kTileRows, n - first);
      decode_rows(make_row, first, rows, k, tile.data());
      tile_gemm(xb, m, k, tile.data(), rows, op + first, n);
    }
  });
  return out;
#endif
}

// x [M, K] float32; weight bf16 [N, K] -> [M, N] float32
Tensor bf16_linear(const Tensor& x, const Tensor& weight, Tensor* out = nullptr) {
  check_cpu_contiguous(weight, "weight");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "weight must be bf16");
  const int64_t k = weight.size(1);
  const bf16* wp = weight.data_ptr<bf16>();
  return packed_matmul(
      x, weight.size(0), k, [&](int64_t r) { return Bf16Row{wp + r * k}; }, out);
}

}  // namespace

namespace api {
Tensor bf16_linear(const Tensor& x, const Tensor& weight, Tensor* out) {
  return pagedllm::bf16_linear(x, weight, out);
}
}  // namespace api
}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("bf16_linear(Tensor x, Tensor weight) -> Tensor",
        [](const at::Tensor& x, const at::Tensor& weight) {
          return pagedllm::bf16_linear(x, weight);
        });
  m.def("bf16_linear_out(Tensor x, Tensor weight, Tensor(a!) out) -> ()",
        [](const at::Tensor& x, const at::Tensor& weight, at::Tensor out) {
          pagedllm::bf16_linear(x, weight, &out);
        });
}

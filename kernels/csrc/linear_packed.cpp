// Linears over packed quantized weights (GGUF, AWQ): int8 activations, exact integer dot
// products (AVX512-VNNI for a few rows, AMX tiles for batches).
//
// The recipe, for y[m, n] = sum_k w[n, k] x[m, k] with w[n, k] = s[n, g] * q[n, k] + mn[n, g]:
//
//   1. Each row of x is quantized in blocks of 32 along K (as llama.cpp's Q8 activations):
//        d[m, b] = max|x[m, 32b : 32b + 32]| / 127,  qx = round-half-even(x * 127 / max)
//      (qx in -127..127); xs[m, h] = sum of qx over each half block h (16 values).
//   2. For every weight group g (16 or 32 values of K, inside block b), in K order:
//        isum = sum_{k in g} q[n, k] * qx[m, k]                int32, exact
//        acc  = fma(float(isum), s[n, g] * d[m, b], acc)
//      then, for formats with mins, with md[m, g] = d[m, b] * float(sum of qx over g):
//        acc  = fma(mn[n, g], md[m, g], acc)
//      y[m, n] = acc.
//
// Blocks of 32 make a weight group of 32 one integer sum and one float step: AMX computes
// it with one tile multiply, and half as many float steps follow as with blocks of 16.
// Perplexity costs +0.28% against float32 dequantization on SmolLM2 Q4_1 (+0.22% with
// blocks of 16, which AMX could not speed up; BENCHMARKS.md).
//
// The integer sums are exact, and every kernel below runs the same float32 operations in
// the same order for an output element, whatever the batch size or the thread split: a
// request's tokens never depend on what shares its step (batch invariance, which the
// prefix cache, chunked prefill and speculative decoding rely on).
//
// Weights are repacked once at load into tiles of 16 output rows, so that one 512-bit
// vpdpbusd multiplies 4 consecutive K values of 16 rows by 4 broadcast activation bytes:
//
//   u4  q in 0..15 (Q4_0, Q4_1, Q4_K, AWQ); groups of 32
//       tiles uint8 [T, K/32, 4, 64]: in group g, vector p (0..3), byte 4r + j holds
//       q[16t + r, 32g + 4p + j] in its low nibble and q[16t + r, 32g + 4(p + 4) + j] in
//       its high nibble
//   i8  q in -128..127 (Q8_0); groups of 16 or 32
//       tiles uint8 [T, K/4, 64]: vector p, byte 4r + j holds q[16t + r, 4p + j] + 128
//       (vpdpbusd takes unsigned weights; the 128 * sum(qx) it adds is subtracted; AMX
//       multiplies signed bytes, q + 128 xor 128)
//   i6  q in -32..31 (Q5_0, Q5_1, Q5_K, Q6_K): the i8 vectors in 6 bits a value; groups of
//       16 or 32. u = q + 32 (0..63); per quad of 16 K values (i8 vectors p = 0..3 of the
//       quad) 192 bytes, tiles uint8 [T, K/16, 192]:
//         bytes   0..63   u's low nibbles: vector 0 in the low half of each byte, 1 high
//         bytes  64..127  the same for vectors 2 and 3
//         bytes 128..191  u's top 2 bits: vector p at bits 2p, 2p + 1
//       byte 4r + j of each part belongs to row r and K value 4p + j, as in i8. Unpacked,
//       the vectors are u (vpdpbusd, 32 * sum(qx) subtracted) or u - 32 (AVX2, AMX): the
//       same integer sums as i8 tiles of the same q, so the same bits, from 25% fewer
//       bytes (Q6_K is llama-quantize's choice for the LM head, attn_v and ffn_down of
//       Q4_K_M files; a memory-bound decode reads every byte once per token).
//   scales, mins [T, K/G, 16] float32 (or float16 where every value is exact there):
//       element [t, g, r] belongs to row 16t + r.
//   T = ceil(N / 16); rows beyond N are zero.
//
// K-quants (Q2_K to Q6_K: u4 or i6 tiles whose scales, and mins, are KScale: an int8
// multiplier per group of 16 or 32 values and a float factor per super block of 256) take
// the folded recipe instead, llama.cpp's Q8_K:
//
//   1. Each row of x is quantized in super blocks of 256 along K:
//        dk[m, s] = max|x[m, 256s : 256s + 256]| / 127, qk = round-half-even(x * 127 / max)
//      and sk[m, h] = the sum of qk over each 16 values h (int16).
//   2. For every super block s, in K order, with the 256 / G groups g of s:
//        P = sum_g sm[n, g] * (sum_{k in g} q[n, k] * qk[m, k])     int32, exact
//        Q = sum_g mm[n, g] * (sum of sk[m, h] over the halves h of g)   int32, exact
//        acc = fma(float(P), sf[n, s] * dk[m, s], acc)
//        acc = fma(float(Q), mf[n, s] * dk[m, s], acc)              (with mins)
//      where the scale of group g is sf[n, s] * sm[n, g] and its min mf[n, s] * mm[n, g].
//
// The group multipliers are folded in integers, so one float step follows 256 values of K
// instead of 8 or 16: on AMX the multipliers go into the weight bytes (q * sm, as two int8
// tiles: q * (sm & 7) and q * (sm >> 3) for Q4_K's u4 and 6-bit multipliers, (q * sm) & 127
// and (q * sm) >> 7 for i6), and the tile multiplies run over 64 values of K at a time
// instead of 16 or 32. The same kernels (VNNI, AVX2, AMX, scalar) all take it, so a row's
// bits still do not depend on its batch or on AMX. (i8 tiles with K-quant values, which no
// GGUF type makes, keep the first recipe: their q * sm can need 16 bits.)
//
// Shapes at the boundary: x float32 [M, K] -> y float32 [M, N]; K a multiple of 32.

#include "amx.h"
#include "activation.h"
#include "kernels.h"

namespace pagedllm {
namespace {

constexpr int64_t kTile = 16;       // output rows per tile: the 16 lanes of a vector
constexpr int64_t kBlock = 32;      // activation quantization block along K
constexpr int64_t kHalf = 16;       // the smallest weight group: half a block
constexpr int64_t kSuper = 256;     // the folded recipe's activation block (a K-quant's)
constexpr int64_t kRowChunk = 64;   // x rows whose quantized copy is reused across tiles
constexpr int64_t kAhead = 8;       // weight groups prefetched ahead when few rows stream them
// Rows of x per pass over a weight tile, and at most in the last pass. A last pass of
// up to 7 rows lets 1 + k rows of speculative verification read and unpack each weight
// tile once; passes of 8 were no faster for batches (gate_up and the LM head at 16 and 64
// rows, Zen 4).
constexpr int64_t kPassRows = 4;
constexpr int64_t kLastPassRows = 7;
// Integer partial sums per row and group (AVX-512): 4 up to kFewRowsChains rows, 2 up to
// kTwoChainRows, else 1 (the pass's rows are then enough independent chains). With 2 at
// 6 and 7 rows, the i8 kernel's 14 sums, 7 accumulators and their operands did not fit
// the 32 vector registers: the Q8_0 LM head took 1.46-1.53 ms at 6 rows against 0.52-0.67
// at 5; with 1 it takes 0.70-0.76 (Zen 4, 2 threads), and a batch whose last pass has 6
// or 7 rows (59 rows: 7.3-7.9 -> 6.7-6.8 ms) no longer pays for it.
constexpr int kFewRowsChains = 2;
constexpr int kTwoChainRows = 5;

template <typename S>
inline float scalar_of(S v) {
  return static_cast<float>(v);
}

// ------------------------------------------------------------ activations
struct QuantizedRows {
  const int8_t* q;     // [M, K]
  const float* d;      // [M, K/32] block scales
  const int32_t* xs;   // [M, K/16] sums of q over each half block
  // Per weight group, for groups of 16 and of 32 (they depend on the row and the group
  // only, so they are made once here, not again for every tile of the weight):
  const int32_t* xs32; // [M, K/32] sums of q over each block
  const float* md16;   // [M, K/16] d[h / 2] * float(xs[h])      the min factor md
  const float* md32;   // [M, K/32] d[b] * float(xs32[b])
  int64_t k;

  // Group g's activation scale, sum of q and min factor, for groups of G values.
  template <int G>
  float scale(int64_t row, int64_t g) const {
    return d[row * (k / kBlock) + g * G / kBlock];
  }
  template <int G>
  int32_t sum(int64_t row, int64_t g) const {
    return G == 16 ? xs[row * (k / 16) + g] : xs32[row * (k / 32) + g];
  }
  template <int G>
  float group_min_scale(int64_t row, int64_t g) const {
    return G == 16 ? md16[row * (k / 16) + g] : md32[row * (k / 32) + g];
  }

  // The folded recipe's super blocks (made only for calls that meet a folded weight):
  const int8_t* qk = nullptr;   // [M, K]
  const float* dk = nullptr;    // [M, K/256]
  const int16_t* sk = nullptr;  // [M, K/16] sums of qk over each 16 values
  const int16_t* sk32 = nullptr;  // [M, K/32] sums of qk over each 32 (|sum| <= 4,064)

  float super_scale(int64_t row, int64_t s) const { return dk[row * (k / kSuper) + s]; }
  // The row's sums of qk over each group of G values in super block s (256 / G of them).
  template <int G>
  const int16_t* super_sums(int64_t row, int64_t s) const {
    return G == 16 ? sk + row * (k / 16) + 16 * s : sk32 + row * (k / 32) + 8 * s;
  }
  // The sum of qk over group g of G values.
  template <int G>
  int32_t super_group_sum(int64_t row, int64_t g) const {
    return G == 16 ? sk[row * (k / 16) + g] : sk32[row * (k / 32) + g];
  }
};

// One row of x (K floats) -> its int8 blocks. The only place activations are quantized.
inline void quantize_row(const float* x, int64_t k, int8_t* q, float* d, int32_t* xs) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float* src = x + b * kBlock;
    float amax = 0.f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(src[i]));
    d[b] = amax / 127.f;
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    for (int h = 0; h < 2; ++h) {
      int32_t sum = 0;
      for (int i = h * kHalf; i < (h + 1) * kHalf; ++i) {
        // nearbyint: round half to even (the default rounding mode), as cvtps2dq does.
        const int32_t v = static_cast<int32_t>(std::nearbyint(src[i] * inv));
        const int32_t c = std::min(127, std::max(-127, v));
        q[b * kBlock + i] = static_cast<int8_t>(c);
        sum += c;
      }
      xs[2 * b + h] = sum;
    }
  }
}

#ifdef PAGEDLLM_AVX512
// The largest lane of each of 16 vectors: lane b of the result is max over v[b]'s lanes.
// Four rounds of pairwise shuffles and maxima (max is exact in any order) instead of one
// horizontal reduction per vector, whose shuffle chain cost most of a block's time.
inline __m512 max_of_each(const __m512 (&v)[16]) {
  // Round 1: a, b -> quarters [a0|a2, a1|a3, b0|b2, b1|b3]: 8 lanes of each input.
  __m512 halves[8];
  for (int i = 0; i < 8; ++i)
    halves[i] = _mm512_max_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // Round 2: quarter j of quarters[i] holds 4 lanes of input 4i + j.
  __m512 quarters[4];
  for (int i = 0; i < 4; ++i)
    quarters[i] = _mm512_max_ps(
        _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
        _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  // Round 3 (within 128-bit lanes): in quarter j of pairs[i], lanes 0-1 hold input 8i + j,
  // lanes 2-3 input 8i + 4 + j.
  __m512 pairs[2];
  for (int i = 0; i < 2; ++i)
    pairs[i] = _mm512_max_ps(
        _mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
        _mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // Round 4: lane 4j + i holds input 4i + j; one permutation puts input b in lane b.
  const __m512 transposed =
      _mm512_max_ps(_mm512_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(2, 0, 2, 0)),
                    _mm512_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i input_lane =
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(input_lane, transposed);
}

// quantize_row, 16 blocks at a time: the same amax (a max), d and inv (correctly rounded
// divisions, lane-wise), cvtps2dq's round-half-even and the same clamp: the same bytes.
inline void quantize_row_avx512(const float* x, int64_t k, int8_t* q, float* d, int32_t* xs) {
  const __m512 sign_off = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  const __m512i bound = _mm512_set1_epi32(127), neg_bound = _mm512_set1_epi32(-127);
  const int64_t blocks = k / kBlock;
  for (int64_t b0 = 0; b0 < blocks; b0 += 16) {
    const int64_t n = std::min<int64_t>(16, blocks - b0);
    __m512 block_max[16];
    for (int64_t i = 0; i < 16; ++i) {
      const float* src = x + (b0 + i) * kBlock;
      block_max[i] = i < n ? _mm512_max_ps(_mm512_and_ps(_mm512_loadu_ps(src), sign_off),
                                           _mm512_and_ps(_mm512_loadu_ps(src + kHalf), sign_off))
                           : _mm512_setzero_ps();
    }
    const __m512 amax = max_of_each(block_max);
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
    _mm512_mask_storeu_ps(d + b0, valid, _mm512_div_ps(amax, _mm512_set1_ps(127.f)));
    alignas(64) float inv[16];  // 127 / amax, 0 for an all-zero block
    _mm512_store_ps(inv, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ),
                                             _mm512_set1_ps(127.f), amax));
    for (int64_t i = 0; i < n; ++i) {
      const float* src = x + (b0 + i) * kBlock;
      const __m512 scale = _mm512_set1_ps(inv[i]);
      for (int h = 0; h < 2; ++h) {
        // cvtps2dq rounds half to even; |x * inv| <= 127 up to rounding, clamped anyway.
        __m512i qv = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(src + h * kHalf), scale));
        qv = _mm512_max_epi32(_mm512_min_epi32(qv, bound), neg_bound);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + (b0 + i) * kBlock + h * kHalf),
                         _mm512_cvtepi32_epi8(qv));
      }
    }
  }
  // Sums of q over each half block, 4 at a time: vpsadbw adds 8 bytes of q + 128 (byte xor
  // 0x80) per 64-bit lane; two lanes make a half block, less 16 * 128. Past the row's end
  // (an odd number of blocks) the masked load gives bytes of 0, i.e. q = -128, whose half
  // sums are never stored.
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t at = 0; at < k; at += 64) {
    const __mmask64 bytes = k - at >= 64 ? ~0ull : (1ull << (k - at)) - 1;
    const __m512i sad = _mm512_sad_epu8(
        _mm512_xor_si512(_mm512_maskz_loadu_epi8(bytes, q + at), flip), _mm512_setzero_si512());
    const __m512i pair_sums = _mm512_add_epi64(sad, _mm512_bsrli_epi128(sad, 8));
    const __m256i sums = _mm512_cvtepi64_epi32(_mm512_maskz_compress_epi64(0x55, pair_sums));
    const __m128i half_sums =
        _mm_sub_epi32(_mm256_castsi256_si128(sums), _mm_set1_epi32(kHalf * 128));
    const __mmask16 halves = k - at >= 64 ? 0xF : 0x3;
    _mm512_mask_storeu_epi32(xs + at / kHalf, halves, _mm512_castsi128_si512(half_sums));
  }
}
#endif

#ifdef PAGEDLLM_AVX2
// quantize_row with 8-lane vectors: the same amax (a max is exact in any order), the same
// d and inv, and cvtps2dq's round-half-even as nearbyint: the same bytes.
inline void quantize_row_avx2(const float* x, int64_t k, int8_t* q, float* d, int32_t* xs) {
  const __m256 sign_off = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i bound = _mm256_set1_epi32(127), neg_bound = _mm256_set1_epi32(-127);
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float* src = x + b * kBlock;
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(src + 8 * i);
    const __m256 m01 = _mm256_max_ps(_mm256_and_ps(v[0], sign_off), _mm256_and_ps(v[1], sign_off));
    const __m256 m23 = _mm256_max_ps(_mm256_and_ps(v[2], sign_off), _mm256_and_ps(v[3], sign_off));
    const float amax = reduce_max8(_mm256_max_ps(m01, m23));
    d[b] = amax / 127.f;
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    for (int h = 0; h < 2; ++h) {  // each half block: 16 values, 2 vectors
      __m256i qv[2];
      for (int i = 0; i < 2; ++i) {
        qv[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * h + i], inv));
        qv[i] = _mm256_max_epi32(_mm256_min_epi32(qv[i], bound), neg_bound);
      }
      // int32 -> int16 -> int8; packs works within 128-bit lanes, the permute restores
      // the order (the values fit, so nothing saturates).
      const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(qv[0], qv[1]), 0xD8);
      const __m128i bytes =
          _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + h * kHalf), bytes);
      const __m256i s8 = _mm256_add_epi32(qv[0], qv[1]);
      const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
      const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      xs[2 * b + h] = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1)));
    }
  }
}
#endif

// One row of x (K floats, K % 256 == 0) -> its super blocks for the folded recipe: qk
// int8 [K], dk [K/256], sk int16 [K/16]. The same bytes on every path: the maximum is
// exact in any order, d and inv are the same divisions, and cvtps2dq rounds half to even
// as nearbyint does.
inline void quantize_row_super(const float* x, int64_t k, int8_t* q, float* d, int16_t* sums) {
  for (int64_t s = 0; s < k / kSuper; ++s) {
    const float* src = x + s * kSuper;
    int8_t* dst = q + s * kSuper;
#ifdef PAGEDLLM_AVX512
    const __m512 sign_off = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    __m512 vmax = _mm512_setzero_ps();
    for (int i = 0; i < kSuper; i += 16)
      vmax = _mm512_max_ps(vmax, _mm512_and_ps(_mm512_loadu_ps(src + i), sign_off));
    const float amax = _mm512_reduce_max_ps(vmax);
#else
    float amax = 0.f;
    for (int i = 0; i < kSuper; ++i) amax = std::max(amax, std::fabs(src[i]));
#endif
    d[s] = amax / 127.f;
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
#ifdef PAGEDLLM_AVX512
    const __m512i bound = _mm512_set1_epi32(127), neg_bound = _mm512_set1_epi32(-127);
    for (int g = 0; g < kSuper / kBlock; ++g) {
      __m512i qv[2];
      for (int i = 0; i < 2; ++i) {
        const int at = g * kBlock + 16 * i;
        qv[i] = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(src + at), _mm512_set1_ps(inv)));
        qv[i] = _mm512_max_epi32(_mm512_min_epi32(qv[i], bound), neg_bound);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + at), _mm512_cvtepi32_epi8(qv[i]));
        sums[s * 16 + 2 * g + i] = static_cast<int16_t>(_mm512_reduce_add_epi32(qv[i]));
      }
    }
#else
    for (int h = 0; h < kSuper / kHalf; ++h) {
      int32_t sum = 0;
      for (int i = h * kHalf; i < (h + 1) * kHalf; ++i) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(src[i] * inv));
        dst[i] = static_cast<int8_t>(std::min(127, std::max(-127, v)));
        sum += dst[i];
      }
      sums[s * 16 + h] = static_cast<int16_t>(sum);
    }
#endif
  }
}

// One row's xs32, md16 and md32 from its d and xs.
inline void row_group_factors(const float* d, const int32_t* xs, int64_t k, int32_t* xs32,
                              float* md16, float* md32) {
  for (int64_t h = 0; h < k / kHalf; ++h) md16[h] = d[h / 2] * static_cast<float>(xs[h]);
  for (int64_t b = 0; b < k / kBlock; ++b) {
    xs32[b] = xs[2 * b] + xs[2 * b + 1];
    md32[b] = d[b] * static_cast<float>(xs32[b]);
  }
}

// x [M, K] float32 -> quantized rows in buffers kept by the calling thread: the first
// recipe's blocks of 32 unless `groups` is false (only folded weights will meet them), and
// with `super_blocks` (a folded weight will meet them; K % 256 == 0) the folded recipe's.
QuantizedRows quantize_activations(const Tensor& x, bool super_blocks = false,
                                   bool groups = true) {
  thread_local std::vector<int8_t> q, qk;
  thread_local std::vector<float> d, md16, md32, dk;
  thread_local std::vector<int32_t> xs, xs32;
  thread_local std::vector<int16_t> sk, sk32;
  const int64_t m = x.size(0), k = x.size(1), blocks = k / kBlock, halves = k / kHalf;
  super_blocks = super_blocks && k % kSuper == 0;
  groups = groups || !super_blocks;
  if (super_blocks) {
    qk.resize(m * k);
    dk.resize(m * (k / kSuper));
    sk.resize(m * halves);
    sk32.resize(m * blocks);
  }
  // Pointers, not the thread_local vectors: the rows are quantized on the pool's threads.
  int8_t* qkp = super_blocks ? qk.data() : nullptr;
  float* dkp = super_blocks ? dk.data() : nullptr;
  int16_t* skp = super_blocks ? sk.data() : nullptr;
  int16_t* sk32p = super_blocks ? sk32.data() : nullptr;
  if (groups) {
    q.resize(m * k);
    d.resize(m * blocks);
    xs.resize(m * halves);
    xs32.resize(m * blocks);
    md16.resize(m * halves);
    md32.resize(m * blocks);
  }
  const float* xp = x.data_ptr<float>();
  int8_t* qp = groups ? q.data() : nullptr;
  float* dp = groups ? d.data() : nullptr;
  int32_t* sp = groups ? xs.data() : nullptr;
  int32_t* s32 = groups ? xs32.data() : nullptr;
  float* m16 = groups ? md16.data() : nullptr;
  float* m32 = groups ? md32.data() : nullptr;
  // 8 rows a chunk: the threads share a decode step's few rows too. The rows are written on
  // one core and read by every thread's tiles, and each write waits for the other core's
  // copy of the last call's rows to be invalidated; done by the calling thread alone, 64
  // rows of 576 columns took 21 us against 12 with no other thread, and the 1536 columns of
  // down 56 against 32 (Zen 4). In chunks of 8 the two cores wait in parallel.
  parallel_for(0, m, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (super_blocks) {
        quantize_row_super(xp + r * k, k, qkp + r * k, dkp + r * (k / kSuper), skp + r * halves);
        for (int64_t b = 0; b < blocks; ++b)
          sk32p[r * blocks + b] =
              static_cast<int16_t>(skp[r * halves + 2 * b] + skp[r * halves + 2 * b + 1]);
      }
      if (!groups) continue;
#if defined(PAGEDLLM_AVX512)
      quantize_row_avx512(xp + r * k, k, qp + r * k, dp + r * blocks, sp + r * halves);
#elif defined(PAGEDLLM_AVX2)
      quantize_row_avx2(xp + r * k, k, qp + r * k, dp + r * blocks, sp + r * halves);
#else
      quantize_row(xp + r * k, k, qp + r * k, dp + r * blocks, sp + r * halves);
#endif
      row_group_factors(dp + r * blocks, sp + r * halves, k, s32 + r * blocks, m16 + r * halves,
                        m32 + r * blocks);
    }
  });
  QuantizedRows rows{qp, dp, sp, s32, m16, m32, k};
  rows.qk = qkp;
  rows.dk = dkp;
  rows.sk = skp;
  rows.sk32 = sk32p;
  return rows;
}

// ------------------------------------------------------------------ formats
// A tile's view of one format: where group g's bytes start, and how many 64-byte vectors
// it spans. Both formats hold 16 rows x 4 K values per vector.
enum class Format { kU4, kI8, kI6 };

constexpr int64_t kI6QuadBytes = 192;  // an i6 tile's 16 K values: 16 rows x 16 x 6 bits

// The bytes of a tile's G K values (its 16 rows) in each format.
template <Format F>
constexpr int64_t tile_group_bytes(int G) {
  return F == Format::kU4 ? G * 8 : F == Format::kI8 ? G * 16 : G / 16 * kI6QuadBytes;
}

// What the unsigned weight bytes of the signed formats add to q: vpdpbusd's sum is
// sum((q + offset) * qx), and offset * sum(qx) is taken off.
template <Format F>
constexpr int32_t byte_offset() {
  return F == Format::kI8 ? 128 : F == Format::kI6 ? 32 : 0;
}

// The signed-byte format of tiles made by tile_i8 ([T, K/4, 64]) or tile_i6 ([T, K/16,
// 192]): the ops take both where they take "i8" tiles, told apart by the tensor's shape.
inline Format signed_format(const Tensor& tiles) {
  return tiles.dim() == 3 && tiles.size(2) == kI6QuadBytes ? Format::kI6 : Format::kI8;
}

inline Format tile_format(bool u4, const Tensor& tiles) {
  return u4 ? Format::kU4 : signed_format(tiles);
}

// q of the weight at row `lane` of a tile and K index kk, for the scalar code.
template <Format F>
inline int32_t tile_value(const uint8_t* bytes, int64_t kk, int64_t lane) {
  if constexpr (F == Format::kU4) {
    const int64_t in_group = kk % 32, p = (in_group % 16) / 4, j = in_group % 4;
    const uint8_t byte = bytes[(kk / 32) * 256 + p * 64 + lane * 4 + j];
    return in_group < 16 ? (byte & 0x0F) : (byte >> 4);
  } else if constexpr (F == Format::kI8) {
    return static_cast<int32_t>(bytes[(kk / 4) * 64 + lane * 4 + kk % 4]) - 128;
  } else {
    const uint8_t* quad = bytes + (kk / 16) * kI6QuadBytes;
    const int64_t p = (kk % 16) / 4, at = lane * 4 + kk % 4;
    const int32_t low = (quad[(p / 2) * 64 + at] >> (4 * (p % 2))) & 0x0F;
    const int32_t top = (quad[128 + at] >> (2 * p)) & 0x03;
    return (low | (top << 4)) - 32;
  }
}

struct TileData {
  const uint8_t* bytes;  // this tile's first byte
  const void* scales;    // its groups' scales (GroupValues below)
  const void* mins;      // its groups' mins, or null
};

// How a tile's per-group scales (and mins) are stored, the kernels' template parameter S:
//   float, at::Half  S [K/G, 16]: group g, lane l at [16 g + l]
//   KScale           the two levels of a K-quant, kept as they are (a product d * sc of an
//                    fp16 and a 6-bit integer is exact in float32 but not in 16 bits):
//                    int8 multipliers [K/G, 16], then float factors [K/256, 16]; the value
//                    of group g, lane l is factor[g G / 256][l] * float(multiplier[g][l]),
//                    an exact product, the float32 value the GGUF block means. 1.25 bytes
//                    per group and lane instead of 4 (Q4_K: 4.6 bits per weight, not 6).
// Every form yields the same float32 values; a tile's values take tile_values_bytes.
struct KScale {};

// Weights that take the folded recipe: u4 and i6 tiles with K-quant (KScale) values.
template <Format F, typename S>
constexpr bool kFolded = F != Format::kI8 && std::is_same_v<S, KScale>;

template <typename S>
inline int64_t tile_values_bytes(int64_t groups, int64_t k) {
  if constexpr (std::is_same_v<S, KScale>) return groups * kTile + (k / 256) * kTile * 4;
  else return groups * kTile * static_cast<int64_t>(sizeof(S));
}

// Where group g's values (multipliers for KScale) start: what the prefetches ask for.
template <typename S>
inline const char* group_values_address(const void* base, int64_t g) {
  if constexpr (std::is_same_v<S, KScale>) return static_cast<const char*>(base) + g * kTile;
  else return reinterpret_cast<const char*>(static_cast<const S*>(base) + g * kTile);
}

// One value: group g (of `groups`, G values of K each), lane l.
template <typename S, int G>
inline float group_value(const void* base, int64_t groups, int64_t g, int64_t lane) {
  if constexpr (std::is_same_v<S, KScale>) {
    const int8_t* mult = static_cast<const int8_t*>(base);
    const float* factor = reinterpret_cast<const float*>(mult + groups * kTile);
    return factor[(g * G / 256) * kTile + lane] * static_cast<float>(mult[g * kTile + lane]);
  } else {
    return scalar_of(static_cast<const S*>(base)[g * kTile + lane]);
  }
}

// KScale's parts for the folded recipe: group g's multiplier and super block s's factor.
inline int32_t group_multiplier(const void* base, int64_t g, int64_t lane) {
  return static_cast<const int8_t*>(base)[g * kTile + lane];
}
inline float super_factor(const void* base, int64_t groups, int64_t s, int64_t lane) {
  const float* factor = reinterpret_cast<const float*>(static_cast<const int8_t*>(base) + groups * kTile);
  return factor[s * kTile + lane];
}

#ifdef PAGEDLLM_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Group g's 16 values (lane l: the tile's row 16t + l).
template <typename S, int G>
inline __m512 group_values16(const void* base, int64_t groups, int64_t g) {
  if constexpr (std::is_same_v<S, KScale>) {
    const int8_t* mult = static_cast<const int8_t*>(base);
    const float* factor = reinterpret_cast<const float*>(mult + groups * kTile);
    const __m512i m = _mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(mult + g * kTile)));
    return _mm512_mul_ps(_mm512_loadu_ps(factor + (g * G / 256) * kTile), _mm512_cvtepi32_ps(m));
  } else {
    return load16(static_cast<const S*>(base) + g * kTile);
  }
}

// acc[l] += sum over j < 4 of w[4l + j] * x[4l + j] (w unsigned bytes, x signed), exactly.
// kSmall: every w < 64 (u4, i6), so one vpmaddubsw pair sum (at most 2 * 63 * 127) cannot
// saturate int16.
template <bool kSmall>
inline __m512i dot_u8s8(__m512i acc, __m512i w, __m512i x) {
#ifdef __AVX512VNNI__
  return _mm512_dpbusd_epi32(acc, w, x);
#else
  // AVX-512 without VNNI: vpmaddubsw + vpmaddwd. A pair sum of bytes up to 255 could
  // saturate int16, so full bytes are split into nibbles (w = 16 hi + lo) first.
  const __m512i ones = _mm512_set1_epi16(1);
  if constexpr (kSmall) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), ones));
  } else {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const __m512i lo = _mm512_and_si512(w, nibble);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);
    const __m512i sum_lo = _mm512_madd_epi16(_mm512_maddubs_epi16(lo, x), ones);
    const __m512i sum_hi = _mm512_madd_epi16(_mm512_maddubs_epi16(hi, x), _mm512_set1_epi16(16));
    return _mm512_add_epi32(acc, _mm512_add_epi32(sum_lo, sum_hi));
  }
#endif
}

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// An i6 quad (kI6QuadBytes at `quad`) -> its 4 vectors of u = q + 32, in the i8 layout.
// The 16-bit shifts move bits across the two bytes of a lane; the masks keep each byte's own.
PAGEDLLM_INLINE inline void unpack_i6_quad(const uint8_t* quad, __m512i (&u)[4]) {
  const __m512i nibble = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
  const __m512i a = _mm512_loadu_si512(quad), b = _mm512_loadu_si512(quad + 64);
  const __m512i c = _mm512_loadu_si512(quad + 128);
  u[0] = _mm512_or_si512(_mm512_and_si512(a, nibble), _mm512_and_si512(_mm512_slli_epi16(c, 4), top));
  u[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(a, 4), nibble),
                         _mm512_and_si512(_mm512_slli_epi16(c, 2), top));
  u[2] = _mm512_or_si512(_mm512_and_si512(b, nibble), _mm512_and_si512(c, top));
  u[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(b, 4), nibble),
                         _mm512_and_si512(_mm512_srli_epi16(c, 2), top));
}

// ---- the folded recipe's pieces (AVX-512; the AMX kernel uses them too)
// Group g's int8 multipliers (KScale) as int32 lanes.
inline __m512i group_multipliers16(const void* base, int64_t g) {
  return _mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(base) + g * kTile)));
}

// Super block s's float factors (KScale: after the `groups` multipliers of 16 lanes).
inline __m512 super_factors16(const void* base, int64_t groups, int64_t s) {
  const float* factor = reinterpret_cast<const float*>(static_cast<const int8_t*>(base) + groups * kTile);
  return _mm512_loadu_ps(factor + s * kTile);
}

// The int8 group multipliers of super block s (the mins', or the scales'; groups of G) as
// 128 / G vectors of int16 pairs, for vpdpwssd against a row's group sums in pairs
// (QuantizedRows::super_sums<G>, pair_dot): vector p, lane l holds the multipliers of
// groups 2p and 2p + 1 of the super block, (m[l, n s + 2p], m[l, n s + 2p + 1]) with
// n = 256 / G groups a super block.
template <int G>
PAGEDLLM_INLINE inline void multiplier_pairs(const void* multipliers, int64_t s,
                                             __m512i (&pairs)[kSuper / G / 2]) {
  constexpr int64_t n = kSuper / G;
  const __m512i low16 = _mm512_set1_epi32(0xFFFF);
  for (int p = 0; p < n / 2; ++p) {
    const __m512i even = group_multipliers16(multipliers, n * s + 2 * p);
    const __m512i odd = group_multipliers16(multipliers, n * s + 2 * p + 1);
    pairs[p] = _mm512_or_si512(_mm512_and_si512(even, low16), _mm512_slli_epi32(odd, 16));
  }
}

// acc + a . b over int16 pairs (exact int32).
inline __m512i dot_i16_pairs(__m512i acc, __m512i a, __m512i b) {
#ifdef __AVX512VNNI__
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

// sum over the super block's groups g of m[l, g] * sums[g], lane l (exact int32): the
// multiplier pairs against a row's group sums (super_sums<G>).
template <int kPairs>
PAGEDLLM_INLINE inline __m512i pair_dot(const __m512i* pairs, const int16_t* sums) {
  __m512i dot = _mm512_setzero_si512();
  for (int p = 0; p < kPairs; ++p) {
    int32_t pair;
    std::memcpy(&pair, sums + 2 * p, 4);
    dot = dot_i16_pairs(dot, pairs[p], _mm512_set1_epi32(pair));
  }
  return dot;
}

// A super block's float steps for one row of x: P (the folded integer sums of 16 output
// rows), then with mins (min_pairs not null) Q; `sums` the row's 2 x kPairs sums of qk in
// this super block (16 of 16 values, or 8 of 32; see multiplier_pairs), dk its
// scale.
template <int kPairs>
PAGEDLLM_INLINE inline __m512 super_steps16(__m512 acc, __m512i folded, __m512 sf,
                                            const __m512i* min_pairs, __m512 mf, float dk,
                                            const int16_t* sums) {
  const __m512 d = _mm512_set1_ps(dk);
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(folded), _mm512_mul_ps(sf, d), acc);
  if (min_pairs == nullptr) return acc;
  const __m512i q = pair_dot<kPairs>(min_pairs, sums);
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), _mm512_mul_ps(mf, d), acc);
}
#endif

// The float32 steps that follow a group's exact integer sum, for one output element (or 16
// of them, lane-wise), the same in the vector, AMX and scalar code:
//   acc = fma(float(isum), s * d, acc)
//   acc = fma(mn, md, acc)                        with mins

#ifdef PAGEDLLM_AVX512
// MR rows of x (starting at row r0) against one tile: out[r, 0..lanes) for r < MR.
// G (the weight group) and MR are template arguments so that every index into the
// accumulator arrays is a constant and they live in registers.
template <Format F, int G, int MR, typename S, bool Fold = kFolded<F, S>>
inline void tile_rows(const TileData& tile, const QuantizedRows& x, int64_t r0, float* out,
                      int64_t out_stride, int64_t lanes, const TileData* next = nullptr) {
  const int64_t k = x.k, groups = k / G;
  const void* scales = tile.scales;
  const void* mins = tile.mins;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  constexpr int kChains = MR <= kFewRowsChains ? 4 : MR <= kTwoChainRows ? 2 : 1;
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  constexpr bool folded = Fold;
  const int8_t* xq = folded ? x.qk : x.q;
  __m512i folded_sums[MR];  // the folded recipe's P of the current super block
  for (int r = 0; r < MR; ++r) folded_sums[r] = _mm512_setzero_si512();
  constexpr int64_t group_bytes = tile_group_bytes<F>(G);  // of the 16 rows
  for (int64_t g = 0; g < groups; ++g) {
    if constexpr (MR <= 2) {
      // Few rows: the weights stream from memory once, and the hardware prefetcher alone
      // leaves most of the bandwidth unused. Ask for the bytes kAhead ahead (past this
      // tile's end they are the next tile's, which this thread reads next).
      const char* ahead = reinterpret_cast<const char*>(tile.bytes + (g + kAhead) * group_bytes);
      for (int64_t line = 0; line < group_bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
      _mm_prefetch(group_values_address<S>(scales, g + kAhead), _MM_HINT_T0);
      if (mins != nullptr) _mm_prefetch(group_values_address<S>(mins, g + kAhead), _MM_HINT_T0);
    } else if (next != nullptr) {
      // More rows pass over a tile several times (kRowChunk rows, 4 at a time) from L1;
      // the first pass asks for the next tile meanwhile, so that memory stays busy while
      // the later passes compute (at 16 rows the weights otherwise streamed at ~11 GB/s).
      const char* ahead = reinterpret_cast<const char*>(next->bytes + g * group_bytes);
      for (int64_t line = 0; line < group_bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
      _mm_prefetch(group_values_address<S>(next->scales, g), _MM_HINT_T0);
      if (next->mins != nullptr) _mm_prefetch(group_values_address<S>(next->mins, g), _MM_HINT_T0);
    }
    // kChains partial sums per row, added once at the end of the group: exact in any
    // order, and independent dependency chains, so that consecutive vpdpbusd of a row
    // never wait on each other. With one chain at a time the kernels ran at half speed
    // on Zen 5, where vpdpbusd's latency, not its issue rate, was the limit.
    __m512i isum[MR][kChains];
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < kChains; ++c) isum[r][c] = _mm512_setzero_si512();
    const int64_t k0 = g * G;
    if constexpr (F == Format::kU4) {
      // low nibbles: K 0..15 of the group; high nibbles: K 16..31
      const uint8_t* w = tile.bytes + g * 256;
      for (int p = 0; p < 4; ++p) {
        const __m512i v = _mm512_loadu_si512(w + p * 64);
        const __m512i lo = _mm512_and_si512(v, nibble);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        const int c_lo = (2 * p) % kChains, c_hi = (2 * p + 1) % kChains;
        for (int r = 0; r < MR; ++r) {
          const int8_t* xr = xq + (r0 + r) * k + k0;
          isum[r][c_lo] = dot_u8s8<true>(isum[r][c_lo], lo, broadcast4(xr + 4 * p));
          isum[r][c_hi] = dot_u8s8<true>(isum[r][c_hi], hi, broadcast4(xr + 4 * p + 16));
        }
      }
    } else if constexpr (F == Format::kI8) {
      const uint8_t* w = tile.bytes + k0 * 16;  // 64 bytes per 4 K values: G / 4 vectors
      for (int p = 0; p < G / 4; ++p) {
        const __m512i v = _mm512_loadu_si512(w + p * 64);
        for (int r = 0; r < MR; ++r) {
          const int8_t* xr = xq + (r0 + r) * k + k0;
          isum[r][p % kChains] = dot_u8s8<false>(isum[r][p % kChains], v, broadcast4(xr + 4 * p));
        }
      }
    } else {
      const uint8_t* w = tile.bytes + g * group_bytes;
      for (int quad = 0; quad < G / 16; ++quad) {
        __m512i u[4];
        unpack_i6_quad(w + quad * kI6QuadBytes, u);
        for (int i = 0; i < 4; ++i) {
          const int p = 4 * quad + i;
          for (int r = 0; r < MR; ++r) {
            const int8_t* xr = xq + (r0 + r) * k + k0;
            isum[r][p % kChains] = dot_u8s8<true>(isum[r][p % kChains], u[i], broadcast4(xr + 4 * p));
          }
        }
      }
    }
    __m512i exact[MR];
    for (int r = 0; r < MR; ++r) {
      exact[r] = isum[r][0];
      if constexpr (kChains >= 2) exact[r] = _mm512_add_epi32(exact[r], isum[r][1]);
      if constexpr (kChains == 4)
        exact[r] = _mm512_add_epi32(exact[r], _mm512_add_epi32(isum[r][2], isum[r][3]));
      if constexpr (byte_offset<F>() != 0 && !folded) {
        const int32_t offsets = byte_offset<F>() * x.sum<G>(r0 + r, g);
        exact[r] = _mm512_sub_epi32(exact[r], _mm512_set1_epi32(offsets));
      }
    }
    if constexpr (folded) {
      // The weights' byte offset o (bytes hold q + o) is taken off once a super block, not
      // once a group: P = sum_g sm_g (dot_g - o s_g) = sum_g sm_g dot_g - o sum_g sm_g s_g,
      // the last sum by multiplier pairs (pair_dot), as the mins' is. The same integer P,
      // so the same bits (int32 arithmetic wraps modulo 2^32 and P itself fits). Per group
      // and row that saves a scalar load, multiply, broadcast and vpsubd: 15-27% of a Q6_K
      // linear's time at 16-64 rows (Zen 5). The tiles with an offset are the i6 ones
      // (Q2_K, Q3_K, Q5_K, Q6_K) and their unpacked i8 form.
      const __m512i sm = group_multipliers16(scales, g);
      for (int r = 0; r < MR; ++r)
        folded_sums[r] = _mm512_add_epi32(folded_sums[r], _mm512_mullo_epi32(exact[r], sm));
      if (g % (kSuper / G) == kSuper / G - 1) {  // the super block's last group
        const int64_t sb = g / (kSuper / G);
        constexpr int kPairs = kSuper / G / 2;
        if constexpr (byte_offset<F>() != 0) {
          __m512i scale_pairs[kPairs];
          multiplier_pairs<G>(scales, sb, scale_pairs);
          const __m512i offset = _mm512_set1_epi32(byte_offset<F>());
          for (int r = 0; r < MR; ++r) {
            const __m512i offsets = pair_dot<kPairs>(scale_pairs, x.super_sums<G>(r0 + r, sb));
            folded_sums[r] = _mm512_sub_epi32(folded_sums[r], _mm512_mullo_epi32(offsets, offset));
          }
        }
        __m512i min_pairs[kPairs];
        __m512 mf = _mm512_setzero_ps();
        if (mins != nullptr) {
          multiplier_pairs<G>(mins, sb, min_pairs);
          mf = super_factors16(mins, groups, sb);
        }
        const __m512 sf = super_factors16(scales, groups, sb);
        for (int r = 0; r < MR; ++r) {
          const int64_t row = r0 + r;
          acc[r] = super_steps16<kPairs>(acc[r], folded_sums[r], sf,
                                         mins != nullptr ? min_pairs : nullptr, mf,
                                         x.super_scale(row, sb), x.super_sums<G>(row, sb));
          folded_sums[r] = _mm512_setzero_si512();
        }
      }
    } else {
      const __m512 s = group_values16<S, G>(scales, groups, g);
      __m512 mn = _mm512_setzero_ps();
      if (mins != nullptr) mn = group_values16<S, G>(mins, groups, g);
      for (int r = 0; r < MR; ++r) {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact[r]),
                                 _mm512_mul_ps(s, _mm512_set1_ps(x.scale<G>(r0 + r, g))), acc[r]);
        if (mins != nullptr)
          acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(x.group_min_scale<G>(r0 + r, g)), acc[r]);
      }
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1);
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(out + r * out_stride, mask, acc[r]);
}
#elif defined(PAGEDLLM_AVX2)
// AVX2 (no VNNI): a tile's 16 weight rows as two halves of 8 (bytes 0..31 and 32..63 of
// each 64-byte vector), one half after the other, with the same float32 steps per lane as
// the AVX-512 code. The integer sums come from vpmaddubsw (unsigned x signed bytes, pairs
// summed into int16) and vpmaddwd (pairs of int16 into int32):
//   u4: nibbles 0..15 times activations of at most 127 give pairs of at most 3810, so a
//       whole group of 32 (8 vpmaddubsw per row) sums in int16 (<= 30480) before one
//       vpmaddwd.
//   i8: the bytes hold q + 128; pairs of those could overflow int16, so the signed q
//       (byte xor 128) is used as |q| (unsigned, <= 128) times x with q's sign (pairs
//       <= 32512), widened by vpmaddwd after every vector. The sum is q . x itself, the
//       same exact integer as the other paths', with no 128 * sum(x) to take off.
// With 16 vector registers, one half-tile pass holds MR <= kAvx2PassRows rows: the int16 or
// int32 sums, the unpacked weights, the constants and a broadcast; the float accumulators,
// touched once per group, may wait on the stack (at 6 rows GCC keeps a few integer sums
// there too). So a step verifying up to 5 drafted tokens (6 rows: vLLM's n-gram example
// drafts 5) unpacks each weight tile once. With passes of at most 4 a 5th row cost twice
// what the 4th did; with passes of at most 5 the 6th row cost gate_up 31 us a layer, in one
// pass of 6 it costs 19 (one thread, Zen 3), and 5 rows are unchanged. A pass of more rows
// runs as two. The i8 kernel keeps more per row (each row's activations signed by the
// weights), and at 5 and 6 rows GCC spilled its int32 sums inside the loop (20-41 stack
// accesses per 16-24 vpmaddubsw in the disassembly): its passes take at most 4 rows, so the
// Q8_0 LM head at 5 rows runs as 4 + 1 (1.73-1.80 -> 1.54-1.63 ms a call on Zen 3, 2
// threads; 6 and 7 rows 8-13% faster too).

constexpr int kAvx2PassRows = 6;
constexpr int kAvx2I8PassRows = 4;

// Lanes 8 half .. 8 half + 7 of group g's values (GroupValues).
template <typename S, int G>
inline __m256 group_values8(const void* base, int64_t groups, int64_t g, int half) {
  if constexpr (std::is_same_v<S, KScale>) {
    const int8_t* mult = static_cast<const int8_t*>(base);
    const float* factor = reinterpret_cast<const float*>(mult + groups * kTile);
    const __m256i m = _mm256_cvtepi8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mult + g * kTile + 8 * half)));
    return _mm256_mul_ps(_mm256_loadu_ps(factor + (g * G / 256) * kTile + 8 * half),
                         _mm256_cvtepi32_ps(m));
  } else {
    return load8_float(static_cast<const S*>(base) + g * kTile + 8 * half);
  }
}

// The folded recipe's KScale parts, lanes 8 half .. 8 half + 7: group g's int8 multipliers
// as int32, super block s's float factors.
inline __m256i group_multipliers8(const void* base, int64_t g, int half) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(
      reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(base) + g * kTile + 8 * half)));
}
inline __m256 super_factors8(const void* base, int64_t groups, int64_t s, int half) {
  const float* factor = reinterpret_cast<const float*>(static_cast<const int8_t*>(base) + groups * kTile);
  return _mm256_loadu_ps(factor + s * kTile + 8 * half);
}

inline __m256i broadcast4_avx2(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Half `half` (rows 8 half .. 8 half + 7) of an i6 quad -> its 4 vectors of signed q.
PAGEDLLM_INLINE inline void unpack_i6_quad_half(const uint8_t* quad, int half, __m256i (&q)[4]) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  const __m256i offset = _mm256_set1_epi8(32);
  auto load = [&](int part) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quad + part * 64 + 32 * half));
  };
  const __m256i a = load(0), b = load(1), c = load(2);
  const __m256i u[4] = {
      _mm256_or_si256(_mm256_and_si256(a, nibble), _mm256_and_si256(_mm256_slli_epi16(c, 4), top)),
      _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), nibble),
                      _mm256_and_si256(_mm256_slli_epi16(c, 2), top)),
      _mm256_or_si256(_mm256_and_si256(b, nibble), _mm256_and_si256(c, top)),
      _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), nibble),
                      _mm256_and_si256(_mm256_srli_epi16(c, 2), top)),
  };
  for (int i = 0; i < 4; ++i) q[i] = _mm256_sub_epi8(u[i], offset);
}

// Pins a running sum in a register at this point. Integer adds reassociate freely, and GCC
// used that to compute all 32 vpmaddubsw of a 4-row pass first and add them up after,
// spilling most of them to the stack (the pass ran at a third of its issue rate).
inline void keep_in_register(__m256i& v) { asm("" : "+x"(v)); }

template <Format F, int G, int MR, typename S, bool Fold = kFolded<F, S>>
inline void tile_rows_half(const TileData& tile, const QuantizedRows& x, int64_t r0,
                           float* out, int64_t out_stride, int64_t lanes, int half,
                           const TileData* next) {
  static_assert(MR <= kAvx2PassRows, "more rows than a half-tile pass holds in registers");
  const int64_t k = x.k, groups = k / G;
  const void* scales = tile.scales;
  const void* mins = tile.mins;
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  constexpr int64_t group_bytes = tile_group_bytes<F>(G);  // of the 16 rows
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  constexpr bool folded = Fold;
  const int8_t* xq = folded ? x.qk : x.q;
  __m256i folded_sums[MR];  // the folded recipe's P of the current super block
  for (int r = 0; r < MR; ++r) folded_sums[r] = _mm256_setzero_si256();
  for (int64_t g = 0; g < groups; ++g) {
    // Prefetching as the AVX-512 code does; the second half reads the tile from L1.
    if (half == 0 && MR <= 2) {
      const char* ahead = reinterpret_cast<const char*>(tile.bytes + (g + kAhead) * group_bytes);
      for (int64_t line = 0; line < group_bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    } else if (half == 0 && next != nullptr) {
      const char* ahead = reinterpret_cast<const char*>(next->bytes + g * group_bytes);
      for (int64_t line = 0; line < group_bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    }
    const int64_t k0 = g * G;
    __m256i exact[MR];
    if constexpr (F == Format::kU4) {
      const uint8_t* w = tile.bytes + g * 256 + 32 * half;
      __m256i pairs[MR];  // int16 sums of the group, exact (see above)
      for (int r = 0; r < MR; ++r) pairs[r] = _mm256_setzero_si256();
      for (int p = 0; p < 4; ++p) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 64));
        const __m256i lo = _mm256_and_si256(v, nibble);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        for (int r = 0; r < MR; ++r) {
          const int8_t* xr = xq + (r0 + r) * k + k0;
          pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(lo, broadcast4_avx2(xr + 4 * p)));
          pairs[r] = _mm256_add_epi16(pairs[r],
                                      _mm256_maddubs_epi16(hi, broadcast4_avx2(xr + 4 * p + 16)));
        }
        for (int r = 0; r < MR; ++r) keep_in_register(pairs[r]);
      }
      if constexpr (folded) {
        // vpmaddwd against the group's multiplier in both halves of each lane: sm times the
        // group's sum, exact, folded into P.
        const __m256i sm = group_multipliers8(scales, g, half);
        const __m256i sm_twice = _mm256_or_si256(_mm256_and_si256(sm, _mm256_set1_epi32(0xFFFF)),
                                                 _mm256_slli_epi32(sm, 16));
        for (int r = 0; r < MR; ++r)
          folded_sums[r] = _mm256_add_epi32(folded_sums[r], _mm256_madd_epi16(pairs[r], sm_twice));
      } else {
        for (int r = 0; r < MR; ++r) exact[r] = _mm256_madd_epi16(pairs[r], ones);
      }
    } else {
      // Vector p's signed q (16 rows x 4 K values, this half's 8 rows).
      auto signed_q = [&](int p, __m256i (&quad)[4]) {
        if constexpr (F == Format::kI8) {
          const uint8_t* w = tile.bytes + (k0 + 4 * p) * 16 + 32 * half;
          return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)), flip);
        } else {
          if (p % 4 == 0) unpack_i6_quad_half(tile.bytes + g * group_bytes + (p / 4) * kI6QuadBytes, half, quad);
          return quad[p % 4];
        }
      };
      __m256i quad[4];
      for (int r = 0; r < MR; ++r) exact[r] = _mm256_setzero_si256();
      for (int p = 0; p < G / 4; ++p) {
        const __m256i q = signed_q(p, quad);
        const __m256i magnitude = _mm256_abs_epi8(q);  // -128 gives the byte 128: |q|
        for (int r = 0; r < MR; ++r) {
          const __m256i signed_x = _mm256_sign_epi8(broadcast4_avx2(xq + (r0 + r) * k + k0 + 4 * p), q);
          exact[r] = _mm256_add_epi32(
              exact[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), ones));
        }
        for (int r = 0; r < MR; ++r) keep_in_register(exact[r]);
      }
      if constexpr (folded) {  // q . x exactly (no offset here), times sm, into P
        const __m256i sm = group_multipliers8(scales, g, half);
        for (int r = 0; r < MR; ++r)
          folded_sums[r] = _mm256_add_epi32(folded_sums[r], _mm256_mullo_epi32(exact[r], sm));
      }
    }
    if constexpr (folded) {
      if (g % (kSuper / G) != kSuper / G - 1) continue;
      const int64_t sb = g / (kSuper / G);
      __m256i min_pairs[8];  // this half's 8 lanes, against 16-value sums (G = 32: repeated)
      for (int p = 0; p < 8 && mins != nullptr; ++p) {
        const __m256i even = group_multipliers8(mins, G == 16 ? 16 * sb + 2 * p : 8 * sb + p, half);
        const __m256i odd = G == 16 ? group_multipliers8(mins, 16 * sb + 2 * p + 1, half) : even;
        min_pairs[p] = _mm256_or_si256(_mm256_and_si256(even, _mm256_set1_epi32(0xFFFF)),
                                       _mm256_slli_epi32(odd, 16));
      }
      const __m256 sf = super_factors8(scales, groups, sb, half);
      for (int r = 0; r < MR; ++r) {
        const __m256 d = _mm256_set1_ps(x.super_scale(r0 + r, sb));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(folded_sums[r]), _mm256_mul_ps(sf, d), acc[r]);
        folded_sums[r] = _mm256_setzero_si256();
        if (mins == nullptr) continue;
        const int16_t* sums = x.super_sums<16>(r0 + r, sb);  // duplicated pairs for G = 32
        __m256i q = _mm256_setzero_si256();
        for (int p = 0; p < 8; ++p) {
          int32_t pair;
          std::memcpy(&pair, sums + 2 * p, 4);
          q = _mm256_add_epi32(q, _mm256_madd_epi16(min_pairs[p], _mm256_set1_epi32(pair)));
        }
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q),
                                 _mm256_mul_ps(super_factors8(mins, groups, sb, half), d), acc[r]);
      }
      continue;
    }
    const __m256 s = group_values8<S, G>(scales, groups, g, half);
    const __m256 mn =
        mins != nullptr ? group_values8<S, G>(mins, groups, g, half) : _mm256_setzero_ps();
    for (int r = 0; r < MR; ++r) {
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact[r]),
                               _mm256_mul_ps(s, _mm256_set1_ps(x.scale<G>(r0 + r, g))), acc[r]);
      if (mins != nullptr)
        acc[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(x.group_min_scale<G>(r0 + r, g)), acc[r]);
    }
  }
  const int64_t valid = std::min<int64_t>(8, lanes - 8 * half);
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (int r = 0; r < MR; ++r) _mm256_maskstore_ps(out + r * out_stride + 8 * half, mask, acc[r]);
}

template <Format F, int G, int MR, typename S, bool Fold = kFolded<F, S>>
inline void tile_rows(const TileData& tile, const QuantizedRows& x, int64_t r0, float* out,
                      int64_t out_stride, int64_t lanes, const TileData* next = nullptr) {
  constexpr int kPass = F == Format::kU4 ? kAvx2PassRows : kAvx2I8PassRows;
  if constexpr (MR > kPass) {
    tile_rows<F, G, kPass, S, Fold>(tile, x, r0, out, out_stride, lanes, next);
    tile_rows<F, G, MR - kPass, S, Fold>(tile, x, r0 + kPass, out + kPass * out_stride, out_stride,
                                   lanes);
  } else {
    for (int half = 0; half < 2 && 8 * half < lanes; ++half)
      tile_rows_half<F, G, MR, S, Fold>(tile, x, r0, out, out_stride, lanes, half, next);
  }
}
#else
// Without AVX-512 or AVX2: the same recipe, one output element at a time (slow; the engine
// only takes the fast path on AVX-512 and AVX2 CPUs).
template <Format F, int G, int MR, typename S, bool Fold = kFolded<F, S>>
inline void tile_rows(const TileData& tile, const QuantizedRows& x, int64_t r0, float* out,
                      int64_t out_stride, int64_t lanes, const TileData* /*next*/ = nullptr) {
  const int64_t k = x.k, groups = k / G;
  for (int r = 0; r < MR; ++r) {
    const int64_t row = r0 + r;
    for (int64_t lane = 0; lane < lanes; ++lane) {
      float acc = 0.f;
      int32_t folded_sum = 0;  // the folded recipe's P of the current super block
      for (int64_t g = 0; g < groups; ++g) {
        int32_t isum = 0;
        const int8_t* xq = Fold ? x.qk : x.q;
        for (int64_t kk = g * G; kk < (g + 1) * G; ++kk) {
          isum += tile_value<F>(tile.bytes, kk, lane) * xq[row * k + kk];
        }
        if constexpr (Fold) {
          folded_sum += group_multiplier(tile.scales, g, lane) * isum;
          if (g % (kSuper / G) != kSuper / G - 1) continue;
          const int64_t sb = g / (kSuper / G);
          const float dk = x.super_scale(row, sb);
          acc = std::fma(static_cast<float>(folded_sum),
                         super_factor(tile.scales, groups, sb, lane) * dk, acc);
          folded_sum = 0;
          if (tile.mins == nullptr) continue;
          int32_t min_sum = 0;
          for (int64_t j = sb * (kSuper / G); j < (sb + 1) * (kSuper / G); ++j)
            min_sum += group_multiplier(tile.mins, j, lane) * x.super_group_sum<G>(row, j);
          acc = std::fma(static_cast<float>(min_sum), super_factor(tile.mins, groups, sb, lane) * dk,
                         acc);
          continue;
        }
        const float s = group_value<S, G>(tile.scales, groups, g, lane);
        acc = std::fma(static_cast<float>(isum), s * x.scale<G>(row, g), acc);
        if (tile.mins != nullptr)
          acc = std::fma(group_value<S, G>(tile.mins, groups, g, lane),
                         x.group_min_scale<G>(row, g), acc);
      }
      out[r * out_stride + lane] = acc;
    }
  }
}
#endif

#ifdef PAGEDLLM_AMX
// ------------------------------------------------------------------ AMX
// The same recipe with AMX tiles producing the integer sums (amx.h). For 16 rows of x and
// one weight tile, TDPBSSD multiplies a weight group's activations (A: 16 rows x G int8)
// by the group's G values of the 16 weight rows (B: G/4 rows x 64 bytes in VNNI order,
// the layout of an i8 tile's vectors, and of a u4 group's nibbles once split) into int32
// C [16, 16]. C is stored, and the float32 steps of tile_rows follow, lane-wise over the
// 16 weight rows: the same bits as the VNNI path for every element.
//
// Used from kAmxMinRows rows of x: below that the VNNI path streams the weights once and
// is faster. Measured on the Xeon with AMX (2026-12-06, one process alternating, ms per
// call): a u4 (Q4_1) 3072 x 576 weight at 8 rows 0.064 on AMX against 0.047 on VNNI, at 12
// 0.074 against 0.068, at 16 0.074 against 0.089; an i8 (Q8_0) 8192 x 2048 at 8 rows 0.70
// against 0.57, at 12 0.73 against 0.76, at 16 0.71 against 0.96 (every shape tried alike).
constexpr int64_t kAmxMinRows = 16;
constexpr int64_t kTileBlock = 4;  // weight tiles whose B tiles are made and used together
// The folded recipe from 16 rows for u4 tiles (Q4_K) and from 12 for i6 tiles (Q2_K, Q3_K,
// Q5_K, Q6_K): its B tiles cost twice the bytes to make, which a chunk of fewer rows does
// not repay. Q4_K 16384 x 2048 gate_up: 8 rows 1.28 ms on AMX against 0.79 on VNNI, 12
// rows 1.38 against 1.15, 16 rows 1.57 against 1.55, 24 rows 1.92 against 2.36; Q6_K
// 2048 x 8192 down: 8 rows 0.69 against 0.72, 12 rows 0.69 against 0.95, 16 rows 0.90
// against 1.60 (VNNI's i6 unpacking costs more per row than u4's).
template <Format F>
constexpr int64_t kAmxFoldedMinRows = F == Format::kU4 ? 16 : 12;

// The activations of one call regrouped for AMX, per chunk c of 16 rows (rows past M zero):
//   q   int8  [chunks, K/G, 16 rows, G]   an A tile is 16 G contiguous bytes
//   d   float [chunks, K/G, 16 rows]      group g's activation scale for the 16 rows
//   md  float [chunks, K/G, 16 rows]      group g's min factor
struct AmxRows {
  const int8_t* q;
  const float* d;
  const float* md;
  int64_t groups;
};

template <int G>
AmxRows amx_rows(const QuantizedRows& x, int64_t m) {
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d, md;
  const int64_t groups = x.k / G, chunks = (m + kTile - 1) / kTile;
  q.assign(chunks * groups * kTile * G, 0);
  d.assign(chunks * groups * kTile, 0.f);
  md.assign(chunks * groups * kTile, 0.f);
  for (int64_t row = 0; row < m; ++row) {
    const int64_t c = row / kTile, r = row % kTile;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = (c * groups + g) * kTile + r;
      std::memcpy(&q[at * G], x.q + row * x.k + g * G, G);
      d[at] = x.scale<G>(row, g);
      md[at] = x.group_min_scale<G>(row, g);
    }
  }
  return {q.data(), d.data(), md.data(), groups};
}

// One weight tile's B tiles, int8 [K/G, G/4, 64] (signed: the exact q):
//   u4: group g's 4 vectors of nibble pairs -> its low nibbles (K 0..15), then its high;
//   i8: the tile's bytes hold q + 128, and q + 128 xor 128 is q as a signed byte;
//   i6: each quad unpacked to u = q + 32, less 32.
template <Format F>
void weight_groups(const uint8_t* bytes, int64_t k, uint8_t* out) {
  if constexpr (F == Format::kU4) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int64_t g = 0; g < k / 32; ++g) {
      for (int p = 0; p < 4; ++p) {
        const __m512i v = _mm512_loadu_si512(bytes + g * 256 + p * 64);
        _mm512_store_si512(out + g * 512 + p * 64, _mm512_and_si512(v, nibble));
        _mm512_store_si512(out + g * 512 + 256 + p * 64,
                           _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble));
      }
    }
  } else if constexpr (F == Format::kI8) {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int64_t v = 0; v < k / 4; ++v)
      _mm512_store_si512(out + v * 64, _mm512_xor_si512(_mm512_loadu_si512(bytes + v * 64), flip));
  } else {  // i6: u - 32
    const __m512i offset = _mm512_set1_epi8(32);
    for (int64_t quad = 0; quad < k / 16; ++quad) {
      __m512i u[4];
      unpack_i6_quad(bytes + quad * kI6QuadBytes, u);
      for (int i = 0; i < 4; ++i)
        _mm512_store_si512(out + (4 * quad + i) * 64, _mm512_sub_epi8(u[i], offset));
    }
  }
}

// One group's integer sums for 16 rows of x against one weight tile -> sums, int32 [16
// rows, 16 lanes], through accumulator C, A tile TA and B tile TB (tile numbers are
// instruction immediates).
#define PAGEDLLM_GROUP_SUMS(C, TA, TB, a, b, G, sums) \
  do {                                                \
    _tile_zero(C);                                    \
    PAGEDLLM_TILE_LOAD(TA, (a), G, kTile * G);        \
    PAGEDLLM_TILE_LOAD(TB, (b), 64, G * 16);          \
    _tile_dpbssd(C, TA, TB);                          \
    PAGEDLLM_TILE_STORE(C, (sums));                   \
  } while (0)

// The rows of a chunk, for code that names one accumulator per row (see amx_tile_rows).
#define PAGEDLLM_EACH_ROW(X) \
  X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)
// Row R's accumulator into out (rows out_stride apart, `mask` its lanes), if R < rows.
#define PAGEDLLM_STORE_ROW(R) \
  if constexpr (R < MR)       \
    if (R < rows) _mm512_mask_storeu_ps(out + R * out_stride, mask, acc##R);

// fn(std::integral_constant<int, MR>) for a chunk of `rows` rows: MR the multiple of 4 that
// the AMX kernels compute (their accumulators are named per row, so MR is a template value).
template <typename Fn>
inline void with_chunk_rows(int64_t rows, const Fn& fn) {
  switch ((rows + 3) / 4) {
    case 4: fn(std::integral_constant<int, 16>{}); break;
    case 3: fn(std::integral_constant<int, 12>{}); break;
    case 2: fn(std::integral_constant<int, 8>{}); break;
    default: fn(std::integral_constant<int, 4>{}); break;
  }
}

// Chunk c of x (16 rows; MR of them computed, a multiple of 4) against one weight tile
// whose B tiles are `wgroups`; the first `rows` rows are stored into out.
//
// The accumulators are 16 named variables, not an array: GCC keeps an array of 16 vectors
// in memory, a load and a store at every update, which made the store port the limit
// (25 against 14 ns per 16 x 16 x 32 block, measured).
template <int G, int MR, typename S>
void amx_tile_rows(const uint8_t* wgroups, const TileData& tile, const AmxRows& x, int64_t c,
                   float* out, int64_t out_stride, int64_t lanes, int64_t rows) {
  constexpr int64_t a_bytes = kTile * G, b_bytes = G * 16;  // per group
  const int64_t groups = x.groups;
  const void* scales = tile.scales;
  const void* mins = tile.mins;
  const int8_t* a = x.q + c * groups * a_bytes;
  const float* d = x.d + c * groups * kTile;
  const float* md = x.md + c * groups * kTile;
  alignas(64) int32_t sums[2][256];  // [group parity][row * 16 + lane]
#define PAGEDLLM_DECLARE(R) __m512 acc##R = _mm512_setzero_ps();
  PAGEDLLM_EACH_ROW(PAGEDLLM_DECLARE)
#undef PAGEDLLM_DECLARE
  // Software pipeline: group g + 1 is multiplied (tiles 1/5/7 or 0/4/6) while the float
  // steps of group g run.
  PAGEDLLM_GROUP_SUMS(0, 4, 6, a, wgroups, G, sums[0]);
  for (int64_t g = 0; g < groups; ++g) {
    if (g + 1 < groups) {
      const int8_t* ag = a + (g + 1) * a_bytes;
      const uint8_t* bg = wgroups + (g + 1) * b_bytes;
      if ((g + 1) & 1) PAGEDLLM_GROUP_SUMS(1, 5, 7, ag, bg, G, sums[1]);
      else PAGEDLLM_GROUP_SUMS(0, 4, 6, ag, bg, G, sums[0]);
    }
    const int32_t* group_sums = sums[g & 1];
    const __m512 s = group_values16<S, G>(scales, groups, g);
    const float* dg = d + g * kTile;
#define PAGEDLLM_SCALE(R)                                                                   \
  if constexpr (R < MR)                                                                     \
    acc##R = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(group_sums + R * 16)),   \
                             _mm512_mul_ps(s, _mm512_set1_ps(dg[R])), acc##R);
    PAGEDLLM_EACH_ROW(PAGEDLLM_SCALE)
#undef PAGEDLLM_SCALE
    if (mins != nullptr) {
      const __m512 mn = group_values16<S, G>(mins, groups, g);
      const float* mdg = md + g * kTile;
#define PAGEDLLM_MIN(R) \
  if constexpr (R < MR) acc##R = _mm512_fmadd_ps(mn, _mm512_set1_ps(mdg[R]), acc##R);
      PAGEDLLM_EACH_ROW(PAGEDLLM_MIN)
#undef PAGEDLLM_MIN
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1);
  PAGEDLLM_EACH_ROW(PAGEDLLM_STORE_ROW)
}

// Chunk c of x (its first `rows` rows) against one weight tile whose B tiles are `b`.
template <int G, typename S>
inline void amx_chunk(const uint8_t* b, const TileData& tile, const AmxRows& x, int64_t c,
                      float* out, int64_t ldo, int64_t lanes, int64_t rows) {
  with_chunk_rows(rows, [&](auto mr) {
    amx_tile_rows<G, decltype(mr)::value, S>(b, tile, x, c, out, ldo, lanes, rows);
  });
}

template <Format F, typename S>
constexpr int64_t amx_min_rows() {
  return kFolded<F, S> ? kAmxFoldedMinRows<F> : kAmxMinRows;
}

// ---- the folded recipe on AMX
// The activations of one call for the folded recipe, per chunk c of 16 rows (rows past M
// zero):
//   q     int8  [chunks, K/64, 16 rows, 64]     an A tile per 64 values of K
//   d     float [chunks, K/256, 16 rows]        dk
//   sums  int16 [chunks, K/256, 16 rows, 256/G] each group's sum of qk (sk, or sk32)
struct AmxSuperRows {
  const int8_t* q;
  const float* d;
  const int16_t* sums;
  int64_t supers;
};

template <int G>
AmxSuperRows amx_super_rows(const QuantizedRows& x, int64_t m) {
  constexpr int64_t kSums = kSuper / G;  // per row and super block
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d;
  thread_local std::vector<int16_t> sums;
  const int64_t k = x.k, steps = k / 64, supers = k / kSuper, chunks = (m + kTile - 1) / kTile;
  q.assign(chunks * steps * kTile * 64, 0);
  d.assign(chunks * supers * kTile, 0.f);
  sums.assign(chunks * supers * kTile * kSums, 0);
  for (int64_t row = 0; row < m; ++row) {
    const int64_t c = row / kTile, r = row % kTile;
    for (int64_t step = 0; step < steps; ++step)
      std::memcpy(&q[((c * steps + step) * kTile + r) * 64], x.qk + row * k + step * 64, 64);
    for (int64_t sb = 0; sb < supers; ++sb) {
      d[(c * supers + sb) * kTile + r] = x.super_scale(row, sb);
      std::memcpy(&sums[((c * supers + sb) * kTile + r) * kSums], x.super_sums<G>(row, sb),
                  kSums * sizeof(int16_t));
    }
  }
  return {q.data(), d.data(), sums.data(), supers};
}

// One Q4_K weight tile (u4 bytes, its KScale scales at `scales`) -> its folded B tiles,
// int8 [K/64, 2, 16, 64]: per 64 values of K the tile of q * (sm & 7), then the tile of
// q * (sm >> 3), so that q * sm = first + 8 second, in the VNNI order of weight_groups
// (group 2j in B rows 0..7 of step j, group 2j + 1 in rows 8..15). Q4_K's multipliers are
// 6 bits (0..63, checked when the weight is tiled): each part is at most 15 * 7 = 105, so
// a 16-bit multiply of two nibble bytes by a part leaves each byte its own product.
void folded_weight_groups(const uint8_t* bytes, const void* scales, int64_t k, uint8_t* out) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < k / 32; ++g) {
    // Lane r (row r's 4 bytes): the part in both of its 16-bit halves.
    const __m512i sm = group_multipliers16(scales, g);
    const __m512i low = _mm512_and_si512(sm, _mm512_set1_epi32(7));
    const __m512i high = _mm512_srli_epi32(sm, 3);
    const __m512i low16 = _mm512_or_si512(low, _mm512_slli_epi32(low, 16));
    const __m512i high16 = _mm512_or_si512(high, _mm512_slli_epi32(high, 16));
    uint8_t* step = out + (g / 2) * 2048 + (g % 2) * 512;
    for (int p = 0; p < 4; ++p) {
      const __m512i v = _mm512_loadu_si512(bytes + g * 256 + p * 64);
      const __m512i nibbles[2] = {_mm512_and_si512(v, nibble),
                                  _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble)};
      for (int half = 0; half < 2; ++half) {  // K 4p + j, then 16 + 4p + j
        _mm512_store_si512(step + half * 256 + p * 64, _mm512_mullo_epi16(nibbles[half], low16));
        _mm512_store_si512(step + 1024 + half * 256 + p * 64,
                           _mm512_mullo_epi16(nibbles[half], high16));
      }
    }
  }
}

// One i6 weight tile (Q2_K, Q3_K, Q5_K, Q6_K; groups of G) -> its folded B tiles, int8
// [K/64, 2, 16, 64]: per 64 values of K the tile of (q * sm) & 127, then the tile of
// (q * sm) >> 7, so that q * sm = first + 128 second (|q * sm| <= 32 * 128: the second is
// within -32..32), K in the i8 order (vector p, K values 4p .. 4p + 3: B row p % 16 of
// step p / 16).
template <int G>
void folded_i6_weight_groups(const uint8_t* bytes, const void* scales, int64_t k, uint8_t* out) {
  const __m512i offset = _mm512_set1_epi8(32), low7 = _mm512_set1_epi8(0x7F);
  const __mmask64 odd_bytes = 0xAAAAAAAAAAAAAAAAull;
  for (int64_t quad = 0; quad < k / 16; ++quad) {
    // The quad's group multiplier of each row, as int16 in both halves of the row's lane.
    const __m512i sm = group_multipliers16(scales, quad * 16 / G);
    const __m512i sm16 = _mm512_or_si512(_mm512_and_si512(sm, _mm512_set1_epi32(0xFFFF)),
                                         _mm512_slli_epi32(sm, 16));
    __m512i u[4];
    unpack_i6_quad(bytes + quad * kI6QuadBytes, u);
    for (int i = 0; i < 4; ++i) {
      const int64_t p = 4 * quad + i;
      const __m512i q = _mm512_sub_epi8(u[i], offset);
      // Each byte's q * sm as an exact int16: the even bytes, then the odd ones.
      const __m512i even = _mm512_mullo_epi16(_mm512_srai_epi16(_mm512_slli_epi16(q, 8), 8), sm16);
      const __m512i odd = _mm512_mullo_epi16(_mm512_srai_epi16(q, 8), sm16);
      const __m512i lo = _mm512_and_si512(
          _mm512_mask_blend_epi8(odd_bytes, even, _mm512_slli_epi16(odd, 8)), low7);
      const __m512i hi = _mm512_mask_blend_epi8(odd_bytes, _mm512_srai_epi16(even, 7),
                                                _mm512_slli_epi16(_mm512_srai_epi16(odd, 7), 8));
      uint8_t* row = out + (p / 16) * 2048 + (p % 16) * 64;
      _mm512_store_si512(row, lo);
      _mm512_store_si512(row + 1024, hi);
    }
  }
}

// One super block's folded sums for 16 rows of x against one weight tile: accumulators 0
// (lo) and 1 (hi) over its 4 steps of 64 values of K, stored into sums[0] and sums[1], int32
// [16 rows, 16 lanes] each. The steps alternate between two sets of A and B tiles (4, 2, 3
// and 5, 6, 7): tiles are not renamed, so a step that loaded into the tiles the last one
// multiplies would wait for that multiply to finish.
#define PAGEDLLM_SUPER_STEP(TA, TL, TH, a, b)       \
  PAGEDLLM_TILE_LOAD(TA, (a), 64, 1024);            \
  PAGEDLLM_TILE_LOAD(TL, (b), 64, 1024);            \
  PAGEDLLM_TILE_LOAD(TH, (b) + 1024, 64, 1024);     \
  _tile_dpbssd(0, TA, TL);                          \
  _tile_dpbssd(1, TA, TH)
#define PAGEDLLM_SUPER_SUMS(a, b, sums)                          \
  do {                                                           \
    _tile_zero(0);                                               \
    _tile_zero(1);                                               \
    PAGEDLLM_SUPER_STEP(4, 2, 3, (a), (b));                      \
    PAGEDLLM_SUPER_STEP(5, 6, 7, (a) + 1024, (b) + 2048);        \
    PAGEDLLM_SUPER_STEP(4, 2, 3, (a) + 2048, (b) + 4096);        \
    PAGEDLLM_SUPER_STEP(5, 6, 7, (a) + 3072, (b) + 6144);        \
    PAGEDLLM_TILE_STORE(0, (sums)[0]);                           \
    PAGEDLLM_TILE_STORE(1, (sums)[1]);                           \
  } while (0)

// amx_tile_rows for the folded recipe: chunk c of x (MR rows computed) against one weight
// tile (groups of G) whose folded B tiles are `wfolded`, over super blocks [sb_begin,
// sb_end) of K. P = lo + (hi << kHiShift) (3 for u4 tiles, 7 for i6), then super_steps16
// per row. A slice that does not start at K's first super block continues the
// accumulators that the previous slice left in `partial` (float [16 rows, 16 lanes]); one
// that does not end at K's last leaves them there, else the rows are stored into out. A
// float32 through memory is exact, so the slices give the bits of one pass over K.
template <int MR, int kHiShift, int G>
void amx_folded_tile_rows(const uint8_t* wfolded, const TileData& tile, const AmxSuperRows& x,
                          int64_t c, int64_t sb_begin, int64_t sb_end, float* partial,
                          float* out, int64_t out_stride, int64_t lanes, int64_t rows) {
  const int64_t supers = x.supers, groups = supers * (kSuper / G);
  const int8_t* a = x.q + c * supers * 4 * 1024;
  const float* d = x.d + c * supers * kTile;
  constexpr int64_t kSums = kSuper / G;  // a row's group sums per super block
  constexpr int kPairs = kSums / 2;
  const int16_t* row_sums = x.sums + c * supers * kTile * kSums;
  alignas(64) int32_t sums[2][2][256];  // [super block parity][lo, hi][row * 16 + lane]
#define PAGEDLLM_DECLARE(R) \
  __m512 acc##R = sb_begin > 0 ? _mm512_load_ps(partial + R * 16) : _mm512_setzero_ps();
  PAGEDLLM_EACH_ROW(PAGEDLLM_DECLARE)
#undef PAGEDLLM_DECLARE
  // Software pipeline as amx_tile_rows: super block s + 1 is multiplied while the float
  // steps of s run.
  PAGEDLLM_SUPER_SUMS(a + sb_begin * 4096, wfolded + sb_begin * 8192, sums[sb_begin & 1]);
  for (int64_t sb = sb_begin; sb < sb_end; ++sb) {
    if (sb + 1 < sb_end)
      PAGEDLLM_SUPER_SUMS(a + (sb + 1) * 4096, wfolded + (sb + 1) * 8192, sums[(sb + 1) & 1]);
    const int32_t* lo = sums[sb & 1][0];
    const int32_t* hi = sums[sb & 1][1];
    __m512i min_pairs[kPairs];
    __m512 mf = _mm512_setzero_ps();
    if (tile.mins != nullptr) {
      multiplier_pairs<G>(tile.mins, sb, min_pairs);
      mf = super_factors16(tile.mins, groups, sb);
    }
    const __m512i* pairs = tile.mins != nullptr ? min_pairs : nullptr;
    const __m512 sf = super_factors16(tile.scales, groups, sb);
#define PAGEDLLM_SUPER_STEPS(R)                                                                 \
  if constexpr (R < MR)                                                                         \
    acc##R = super_steps16<kPairs>(                                                             \
        acc##R,                                                                                 \
        _mm512_add_epi32(_mm512_load_si512(lo + R * 16),                                        \
                         _mm512_slli_epi32(_mm512_load_si512(hi + R * 16), kHiShift)),          \
        sf, pairs, mf, d[sb * kTile + R], row_sums + (sb * kTile + R) * kSums);
    PAGEDLLM_EACH_ROW(PAGEDLLM_SUPER_STEPS)
#undef PAGEDLLM_SUPER_STEPS
  }
  if (sb_end < supers) {
#define PAGEDLLM_KEEP_ROW(R) \
  if constexpr (R < MR) _mm512_store_ps(partial + R * 16, acc##R);
    PAGEDLLM_EACH_ROW(PAGEDLLM_KEEP_ROW)
#undef PAGEDLLM_KEEP_ROW
    return;
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1);
  PAGEDLLM_EACH_ROW(PAGEDLLM_STORE_ROW)
}

template <int kHiShift, int G>
inline void amx_folded_chunk(const uint8_t* b, const TileData& tile, const AmxSuperRows& x,
                             int64_t c, int64_t sb_begin, int64_t sb_end, float* partial,
                             float* out, int64_t ldo, int64_t lanes, int64_t rows) {
  with_chunk_rows(rows, [&](auto mr) {
    amx_folded_tile_rows<decltype(mr)::value, kHiShift, G>(b, tile, x, c, sb_begin, sb_end,
                                                           partial, out, ldo, lanes, rows);
  });
}

// Super blocks of K per slice of the folded kernel (below), for M rows of x over K values
// into a gated or plain weight: in slices of 2 (8 KiB of B tiles a super block and weight
// tile, twice that gated) a slice's B tiles stay in L1 while every chunk of x passes them,
// so only the A tiles come from L2; over the whole of K (64 KiB of B tiles per weight tile
// at K = 2,048) both came from L2. Once x's int8 rows (M x K bytes) outgrow about half of
// L2, K whole is as fast or faster for a plain weight (its A tiles then come from L3 in
// long runs rather than a slice's short ones). Measured on the Xeon with AMX, one process
// alternating both orders (BENCHMARKS.md): 5-15% from 64 to 512 rows at K = 2,048-4,096.
int64_t folded_slice_supers(int64_t m, int64_t k, bool gated) {
  constexpr int64_t kSliceSupers = 2, kSliceMaxRowBytes = int64_t{1} << 20;
  return gated || m * k <= kSliceMaxRowBytes ? kSliceSupers : k / kSuper;
}

// x W^T [M, N] into out (rows ldo floats apart). With `gated` (a gate_up weight: gate rows
// 0..N/2-1, up rows N/2..N-1, N % 32 == 0), out [M, N/2] = act(x W_gate^T) * (x W_up^T)
// instead: a thread takes gate tile t with up tile t + T/2, as gated_tiled_matmul's VNNI
// path does, and their 16 x 16 outputs go through gated_rows. Not writing gate_up's
// [M, N] to memory also means no such buffer per call: allocated per layer of every prompt
// step (27 MiB a layer for a 512-token step of Gemma-3-1B), it fragmented the heap by
// ~100 MiB more resident than the live data.
template <Format F, int G, typename S>
void amx_matmul(const QuantizedRows& qx, int64_t m, const Tensor& tiles, const Tensor& scales,
                const Tensor& mins, int64_t n, float* out, int64_t ldo, bool gated = false,
                bool gelu = false) {
  const int64_t k = qx.k, num_tiles = tiles.size(0), groups = k / G;
  const int64_t tile_bytes = tiles.numel() / num_tiles;
  const uint8_t* tp = tiles.data_ptr<uint8_t>();
  const char* sp = static_cast<const char*>(scales.data_ptr());
  const char* mp = mins.numel() > 0 ? static_cast<const char*>(mins.data_ptr()) : nullptr;
  const int64_t value_bytes = tile_values_bytes<S>(groups, k);
  const int64_t up_offset = gated ? num_tiles / 2 : 0;  // gate tile t's up tile: t + this
  const int64_t work_tiles = gated ? num_tiles / 2 : num_tiles;
  const int64_t tiles_per_item = gated ? 2 : 1;
  const int64_t chunks = (m + kTile - 1) / kTile;
  auto tile_data = [&](int64_t t) {
    return TileData{tp + t * tile_bytes, sp + t * value_bytes,
                    mp != nullptr ? mp + t * value_bytes : nullptr};
  };
  // 64-byte aligned scratch of at least `bytes` in a thread's own vector.
  auto aligned = [](std::vector<uint8_t>& storage, int64_t bytes) {
    if (static_cast<int64_t>(storage.size()) < bytes + 64) storage.resize(bytes + 64);
    return reinterpret_cast<uint8_t*>(
        (reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~static_cast<uintptr_t>(63));
  };

  if constexpr (kFolded<F, S>) {
    // Per weight tile (and its up tile): its folded B tiles over all of K (two per 64
    // values), then K in slices, every chunk of x per slice, the accumulators of each
    // chunk kept in `partial` between slices; gated, the gate and up outputs meet there.
    constexpr int kHiShift = F == Format::kU4 ? 3 : 7;
    const AmxSuperRows xs = amx_super_rows<G>(qx, m);
    const int64_t supers = xs.supers, slice = folded_slice_supers(m, k, gated);
    const int64_t weight_bytes = k * kTile * 2, partial_floats = chunks * kTile * kTile;
    auto fold = [&](const TileData& tile, uint8_t* dst) {  // a weight tile's folded B tiles
      if constexpr (F == Format::kU4) folded_weight_groups(tile.bytes, tile.scales, k, dst);
      else folded_i6_weight_groups<G>(tile.bytes, tile.scales, k, dst);
    };
    parallel_for(0, work_tiles, 1, [&](int64_t begin, int64_t end) {
      amx::configure_thread_square();
      thread_local std::vector<uint8_t> b_storage, partial_storage;
      uint8_t* b = aligned(b_storage, tiles_per_item * weight_bytes);
      float* partial = reinterpret_cast<float*>(
          aligned(partial_storage, tiles_per_item * partial_floats * sizeof(float)));
      float* up_partial = partial + partial_floats;
      for (int64_t t = begin; t < end; ++t) {
        const TileData gate = tile_data(t), up = tile_data(t + up_offset);
        const int64_t lanes = std::min(kTile, n - t * kTile);
        fold(gate, b);
        if (gated) fold(up, b + weight_bytes);
        for (int64_t s0 = 0; s0 < supers; s0 += slice) {
          const int64_t s1 = std::min(supers, s0 + slice);
          for (int64_t c = 0; c < chunks; ++c) {
            const int64_t rows = std::min(kTile, m - c * kTile);
            float* p = partial + c * kTile * kTile;
            if (!gated) {
              amx_folded_chunk<kHiShift, G>(b, gate, xs, c, s0, s1, p,
                                            out + c * kTile * ldo + t * kTile, ldo, lanes, rows);
              continue;
            }
            // Gated: the last slice leaves the outputs in `partial` too (rows of 16).
            float* pu = up_partial + c * kTile * kTile;
            amx_folded_chunk<kHiShift, G>(b, gate, xs, c, s0, s1, p, p, kTile, kTile, rows);
            amx_folded_chunk<kHiShift, G>(b + weight_bytes, up, xs, c, s0, s1, pu, pu, kTile,
                                          kTile, rows);
          }
        }
        if (gated)
          for (int64_t c = 0; c < chunks; ++c)
            gated_rows(partial + c * kTile * kTile, up_partial + c * kTile * kTile, kTile,
                       out + c * kTile * ldo + t * kTile, ldo, std::min(kTile, m - c * kTile),
                       kTile, gelu);
      }
      amx::release_thread();
    });
    return;
  }

  const AmxRows x = amx_rows<G>(qx, m);
  parallel_for(0, work_tiles, 1, [&](int64_t begin, int64_t end) {
    amx::configure_thread(G);
    // B tiles of kTileBlock weight tiles (and as many up tiles) at a time (K * 16 bytes
    // each), 64-byte aligned: they stay in cache while every chunk of x passes them, and a
    // chunk's A tiles stay in cache across the block.
    thread_local std::vector<uint8_t> storage;
    const int64_t weight_bytes = k * kTile, block_bytes = kTileBlock * weight_bytes;
    uint8_t* wgroups = aligned(storage, tiles_per_item * block_bytes);
    uint8_t* up_groups = wgroups + block_bytes;
    alignas(64) float gate_out[kTile * kTile], up_out[kTile * kTile];
    for (int64_t t0 = begin; t0 < end; t0 += kTileBlock) {
      const int64_t t1 = std::min(end, t0 + kTileBlock);
      for (int64_t t = t0; t < t1; ++t) {
        weight_groups<F>(tp + t * tile_bytes, k, wgroups + (t - t0) * weight_bytes);
        if (gated)
          weight_groups<F>(tp + (t + up_offset) * tile_bytes, k,
                           up_groups + (t - t0) * weight_bytes);
      }
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t rows = std::min(kTile, m - c * kTile);
        for (int64_t t = t0; t < t1; ++t) {
          const uint8_t* b = wgroups + (t - t0) * weight_bytes;
          float* o = out + c * kTile * ldo + t * kTile;
          if (!gated) {
            amx_chunk<G, S>(b, tile_data(t), x, c, o, ldo, std::min(kTile, n - t * kTile), rows);
            continue;
          }
          amx_chunk<G, S>(b, tile_data(t), x, c, gate_out, kTile, kTile, rows);
          amx_chunk<G, S>(up_groups + (t - t0) * weight_bytes, tile_data(t + up_offset), x, c,
                          up_out, kTile, kTile, rows);
          gated_rows(gate_out, up_out, kTile, o, ldo, rows, kTile, gelu);
        }
      }
    }
    amx::release_thread();
  });
}
#endif

// An i6 tile of K values -> the i8 tile of the same q (K * 16 bytes of q + 128).
inline void unpack_i6_tile(const uint8_t* src, int64_t k, uint8_t* dst) {
#ifdef PAGEDLLM_AVX512
  const __m512i to_i8 = _mm512_set1_epi8(96);  // u + 96 = q + 128
  for (int64_t quad = 0; quad < k / 16; ++quad) {
    __m512i u[4];
    unpack_i6_quad(src + quad * kI6QuadBytes, u);
    for (int i = 0; i < 4; ++i)
      _mm512_storeu_si512(dst + (4 * quad + i) * 64, _mm512_add_epi8(u[i], to_i8));
  }
#elif defined(PAGEDLLM_AVX2)
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));  // q xor 128 = q + 128
  for (int64_t quad = 0; quad < k / 16; ++quad) {
    for (int half = 0; half < 2; ++half) {
      __m256i q[4];
      unpack_i6_quad_half(src + quad * kI6QuadBytes, half, q);
      for (int i = 0; i < 4; ++i)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (4 * quad + i) * 64 + 32 * half),
                            _mm256_xor_si256(q[i], flip));
    }
  }
#else
  for (int64_t kk = 0; kk < k; ++kk)
    for (int64_t lane = 0; lane < kTile; ++lane)
      dst[(kk / 4) * 64 + lane * 4 + kk % 4] =
          static_cast<uint8_t>(tile_value<Format::kI6>(src, kk, lane) + 128);
#endif
}

// Rows c0 .. c1 (at most kRowChunk) of x against one tile: out[r - c0] for each row,
// rows out_stride apart; `ahead` (the tile this thread takes next, or null) is
// prefetched by the first pass.
template <Format F, int G, typename S, bool Fold = kFolded<F, S>>
inline void tile_row_chunk(const TileData& tile, const QuantizedRows& x, int64_t c0, int64_t c1,
                           float* out, int64_t out_stride, int64_t lanes, const TileData* ahead) {
  if constexpr (F == Format::kI6) {
    if (c1 - c0 > kLastPassRows) {
      // Several passes over the tile: unpack it once into i8 form (in L1/L2) rather than
      // in every pass, and run the i8 code on it: the same integer sums, so the same bits.
      // (At 16 rows, unpacking in each of the 4 passes took twice as long as i8 tiles.)
      thread_local std::vector<uint8_t> unpacked;
      const size_t bytes = static_cast<size_t>(x.k * kTile);
      if (unpacked.size() < bytes) unpacked.resize(bytes);
      unpack_i6_tile(tile.bytes, x.k, unpacked.data());
      const TileData as_i8{unpacked.data(), tile.scales, tile.mins};
      // `ahead` is read in i8 strides: it covers the next i6 tile and more (harmless).
      tile_row_chunk<Format::kI8, G, S, Fold>(as_i8, x, c0, c1, out, out_stride, lanes, ahead);
      return;
    }
  }
  int64_t r = c0;
  for (; c1 - r > kLastPassRows; r += kPassRows)
    tile_rows<F, G, kPassRows, S, Fold>(tile, x, r, out + (r - c0) * out_stride, out_stride, lanes,
                                  r == c0 ? ahead : nullptr);
  if (r == c1) return;
  // The last pass takes the remaining rows at once (1..kLastPassRows).
  const TileData* last_ahead = r == c0 ? ahead : nullptr;
  float* o = out + (r - c0) * out_stride;
  switch (c1 - r) {
#define PAGEDLLM_LAST_PASS(MR) \
  case MR: tile_rows<F, G, MR, S, Fold>(tile, x, r, o, out_stride, lanes, last_ahead); break;
    PAGEDLLM_LAST_PASS(7) PAGEDLLM_LAST_PASS(6) PAGEDLLM_LAST_PASS(5)
    PAGEDLLM_LAST_PASS(4) PAGEDLLM_LAST_PASS(3) PAGEDLLM_LAST_PASS(2)
    PAGEDLLM_LAST_PASS(1)
#undef PAGEDLLM_LAST_PASS
    default: break;
  }
}

// A tiled weight's pointers: tile t (TileData) of T.
template <typename S>
struct TilePointers {
  const uint8_t* bytes;
  const char* scales;
  const char* mins;  // null: no mins
  int64_t tile_bytes, value_bytes;

  TilePointers(const Tensor& tiles, const Tensor& scales_t, const Tensor& mins_t, int64_t k,
               int64_t group)
      : bytes(tiles.data_ptr<uint8_t>()),
        scales(static_cast<const char*>(scales_t.data_ptr())),
        mins(mins_t.numel() > 0 ? static_cast<const char*>(mins_t.data_ptr()) : nullptr),
        tile_bytes(tiles.numel() / tiles.size(0)),
        value_bytes(tile_values_bytes<S>(k / group, k)) {}

  TileData tile(int64_t t) const {
    return {bytes + t * tile_bytes, scales + t * value_bytes,
            mins != nullptr ? mins + t * value_bytes : nullptr};
  }
};

// x W^T [M, N] into out, whose rows are ldo floats apart (ldo >= N: a linear's columns
// beside other weights' in a wider output).
template <Format F, int G, typename S>
void tiled_matmul(const QuantizedRows& x, int64_t m, const Tensor& tiles, const Tensor& scales,
                  const Tensor& mins, int64_t n, float* out, int64_t ldo) {
#ifdef PAGEDLLM_AMX
  if (m >= amx_min_rows<F, S>() && amx::enabled()) {
    amx_matmul<F, G, S>(x, m, tiles, scales, mins, n, out, ldo);
    return;
  }
#endif
  const TilePointers<S> w(tiles, scales, mins, x.k, G);
  parallel_for(0, tiles.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t c0 = 0; c0 < m; c0 += kRowChunk) {
      const int64_t c1 = std::min(m, c0 + kRowChunk);
      for (int64_t t = begin; t < end; ++t) {
        const TileData next = w.tile(t + 1);  // prefetched by the first pass over tile t
        tile_row_chunk<F, G, S>(w.tile(t), x, c0, c1, out + c0 * ldo + t * kTile, ldo,
                                std::min(kTile, n - t * kTile), t + 1 < end ? &next : nullptr);
      }
    }
  });
}

// The gate_up linear and the gated activation at once: out [M, N/2] = act(x W_gate^T) *
// (x W_up^T), W's gate rows 0..N/2-1 and up rows N/2..N-1 (N % 32 == 0: each half whole
// tiles). Each thread takes gate tile t with up tile t + T/2, computes a row chunk of
// both into buffers in L1 and writes the activation: gate_up's [M, N] output never goes
// to memory and back (for a 512-token prompt step of SmolLM2, 6 MB per layer written,
// then read by gated_act). The same bits as gated_act(tiled_matmul(..)).
template <Format F, int G, typename S>
void gated_tiled_matmul(const QuantizedRows& x, int64_t m, const Tensor& tiles,
                        const Tensor& scales, const Tensor& mins, int64_t n, bool gelu,
                        float* out) {
  const int64_t half = n / 2, half_tiles = half / kTile;
#ifdef PAGEDLLM_AMX
  if (m >= amx_min_rows<F, S>() && amx::enabled()) {
    amx_matmul<F, G, S>(x, m, tiles, scales, mins, n, out, half, /*gated=*/true, gelu);
    return;
  }
#endif
  const TilePointers<S> w(tiles, scales, mins, x.k, G);
  parallel_for(0, half_tiles, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float gate[kRowChunk * kTile], up[kRowChunk * kTile];
    for (int64_t c0 = 0; c0 < m; c0 += kRowChunk) {
      const int64_t c1 = std::min(m, c0 + kRowChunk);
      for (int64_t t = begin; t < end; ++t) {
        const TileData up_tile = w.tile(t + half_tiles), next = w.tile(t + 1);
        tile_row_chunk<F, G, S>(w.tile(t), x, c0, c1, gate, kTile, kTile, &up_tile);
        tile_row_chunk<F, G, S>(up_tile, x, c0, c1, up, kTile, kTile,
                                t + 1 < end ? &next : nullptr);
        gated_rows(gate, up, kTile, out + c0 * half + t * kTile, half, c1 - c0, kTile, gelu);
      }
    }
  });
}

void check_tiles(const Tensor& tiles, const Tensor& scales, const Tensor& mins, int64_t n,
                 int64_t k, int64_t group, Format format) {
  check_cpu_contiguous(tiles, "tiles");
  check_cpu_contiguous(scales, "scales");
  TORCH_CHECK(tiles.scalar_type() == at::kByte, "tiles must be uint8");
  TORCH_CHECK(k % 32 == 0, "K must be a multiple of 32, got ", k);
  TORCH_CHECK(group == 16 || group == 32, "groups must be 16 or 32 values, got ", group);
  TORCH_CHECK(format != Format::kU4 || group == 32, "u4 groups are 32 values");
  const int64_t num_tiles = (n + kTile - 1) / kTile;
  const int64_t tile_bytes = format == Format::kU4   ? k * kTile / 2
                             : format == Format::kI8 ? k * kTile
                                                     : k / 16 * kI6QuadBytes;
  TORCH_CHECK(tiles.dim() > 0 && tiles.size(0) == num_tiles &&
                  tiles.numel() == num_tiles * tile_bytes,
              "tiles do not hold [", n, ", ", k, "]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf ||
                  scales.scalar_type() == at::kByte,
              "scales must be float32, float16 or uint8 (K-quant multipliers and factors)");
  if (scales.scalar_type() == at::kByte) {
    TORCH_CHECK(k % 256 == 0, "K-quant scales need K a multiple of 256, got ", k);
    TORCH_CHECK(scales.numel() == num_tiles * tile_values_bytes<KScale>(k / group, k),
                "K-quant scales must be [T, K/G * 16 + K/256 * 64] bytes");
  } else {
    TORCH_CHECK(scales.numel() == num_tiles * (k / group) * kTile, "scales must be [T, K/G, 16]");
  }
  TORCH_CHECK(mins.numel() == 0 || (mins.is_contiguous() && mins.sizes() == scales.sizes() &&
                                    mins.scalar_type() == scales.scalar_type()),
              "mins must be empty or shaped and typed like scales");
  TORCH_CHECK(format != Format::kU4 || mins.numel() > 0, "u4 weights need mins");
}

// kFolded at run time: whether a weight of this format and these scales takes the folded
// recipe (its calls quantize x in super blocks too).
inline bool takes_folded_recipe(Format format, const Tensor& scales) {
  return format != Format::kI8 && scales.scalar_type() == at::kByte;
}

// fn(format, group, scale) with each as a compile-time value, for the kernels'
// templates: a tag of the format (::value), of the group (::value), and a value of the
// scales' stored form (float, at::Half or KScale).
template <typename Fn>
void with_tile_format(Format format, int64_t group, const Tensor& scales, const Fn& fn) {
  using U4 = std::integral_constant<Format, Format::kU4>;
  using I8 = std::integral_constant<Format, Format::kI8>;
  using I6 = std::integral_constant<Format, Format::kI6>;
  using G32 = std::integral_constant<int, 32>;
  using G16 = std::integral_constant<int, 16>;
  auto with_scales = [&](auto f, auto g) {
    switch (scales.scalar_type()) {
      case at::kHalf: fn(f, g, at::Half{}); break;
      case at::kByte: fn(f, g, KScale{}); break;
      default: fn(f, g, float{}); break;
    }
  };
  if (format == Format::kU4) with_scales(U4{}, G32{});
  else if (format == Format::kI8 && group == 32) with_scales(I8{}, G32{});
  else if (format == Format::kI8) with_scales(I8{}, G16{});
  else if (group == 32) with_scales(I6{}, G32{});
  else with_scales(I6{}, G16{});
}

// What follows the linear: nothing, or the gated activation of a gate_up weight (gate
// rows, then up rows), fused (gated_tiled_matmul).
enum class Epilogue { kNone, kSilu, kGelu };

// x [M, K] float32 -> y [M, N] float32; with a gated epilogue, act [M, N/2]
Tensor packed_linear_impl(const Tensor& x_in, const Tensor& tiles, const Tensor& scales,
                          const Tensor& mins, int64_t group, int64_t n, Format format,
                          Tensor* out_buffer = nullptr, Epilogue epilogue = Epilogue::kNone) {
  TORCH_CHECK(x_in.dim() == 2, "x must be [M, K]");
  const bool gated = epilogue != Epilogue::kNone;
  TORCH_CHECK(!gated || n % (2 * kTile) == 0, "a fused gate_up needs N a multiple of ",
              2 * kTile, " (whole tiles per half), got ", n);
  Tensor x = x_in.scalar_type() == at::kFloat ? x_in.contiguous() : x_in.to(at::kFloat).contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  check_tiles(tiles, scales, mins, n, k, group, format);
  Tensor out = float_output(out_buffer, m, gated ? n / 2 : n, x.options());
  if (m == 0) return out;
  const bool folded = takes_folded_recipe(format, scales);
  const QuantizedRows qx = quantize_activations(x, folded, /*groups=*/!folded);
  float* op = out.data_ptr<float>();
  with_tile_format(format, group, scales, [&](auto f, auto g, auto s) {
    constexpr Format F = decltype(f)::value;
    constexpr int G = decltype(g)::value;
    using S = decltype(s);
    if (gated)
      gated_tiled_matmul<F, G, S>(qx, m, tiles, scales, mins, n, epilogue == Epilogue::kGelu, op);
    else
      tiled_matmul<F, G, S>(qx, m, tiles, scales, mins, n, op, n);
  });
  return out;
}

// x [M, K] float32 -> act [M, N/2] float32: gated_act(x W^T), fused
Tensor gated_tiled_linear(const Tensor& x, const Tensor& tiles, const Tensor& scales,
                          const Tensor& mins, int64_t group, int64_t n, bool format_u4,
                          bool gelu, Tensor* out = nullptr) {
  return packed_linear_impl(x, tiles, scales, mins, group, n, tile_format(format_u4, tiles), out,
                            gelu ? Epilogue::kGelu : Epilogue::kSilu);
}

Tensor u4_tiled_linear(const Tensor& x, const Tensor& tiles, const Tensor& scales,
                       const Tensor& mins, int64_t n, Tensor* out = nullptr) {
  return packed_linear_impl(x, tiles, scales, mins, 32, n, Format::kU4, out);
}

Tensor i8_tiled_linear(const Tensor& x, const Tensor& tiles, const Tensor& scales,
                       const Tensor& mins, int64_t group, int64_t n, Tensor* out = nullptr) {
  return packed_linear_impl(x, tiles, scales, mins, group, n, signed_format(tiles), out);
}

// ------------------------------------------------------------------ repacking
// u4 qweight uint8 [N, K/2] in GGUF's nibble order (byte j of a group holds q[j] | q[j+16]
// << 4) -> tiles uint8 [T, K/32, 4, 64].
Tensor tile_u4(const Tensor& qweight) {
  check_cpu_contiguous(qweight, "qweight");
  TORCH_CHECK(qweight.scalar_type() == at::kByte, "u4 qweight must be uint8 [N, K/2]");
  const int64_t n = qweight.size(0), half = qweight.size(1), k = half * 2, groups = k / 32;
  const int64_t num_tiles = (n + kTile - 1) / kTile;
  Tensor out = at::zeros({num_tiles, groups, 4, 64}, qweight.options());
  const uint8_t* src = qweight.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t t = row / kTile, r = row % kTile;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* block = src + row * half + g * 16;  // q[i] = i < 16 ? lo(i) : hi(i-16)
        auto q = [&](int64_t i) -> uint8_t { return i < 16 ? block[i] & 0x0F : block[i - 16] >> 4; };
        for (int p = 0; p < 4; ++p)
          for (int j = 0; j < 4; ++j)
            dst[((t * groups + g) * 4 + p) * 64 + r * 4 + j] =
                static_cast<uint8_t>(q(4 * p + j) | (q(4 * (p + 4) + j) << 4));
      }
    }
  });
  return out;
}

// i8 qweight int8 [N, K] -> tiles uint8 [T, K/4, 64] holding q + 128.
Tensor tile_i8(const Tensor& qweight) {
  check_cpu_contiguous(qweight, "qweight");
  TORCH_CHECK(qweight.scalar_type() == at::kChar, "i8 qweight must be int8 [N, K]");
  const int64_t n = qweight.size(0), k = qweight.size(1), num_tiles = (n + kTile - 1) / kTile;
  // Padding rows hold q = 0, i.e. the byte 128.
  Tensor out = at::full({num_tiles, k / 4, 64}, 128, qweight.options().dtype(at::kByte));
  const int8_t* src = qweight.data_ptr<int8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t t = row / kTile, r = row % kTile;
      for (int64_t kk = 0; kk < k; ++kk)
        dst[(t * (k / 4) + kk / 4) * 64 + r * 4 + kk % 4] =
            static_cast<uint8_t>(static_cast<int32_t>(src[row * k + kk]) + 128);
    }
  });
  return out;
}

// i8 qweight int8 [N, K], every q in -32..31 -> i6 tiles uint8 [T, K/16, 192] (the layout
// at the top of this file).
Tensor tile_i6(const Tensor& qweight) {
  check_cpu_contiguous(qweight, "qweight");
  TORCH_CHECK(qweight.scalar_type() == at::kChar, "i6 qweight must be int8 [N, K]");
  const int64_t n = qweight.size(0), k = qweight.size(1), num_tiles = (n + kTile - 1) / kTile;
  TORCH_CHECK(k % 16 == 0, "i6 tiles need K a multiple of 16, got ", k);
  if (qweight.numel() > 0) {
    const auto [low, high] = at::aminmax(qweight);
    TORCH_CHECK(low.item<int8_t>() >= -32 && high.item<int8_t>() <= 31,
                "i6 tiles hold q in -32..31; this weight has ", int(low.item<int8_t>()), "..",
                int(high.item<int8_t>()));
  }
  Tensor out = at::zeros({num_tiles, k / 16, kI6QuadBytes}, qweight.options().dtype(at::kByte));
  const int8_t* src = qweight.data_ptr<int8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  // Whole tiles per thread (a byte holds values of one row only, but the top-bit bytes
  // are or-ed into); padding rows hold q = 0, u = 32.
  parallel_for(0, num_tiles, 4, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin * kTile; row < end * kTile; ++row) {
      const int64_t t = row / kTile, r = row % kTile;
      for (int64_t kk = 0; kk < k; ++kk) {
        const int32_t q = row < n ? src[row * k + kk] : 0;
        const uint32_t u = static_cast<uint32_t>(q + 32);
        uint8_t* quad = dst + (t * (k / 16) + kk / 16) * kI6QuadBytes;
        const int64_t p = (kk % 16) / 4, at = r * 4 + kk % 4;
        quad[(p / 2) * 64 + at] |= static_cast<uint8_t>((u & 0x0F) << (4 * (p % 2)));
        quad[128 + at] |= static_cast<uint8_t>((u >> 4) << (2 * p));
      }
    }
  });
  return out;
}

// The weight's values w[n, k] = fma(q, s, mn) in float32, for rows `ids` (an embedding
// lookup) -> [len(ids), K]; ids must lie in 0..N-1.
template <Format F, int G, typename S>
void lookup_rows(const int64_t* ids, int64_t count, const Tensor& tiles, const Tensor& scales,
                 const Tensor& mins, int64_t n, int64_t k, float* out) {
  const TilePointers<S> w(tiles, scales, mins, k, G);
  const int64_t groups = k / G;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t row = ids[i];
    TORCH_CHECK(row >= 0 && row < n, "token id ", row, " is outside the table of ", n);
    const int64_t r = row % kTile;
    const TileData tile = w.tile(row / kTile);
    for (int64_t kk = 0; kk < k; ++kk) {
      const int32_t q = tile_value<F>(tile.bytes, kk, r);
      const float s = group_value<S, G>(tile.scales, groups, kk / G, r);
      const float mn = tile.mins != nullptr ? group_value<S, G>(tile.mins, groups, kk / G, r) : 0.f;
      out[i * k + kk] = std::fma(static_cast<float>(q), s, mn);
    }
  }
}

// ids [*] -> float32 [*, K]: rows of a tiled weight (the embedding of a tied LM head).
Tensor tiled_rows(const Tensor& ids_in, const Tensor& tiles, const Tensor& scales,
                  const Tensor& mins, int64_t group, int64_t n, int64_t k, bool is_u4) {
  const Format format = tile_format(is_u4, tiles);
  check_tiles(tiles, scales, mins, n, k, group, format);
  Tensor ids = ids_in.to(at::kLong).contiguous();
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(k);
  Tensor out = at::empty(shape, tiles.options().dtype(at::kFloat));
  const int64_t* idp = ids.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  with_tile_format(format, group, scales, [&](auto f, auto g, auto s) {
    lookup_rows<decltype(f)::value, decltype(g)::value, decltype(s)>(idp, ids.numel(), tiles,
                                                                    scales, mins, n, k, op);
  });
  return out;
}

// x [M, K] float32 -> (qx int8 [M, K], d float32 [M, K/32], xs int32 [M, K/16]): the
// activation quantization every packed linear applies (for tests).
std::tuple<Tensor, Tensor, Tensor> quantize_activations_op(const Tensor& x_in) {
  Tensor x = x_in.to(at::kFloat).contiguous();
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 32 == 0, "x must be [M, K], K a multiple of 32");
  const int64_t m = x.size(0), k = x.size(1);
  const QuantizedRows q = quantize_activations(x);
  Tensor qx = at::empty({m, k}, x.options().dtype(at::kChar));
  Tensor d = at::empty({m, k / kBlock}, x.options());
  Tensor xs = at::empty({m, k / kHalf}, x.options().dtype(at::kInt));
  std::memcpy(qx.data_ptr<int8_t>(), q.q, m * k);
  std::memcpy(d.data_ptr<float>(), q.d, m * (k / kBlock) * sizeof(float));
  std::memcpy(xs.data_ptr<int32_t>(), q.xs, m * (k / kHalf) * sizeof(int32_t));
  return {qx, d, xs};
}

// x [M, K] float32 (K % 256 == 0) -> (qk int8 [M, K], dk float32 [M, K/256], sk int16
// [M, K/16]): the folded recipe's activations (for tests).
std::tuple<Tensor, Tensor, Tensor> quantize_super_blocks_op(const Tensor& x_in) {
  Tensor x = x_in.to(at::kFloat).contiguous();
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kSuper == 0, "x must be [M, K], K a multiple of 256");
  const int64_t m = x.size(0), k = x.size(1);
  const QuantizedRows q = quantize_activations(x, /*super_blocks=*/true, /*groups=*/false);
  Tensor qk = at::empty({m, k}, x.options().dtype(at::kChar));
  Tensor dk = at::empty({m, k / kSuper}, x.options());
  Tensor sk = at::empty({m, k / kHalf}, x.options().dtype(at::kShort));
  std::memcpy(qk.data_ptr<int8_t>(), q.qk, m * k);
  std::memcpy(dk.data_ptr<float>(), q.dk, m * (k / kSuper) * sizeof(float));
  std::memcpy(sk.data_ptr<int16_t>(), q.sk, m * (k / kHalf) * sizeof(int16_t));
  return {qk, dk, sk};
}

// x [M, K] float32 -> each part's x W^T into its columns of out [M, ldo]: the rows are
// quantized once for every part (a quantized row is the same whichever weight it meets,
// so each part's columns are the bits its own linear would give).
void tiled_linear_parts(const Tensor& x_in, const std::vector<api::TiledPart>& parts,
                        float* out, int64_t ldo) {
  TORCH_CHECK(x_in.dim() == 2, "x must be [M, K]");
  Tensor x = x_in.scalar_type() == at::kFloat ? x_in.contiguous() : x_in.to(at::kFloat).contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  for (const api::TiledPart& p : parts) {
    check_tiles(*p.tiles, *p.scales, *p.mins, p.rows, k, p.group, tile_format(p.u4, *p.tiles));
    TORCH_CHECK(p.col >= 0 && p.col + p.rows <= ldo, "a part's columns lie outside the output");
  }
  if (m == 0 || parts.empty()) return;
  bool super_blocks = false, groups = false;
  for (const api::TiledPart& p : parts) {
    const bool folded = takes_folded_recipe(tile_format(p.u4, *p.tiles), *p.scales);
    super_blocks = super_blocks || folded;
    groups = groups || !folded;
  }
  const QuantizedRows qx = quantize_activations(x, super_blocks, groups);
  for (const api::TiledPart& p : parts) {
    with_tile_format(tile_format(p.u4, *p.tiles), p.group, *p.scales,
                     [&](auto f, auto g, auto s) {
                       constexpr Format F = decltype(f)::value;
                       constexpr int G = decltype(g)::value;
                       tiled_matmul<F, G, decltype(s)>(qx, m, *p.tiles, *p.scales, *p.mins,
                                                       p.rows, out + p.col, ldo);
                     });
  }
}

}  // namespace

namespace api {
void tiled_linear_parts(const Tensor& x, const std::vector<TiledPart>& parts, float* out,
                        int64_t ldo) {
  pagedllm::tiled_linear_parts(x, parts, out, ldo);
}
void check_tiled(const Tensor& tiles, const Tensor& scales, const Tensor& mins, int64_t n,
                 int64_t k, int64_t group, bool u4) {
  check_tiles(tiles, scales, mins, n, k, group, tile_format(u4, tiles));
}
Tensor u4_tiled_linear(const Tensor& x, const Tensor& tiles, const Tensor& scales,
                       const Tensor& mins, int64_t n, Tensor* out) {
  return pagedllm::u4_tiled_linear(x, tiles, scales, mins, n, out);
}
Tensor i8_tiled_linear(const Tensor& x, const Tensor& tiles, const Tensor& scales,
                       const Tensor& mins, int64_t group, int64_t n, Tensor* out) {
  return pagedllm::i8_tiled_linear(x, tiles, scales, mins, group, n, out);
}
Tensor gated_tiled_linear(const Tensor& x, const Tensor& tiles, const Tensor& scales,
                          const Tensor& mins, int64_t group, int64_t n, bool format_u4,
                          bool gelu, Tensor* out) {
  return pagedllm::gated_tiled_linear(x, tiles, scales, mins, group, n, format_u4, gelu, out);
}
}  // namespace api
}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("u4_tiled_linear(Tensor x, Tensor tiles, Tensor scales, Tensor mins, int n) -> Tensor",
        [](const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales,
           const at::Tensor& mins, int64_t n) {
          return pagedllm::u4_tiled_linear(x, tiles, scales, mins, n);
        });
  m.def("i8_tiled_linear(Tensor x, Tensor tiles, Tensor scales, Tensor mins, int group, int n)"
        " -> Tensor",
        [](const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales,
           const at::Tensor& mins, int64_t group, int64_t n) {
          return pagedllm::i8_tiled_linear(x, tiles, scales, mins, group, n);
        });
  // The same into a given float32 [M, n] (the LM head's logits into the step workspace).
  m.def("u4_tiled_linear_out(Tensor x, Tensor tiles, Tensor scales, Tensor mins, int n, "
        "Tensor(a!) out) -> ()",
        [](const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales,
           const at::Tensor& mins, int64_t n, at::Tensor out) {
          pagedllm::u4_tiled_linear(x, tiles, scales, mins, n, &out);
        });
  m.def("i8_tiled_linear_out(Tensor x, Tensor tiles, Tensor scales, Tensor mins, int group, "
        "int n, Tensor(a!) out) -> ()",
        [](const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales,
           const at::Tensor& mins, int64_t group, int64_t n, at::Tensor out) {
          pagedllm::i8_tiled_linear(x, tiles, scales, mins, group, n, &out);
        });
  // gated_act(x W^T) for a gate_up weight (gate rows, then up rows), fused.
  m.def("gated_tiled_linear(Tensor x, Tensor tiles, Tensor scales, Tensor mins, int group, "
        "int n, bool is_u4, bool gelu) -> Tensor",
        [](const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales,
           const at::Tensor& mins, int64_t group, int64_t n, bool is_u4, bool gelu) {
          return pagedllm::gated_tiled_linear(x, tiles, scales, mins, group, n, is_u4, gelu);
        });
  m.def("tile_u4(Tensor qweight) -> Tensor", &pagedllm::tile_u4);
  m.def("tile_i8(Tensor qweight) -> Tensor", &pagedllm::tile_i8);
  m.def("tile_i6(Tensor qweight) -> Tensor", &pagedllm::tile_i6);
  m.def("tiled_rows(Tensor ids, Tensor tiles, Tensor scales, Tensor mins, int group, int n, "
        "int k, bool is_u4) -> Tensor", &pagedllm::tiled_rows);
  m.def("quantize_activations(Tensor x) -> (Tensor, Tensor, Tensor)",
        &pagedllm::quantize_activations_op);
  m.def("quantize_super_blocks(Tensor x) -> (Tensor, Tensor, Tensor)",
        &pagedllm::quantize_super_blocks_op);
  // Whether the packed linears use AMX int8 tiles for batches (same bits either way).
  m.def("amx_enabled() -> bool", []() { return pagedllm::amx::enabled(); });
  m.def("set_amx_enabled(bool enabled) -> bool",
        [](bool enabled) { return pagedllm::amx::set_enabled(enabled); });
}

// Paged attention of the CPU fast path: every query row, prefill or decode, reads its keys
// and values in place from the paged KV cache.
//
//   q            [T, Hq, D] float32     rows of the flat batch (rows may be strided)
//   k_cache      [num_blocks, Hkv, D, block_size] float32 or bfloat16 (keys transposed)
//   v_cache      [num_blocks, Hkv, block_size, D]
//                The fast path's own layout (ops.cpp writes it): one KV head's keys of a
//                block are D vectors of block_size positions, so a chunk of keys loads
//                as whole vectors, already transposed for the scores.
//   out          [T, Hq, D] float32     written for the rows of the given sequences
//   seq_ids      [S] int64              the sequences of the step to attend
//   cu_seqlens_q [B + 1] int32, seq_lens [B] int32, block_tables [B, max_blocks] int32
//
// Query j of sequence b sits at position seq_lens[b] - query_len + j and sees keys
// first .. position, first = position - window + 1 with a sliding window, else 0.
//
// One recipe per query row, whatever else is computed beside it: keys are taken in chunks
// of kChunk positions aligned to absolute positions (0..63, 64..127, ...); per chunk the
// scores (q . k, summed over d), the chunk's max, the rescaling of the running sum and
// output (online softmax), then the values by position. Over a bf16 cache q and the
// probabilities are rounded to bf16 and both sums take their terms in pairs, odd term
// first, as vdpbf16ps does (the paired recipe, at round_to_bf16 below); over a float32
// cache they stay float32 and the terms come in order. A row's output is therefore bitwise
// the same whether it is decoded alone, verified beside speculative tokens, or computed
// inside a prompt chunk of any size, and whether its prefix came from the prefix cache or
// was just computed.
//
// Work items are (sequence, KV head, block of up to kQueryBlock query rows). An item of a
// few rows (decode, speculative verification) reads each chunk's keys and values in place
// from the cache, widening bf16 as it goes; a larger one (prefill) loads each chunk once
// into scratch (float32, keys transposed; or vdpbf16ps pairs, below) for all its rows. Either way every chunk serves
// all G = Hq / Hkv query heads of the KV head, and the arithmetic is the same. The G heads of one row see
// the same keys, so they are attended together, up to kGroup at a time: they share each
// key and value load and interleave their dependency chains, while every vector still runs
// exactly its own sequence of operations (the same bits as one at a time).
//
// Rows that read the cache in place take a KV head's chunk at a time (its keys, then its
// values: 2 KB each per block of 16 bf16 positions at head_dim 64). Those few-KB runs at
// block strides are too short for the hardware prefetchers: from DRAM, decode attention
// ran at a third of its speed over the same bytes in L3 (64 sequences x 192 keys, 30
// layers, 2 threads, Zen 4: 13.9 against 4.3 ms). So while a head's chunk computes, its
// kernels ask L2 for the next one's lines a few at a time (NextLines below): the next head
// of the chunk, else the next chunk, else the first chunk of the next item. Only where
// the bytes sit changes, never the arithmetic.
//
// The vector kernels are written once, over a small vector type (VecF below: 16 lanes on
// AVX-512, 8 on AVX2 with 16 registers): a group of 16 key positions or dimensions is one
// vector or a pair, every lane runs the same float32 operations in the same order, and
// cross-lane sums are reduce16's, so a row gets the same bits on either; only how many
// vectors are in registers at once differs (kTileGroups, kSliceGroups). On
// AVX512-BF16 CPUs every row over a bf16 cache adds each pair of terms with one vdpbf16ps,
// the same bits as the FMAs elsewhere: rows that read in place permute what they read
// into the instruction's pairs (attend_chunk_in_place_bf16), and larger items load each
// chunk into scratch as those pairs (load_chunk_pairs, attend_chunk_pairs) instead of
// widening it to float32. The decoder stack's step over a 2048-token prompt's last 512
// took 534 ms that way, against 748 ms through float32 scratch (SmolLM2, 2 threads, Zen 4).

#include "kernels.h"

#include <atomic>

#if defined(PAGEDLLM_AVX512) || defined(PAGEDLLM_AVX2)
#define PAGEDLLM_VECTOR_ATTENTION 1  // the kernels of 16-lane key groups below
#endif

namespace pagedllm {
namespace {

constexpr int64_t kChunk = 64;
constexpr int64_t kQueryBlock = 32;
constexpr int kGroup = 4;  // query vectors attended together (their scores stay in registers)
// The same where several rows read a chunk in place together (verification): with 32
// registers, 6 vectors' 24 score sums (or 6 x 4 value accumulators) still fit, and each
// bf16 key and value widened serves 6 FMAs instead of 4.
#ifdef PAGEDLLM_AVX512
constexpr int kInPlaceGroup = 6;
#else
constexpr int kInPlaceGroup = 4;
#endif
constexpr int64_t kInPlaceRows = 8;  // items of up to this many rows read the cache in place
constexpr int64_t kSequencesPerThread = 4;  // from this many per thread, items span all heads
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#ifdef PAGEDLLM_VECTOR_ATTENTION
// -------------------------------------------------------------------- the vector type
// The vector kernels below are written once, over VecF: one hardware vector of float32
// lanes (16 on AVX-512, 8 on AVX2) and the few operations the kernels need. The recipe is
// stated per group of 16 lanes (16 key positions of a chunk, or 16 dimensions of an
// output): on AVX-512 a group is one VecF, on AVX2 kParts = 2 of them (lanes 0..7 and
// 8..15). Every lane runs the same float32 operations in the same order on both, and what
// is summed across lanes (a chunk's total) is kept as 16 lanes and reduced by reduce16, so
// a row gets the same bits on either. Only this section differs per instruction set, and
// the two numbers of how much stays in registers at once (kTileGroups, kSliceGroups).
#ifdef PAGEDLLM_AVX512
struct VecF {
  __m512 v;
};
constexpr int kLanes = 16;
inline VecF vzero() { return {_mm512_setzero_ps()}; }
inline VecF vset1(float x) { return {_mm512_set1_ps(x)}; }
inline VecF vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void vstore(float* p, VecF a) { _mm512_storeu_ps(p, a.v); }
inline VecF vfmadd(VecF a, VecF b, VecF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline VecF vmul(VecF a, VecF b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline VecF vadd(VecF a, VecF b) { return {_mm512_add_ps(a.v, b.v)}; }
inline VecF vsub(VecF a, VecF b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline VecF vdiv(VecF a, VecF b) { return {_mm512_div_ps(a.v, b.v)}; }
inline VecF vmax(VecF a, VecF b) { return {_mm512_max_ps(a.v, b.v)}; }
inline VecF vexp(VecF a) { return {exp512(a.v)}; }
inline VecF vtanh(VecF a) { return {tanh512(a.v)}; }
inline float vfirst(VecF a) { return _mm512_cvtss_f32(a.v); }
inline float vreduce_max(VecF a) { return _mm512_reduce_max_ps(a.v); }
// Lanes of `a` (chunk lanes first_lane ..) outside [lo, hi) set to -inf.
inline VecF vmask_outside(VecF a, int64_t first_lane, int64_t lo, int64_t hi) {
  const __m512i lane = _mm512_add_epi32(
      _mm512_set1_epi32(static_cast<int>(first_lane)),
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  const __mmask16 visible =
      _mm512_cmpge_epi32_mask(lane, _mm512_set1_epi32(static_cast<int>(lo))) &
      _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(static_cast<int>(hi)));
  return {_mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), visible, a.v)};
}
// Rounded to bf16 (to nearest, ties to even), held in float32.
inline VecF vround_to_bf16(VecF a) {
  const __m512i bits = _mm512_castps_si512(a.v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return {_mm512_castsi512_ps(
      _mm512_and_si512(up, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}
// kLanes cache values from p in float32 (bf16 widens exactly: a 16-bit shift).
inline VecF vload_cache(const float* p) { return vload(p); }
inline VecF vload_cache(const bf16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
}
#else  // PAGEDLLM_AVX2
struct VecF {
  __m256 v;
};
constexpr int kLanes = 8;
inline VecF vzero() { return {_mm256_setzero_ps()}; }
inline VecF vset1(float x) { return {_mm256_set1_ps(x)}; }
inline VecF vload(const float* p) { return {_mm256_loadu_ps(p)}; }
inline void vstore(float* p, VecF a) { _mm256_storeu_ps(p, a.v); }
inline VecF vfmadd(VecF a, VecF b, VecF c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline VecF vmul(VecF a, VecF b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline VecF vadd(VecF a, VecF b) { return {_mm256_add_ps(a.v, b.v)}; }
inline VecF vsub(VecF a, VecF b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline VecF vdiv(VecF a, VecF b) { return {_mm256_div_ps(a.v, b.v)}; }
inline VecF vmax(VecF a, VecF b) { return {_mm256_max_ps(a.v, b.v)}; }
inline VecF vexp(VecF a) { return {exp256(a.v)}; }
inline VecF vtanh(VecF a) { return {tanh256(a.v)}; }
inline float vfirst(VecF a) { return _mm256_cvtss_f32(a.v); }
inline float vreduce_max(VecF a) { return reduce_max8(a.v); }
inline VecF vmask_outside(VecF a, int64_t first_lane, int64_t lo, int64_t hi) {
  const __m256i lane = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(first_lane)),
                                        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i visible =
      _mm256_and_si256(_mm256_cmpgt_epi32(lane, _mm256_set1_epi32(static_cast<int>(lo) - 1)),
                       _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(hi)), lane));
  return {_mm256_blendv_ps(_mm256_set1_ps(kNegInf), a.v, _mm256_castsi256_ps(visible))};
}
inline VecF vround_to_bf16(VecF a) {
  const __m256i bits = _mm256_castps_si256(a.v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  return {_mm256_castsi256_ps(
      _mm256_and_si256(up, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}
inline VecF vload_cache(const float* p) { return vload(p); }
inline VecF vload_cache(const bf16* p) { return {load8_float(p)}; }
#endif
// `a`, held in a register from here: its loads are not folded into the instructions that
// use it. A key or a value serves NV FMAs; folded, GCC loaded it NV times (as a memory
// operand of each), and the score loop of 3 query vectors became bound by loads: 15 a
// step against 7, and a prompt's attention ~20% slower (AVX-512 without BF16).
inline VecF in_register(VecF a) {
  asm("" : "+v"(a.v));
  return a;
}

constexpr int kParts = 16 / kLanes;         // VecFs per group of 16 lanes
constexpr int kChunkVectors = kChunk / kLanes;  // VecFs per chunk of positions

// The sum of a group of 16 lanes held as kParts vectors, paired as reduce16 pairs them.
inline float vreduce16(const VecF (&parts)[kParts]) {
#ifdef PAGEDLLM_AVX512
  return reduce16(parts[0].v);
#else
  return reduce16(parts[0].v, parts[1].v);
#endif
}

// Where 16 cache elements go in a group's kParts vectors. kInOrder: lanes in element order.
// kEvenOdd (AVX2, bf16 only): the even elements 0, 2, .., 14 in part 0 and the odd ones in
// part 1, from one 32-byte load, a shift (the low half of each 32-bit pair) and a mask (the
// high half): half the conversion work, which otherwise competes with the FMAs for the same
// ports. Every lane's arithmetic is untouched; only which lane holds which element differs,
// undone (in_order) where sums leave registers, once per tile or slice, not once per key.
enum class Lanes { kInOrder, kEvenOdd };
template <typename CacheT>
constexpr Lanes kLanesOf =
    kParts == 2 && std::is_same_v<CacheT, bf16> ? Lanes::kEvenOdd : Lanes::kInOrder;

// Part h of the 16 cache elements at p, in lane order L. Keys are loaded one part at a
// time, so that one key vector at a time is live (on AVX2 the score tiles of 3 query
// vectors need all 16 registers besides).
template <Lanes L, typename CacheT>
inline VecF load_part(const CacheT* p, int h) {
  if constexpr (L == Lanes::kEvenOdd) {
#ifdef PAGEDLLM_AVX2
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm256_castsi256_ps(
        h == 0 ? _mm256_slli_epi32(raw, 16)
               : _mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))))};
#endif
  }
  return vload_cache(p + kLanes * h);
}

// A group in lane order L -> element order (kEvenOdd: unpack and swap the middle halves).
template <Lanes L>
inline void in_order(VecF (&g)[kParts]) {
#ifdef PAGEDLLM_AVX2
  if constexpr (L == Lanes::kEvenOdd) {
    const __m256 low = _mm256_unpacklo_ps(g[0].v, g[1].v);   // 0 1 2 3 | 8 9 10 11
    const __m256 high = _mm256_unpackhi_ps(g[0].v, g[1].v);  // 4 5 6 7 | 12 13 14 15
    g[0].v = _mm256_permute2f128_ps(low, high, 0x20);
    g[1].v = _mm256_permute2f128_ps(low, high, 0x31);
  }
#else
  (void)g;  // AVX-512 loads every cache in element order
#endif
}

// Element order -> lane order L (in_order's inverse).
template <Lanes L>
inline void to_lane_order(VecF (&g)[kParts]) {
#ifdef PAGEDLLM_AVX2
  if constexpr (L == Lanes::kEvenOdd) {
    // shuffles: 0 2 8 10 | 4 6 12 14 and 1 3 9 11 | 5 7 13 15; then 64-bit pairs 0 2 1 3
    const __m256d even =
        _mm256_castps_pd(_mm256_shuffle_ps(g[0].v, g[1].v, _MM_SHUFFLE(2, 0, 2, 0)));
    const __m256d odd =
        _mm256_castps_pd(_mm256_shuffle_ps(g[0].v, g[1].v, _MM_SHUFFLE(3, 1, 3, 1)));
    g[0].v = _mm256_castpd_ps(_mm256_permute4x64_pd(even, _MM_SHUFFLE(3, 1, 2, 0)));
    g[1].v = _mm256_castpd_ps(_mm256_permute4x64_pd(odd, _MM_SHUFFLE(3, 1, 2, 0)));
  }
#else
  (void)g;
#endif
}

// How many groups of 16 lanes NV query vectors work on at once: kTileGroups<NV> groups of
// keys for the scores (NV x kTileGroups x kParts sums, NV broadcast queries, a key) and
// kSliceGroups<NV> groups of output dimensions (NV x kSliceGroups x kParts accumulators,
// the values, a probability). With 32 registers (AVX-512) a whole chunk's scores and 64
// dimensions fit for up to 6 vectors; with 16 (AVX2) the tiles shrink as NV grows, enough
// independent FMA chains (6 to 12) to cover the FMA latency without spills. For SmolLM2's 3
// query heads per KV head, one group of 3 with key tiles of 2 groups decoded about 20%
// faster than groups of 2 and 1 on Zen 3. Which sums are in flight together changes with
// these, never what a sum adds or in what order.
#ifdef PAGEDLLM_AVX512
template <int NV>
constexpr int kTileGroups = kChunk / 16;
template <int NV>
constexpr int kSliceGroups = 4;
#else
template <int NV>
constexpr int kTileGroups = NV == 1 ? 4 : NV <= 3 ? 2 : 1;
template <int NV>
constexpr int kSliceGroups = NV == 1 ? 4 : NV == 2 ? 2 : 1;
#endif

inline float exp_scalar(float x) { return vfirst(vexp(vset1(x))); }
#else
inline float exp_scalar(float x) { return x == kNegInf ? 0.f : std::exp(x); }
#endif

// The paired recipe of bf16 caches: each query vector (scaled) and each chunk's
// probabilities are rounded to bf16 (to nearest, ties to even; held in float32), and a
// score or an output adds its products in pairs, the odd term of a pair first: the
// dimensions (1, 0), (3, 2), .. of q . k, the positions (2j + 1, 2j) of the values. That
// is what vdpbf16ps computes, one rounding per product added (products of two bf16 values
// are exact in float32), so AVX512-BF16 CPUs run it with vdpbf16ps on the cache as it
// lies, and every other build runs the same additions as FMAs: the same bits (up to
// denormal terms, which the instruction flushes: attention's scores and outputs never
// come near 2^-126). Float32 caches keep the plain recipe (float32 q, p; terms in order).
inline float round_to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&x, &bits, 4);
  return x;
}

// Dimension i of a sum's order: in order, or paired (1, 0, 3, 2, ..; head_dim is even).
template <bool kPaired>
constexpr int64_t term(int64_t i) {
  return kPaired ? i ^ 1 : i;
}

// The body of a key loop is a lambda; GCC does not always inline one that is called from
// several places, and then keeps the caller's accumulators in memory (a verifying step's
// AVX2 attention ran 40% slower). Each body given to for_each_key is forced inline
// (PAGEDLLM_INLINE, common.h).

// fn(key) for the keys lo .. hi - 1 in the order an output adds them: in order, or paired
// (each pair of positions 2j, 2j + 1 from its odd one; a pair's invisible member skipped,
// which is what adding its zero probability times a zeroed value does). No test per key
// inside the loop: a first odd key and a last even one are peeled.
template <bool kPaired, typename Fn>
inline void for_each_key(int64_t lo, int64_t hi, const Fn& fn) {
  if constexpr (!kPaired) {
    for (int64_t key = lo; key < hi; ++key) fn(key);
  } else {
    int64_t key = lo;
    if (key < hi && (key & 1) != 0) fn(key++);  // an odd first key (its even one is unseen)
    for (; key + 1 < hi; key += 2) {
      fn(key + 1);
      fn(key);
    }
    if (key < hi) fn(key);  // an even last key (its odd one is unseen)
  }
}


struct Geometry {
  int64_t heads, kv_heads, group, head_dim, block_size, max_blocks;
  int64_t head_stride, block_stride;  // cache strides in elements (both caches)
  int64_t q_row_stride, out_row_stride;
  int64_t num_blocks;  // blocks in the cache (the debug build's checks)
};

struct Item {
  int64_t seq, kv_head, first_row, num_rows;  // query rows first_row .. + num_rows of seq
  int64_t num_kv_heads;                       // KV heads kv_head .. + num_kv_heads
  int64_t cost;                               // keys x rows x heads, for load balancing
};

// Per-thread scratch of one item.
struct Scratch {
  std::vector<float> keys_t;  // [D][kChunk]: the chunk's keys, transposed
  std::vector<float> values;  // [kChunk][D]
  std::vector<float> q;       // [rows * G][D], pre-scaled
  std::vector<float> acc;     // [rows * G][D]
  std::vector<float> maxs, sums;
  std::vector<float> probs;   // [kChunk]
  std::vector<uint32_t> q_pairs;  // [rows * G][D / 2]: q's bf16 pairs (vdpbf16ps kernels)
  std::vector<uint32_t> key_pairs;    // [D / 2][kChunk]: the chunk's keys as vdpbf16ps pairs
  std::vector<uint32_t> value_pairs;  // [kChunk / 2][D]: its values, the same
};

// The lines of one KV head's chunk in the cache, handed out a few at a time to be
// prefetched into L2 while the chunk before it computes (see the top of this file). Each
// region is the head's keys or values in one block ([D][bs] or [bs][D]: contiguous).
// Needs kChunk % block_size == 0 (the chunk's blocks hold only its positions) and
// block_size % 16 == 0 (as reading in place does); else it stays empty.
struct NextLines {
  static constexpr int kMaxRegions = 2 * (kChunk / 16);  // keys and values of its blocks
  const char* region[kMaxRegions] = {};  // constant-initialized: no TLS guard
  int64_t regions = 0, issued = 0, total = 0;

  void clear() { regions = issued = total = 0; }

  // Positions start .. end - 1 of a sequence (block table `table`), KV head `kv_head`.
  template <typename CacheT>
  void aim(const CacheT* k_cache, const CacheT* v_cache, const int32_t* table,
           const Geometry& geo, int64_t kv_head, int64_t start, int64_t end) {
    clear();
    const int64_t bs = geo.block_size;
    if (kChunk % bs != 0 || bs % 16 != 0) return;
    for (int64_t pos = start; pos < end; pos += bs) {
      PAGEDLLM_DEBUG_CHECK(table[pos / bs] >= 0 && table[pos / bs] < geo.num_blocks,
                           "attention: block ", table[pos / bs], " outside the cache");
      const int64_t base = static_cast<int64_t>(table[pos / bs]) * geo.block_stride +
                           kv_head * geo.head_stride;
      region[regions++] = reinterpret_cast<const char*>(k_cache + base);
      region[regions++] = reinterpret_cast<const char*>(v_cache + base);
    }
    const int64_t region_bytes = geo.head_dim * bs * static_cast<int64_t>(sizeof(CacheT));
    total = regions * ((region_bytes + 63) / 64);
  }

  // Prefetches the next `count` lines (line i of every region, then line i + 1, ...).
  inline void issue(int count) {
    for (int c = 0; c < count && issued < total; ++c, ++issued)
      __builtin_prefetch(region[issued % regions] + (issued / regions) * 64, 0, 2);  // L2
  }
};

// The calling thread's cursor: attend_item aims it before each head's chunk; the in-place
// kernels' loops call issue(kLinesPerStep) once per step (a dimension pair of the scores,
// a key of the values), which covers a chunk's lines in time. In a shared library every
// access to a thread_local is a call (__tls_get_addr), so each kernel takes a reference to
// it once, on entry, and its loops use that: looked up in the loops, the lookups cost a
// third of decode attention's time (64 sequences x 192 keys, 30 layers, Zen 4: 17.3 ms,
// against 11.7 ms).
thread_local NextLines next_lines;
constexpr int kLinesPerStep = 4;
// Off only to measure what it gains (set_attention_prefetch): the results are the same.
std::atomic<bool> attention_prefetch{true};

inline void widen(const float* src, float* dst, int64_t n) { std::copy(src, src + n, dst); }

inline void widen(const bf16* src, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef PAGEDLLM_VECTOR_ATTENTION
  for (; i + kLanes <= n; i += kLanes) vstore(dst + i, vload_cache(src + i));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// The keys (transposed, [D][kChunk]) and values ([kChunk][D]) of chunk positions
// [begin, end) in float32 scratch; lanes outside are zero.
template <typename CacheT>
void load_chunk(const CacheT* k_cache, const CacheT* v_cache, const int32_t* table,
                const Geometry& geo, int64_t kv_head, int64_t start, int64_t begin, int64_t end,
                Scratch& s) {
  const int64_t d = geo.head_dim, bs = geo.block_size;
  std::fill(s.keys_t.begin(), s.keys_t.end(), 0.f);
  int64_t pos = begin;
  while (pos < end) {
    const int64_t block = pos / bs, offset = pos % bs;
    const int64_t count = std::min(bs - offset, end - pos);  // positions of this block
    PAGEDLLM_DEBUG_CHECK(table[block] >= 0 && table[block] < geo.num_blocks,
                         "attention: block ", table[block], " outside the cache");
    const int64_t base = static_cast<int64_t>(table[block]) * geo.block_stride +
                         kv_head * geo.head_stride;
    const int64_t lane = pos - start;
    for (int64_t x = 0; x < d; ++x)  // keys: row x holds dimension x of every position
      widen(k_cache + base + x * bs + offset, s.keys_t.data() + x * kChunk + lane, count);
    widen(v_cache + base + offset * d, s.values.data() + lane * d, count * d);
    pos += count;
  }
}

// One query vector (already scaled) against the loaded chunk: the online-softmax update of
// its running max, sum and output. Keys visible to it: lanes [lo, hi) of the chunk.
template <bool kPaired>
inline void attend_chunk(const float* q, const Scratch& s, int64_t d, int64_t lo, int64_t hi,
                         double soft_cap, float& running_max, float& running_sum, float* acc,
                         float* probs) {
  float scores[kChunk];
  float new_max = running_max;
  for (int64_t key = 0; key < kChunk; ++key) {
    float dot = 0.f;
    for (int64_t i = 0; i < d; ++i) {
      const int64_t x = term<kPaired>(i);
      dot = std::fma(q[x], s.keys_t[x * kChunk + key], dot);
    }
    if (soft_cap > 0) dot = static_cast<float>(soft_cap * std::tanh(dot / soft_cap));
    scores[key] = (key >= lo && key < hi) ? dot : kNegInf;
    new_max = std::max(new_max, scores[key]);
  }
  const float correction = running_max == kNegInf ? 0.f : exp_scalar(running_max - new_max);
  float total = 0.f;
  for (int64_t key = 0; key < kChunk; ++key) {
    probs[key] = exp_scalar(scores[key] - new_max);
    if constexpr (kPaired) probs[key] = round_to_bf16(probs[key]);
    total += probs[key];
  }
  running_sum = running_sum * correction + total;
  running_max = new_max;
  for (int64_t x = 0; x < d; ++x) acc[x] *= correction;
  for_each_key<kPaired>(lo, hi, [&](int64_t key) PAGEDLLM_INLINE {
    for (int64_t x = 0; x < d; ++x) acc[x] = std::fma(probs[key], s.values[key * d + x], acc[x]);
  });
}

// Where each group of 16 positions of the chunk at `start` lies in the cache (block_size %
// 16 == 0, so a group is inside one block): keys[g] at its first position's dimension 0
// ([D][bs] rows, bs apart), values[g] at its first position's values ([16][D]). Groups
// with no visible lane in [lo, hi) are null and never read: their table entries may lie
// past the sequence's blocks.
template <typename CacheT>
inline void group_pointers(const CacheT* k_cache, const CacheT* v_cache, const int32_t* table,
                           const Geometry& geo, int64_t kv_head, int64_t start, int64_t lo,
                           int64_t hi, const CacheT* (&keys)[kChunk / 16],
                           const CacheT* (&values)[kChunk / 16]) {
  const int64_t d = geo.head_dim, bs = geo.block_size;
  for (int g = 0; g < kChunk / 16; ++g) {
    keys[g] = values[g] = nullptr;
    if (16 * g + 16 <= lo || 16 * g >= hi) continue;
    const int64_t pos = start + 16 * g;
    PAGEDLLM_DEBUG_CHECK(table[pos / bs] >= 0 && table[pos / bs] < geo.num_blocks,
                         "attention: block ", table[pos / bs], " outside the cache");
    const int64_t block = static_cast<int64_t>(table[pos / bs]) * geo.block_stride +
                          kv_head * geo.head_stride;
    keys[g] = k_cache + block + pos % bs;
    values[g] = v_cache + block + (pos % bs) * d;
  }
}

#ifdef PAGEDLLM_VECTOR_ATTENTION
// ------------------------------------------------------------------ the vector kernels
// The kernels of NV query vectors (the G heads of a row that share a KV head, up to
// kGroup or kInPlaceGroup at a time) against one chunk of keys: the scores tile by tile
// into memory (probs), the online softmax from there, then the outputs slice by slice.
// Each chunk kernel (attend_chunk_group, attend_chunk_in_place) is a function of its own
// (inlined into attend_item, a prompt's attention without vdpbf16ps ran slower). Inside
// it, the loops that do the FMAs (score_tile, accumulate_slice) are inlined with AVX-512's
// 32 registers (out of line, the float32 scratch's stride is not a constant), and kept out
// of line on AVX2: inlined there, GCC kept some of their sums in memory, stored on every
// step.
#define PAGEDLLM_CHUNK_KERNEL __attribute__((noinline))
#ifdef PAGEDLLM_AVX512
#define PAGEDLLM_FMA_LOOP inline __attribute__((always_inline))
#else
#define PAGEDLLM_FMA_LOOP __attribute__((noinline))
#endif

// The scores of NV query vectors (q: [NV][d], already scaled) against P groups of 16 keys,
// stored in element order at scores[v * kChunk + 16 * p]. keys[p] holds dimension x of its
// 16 positions at keys[p] + x * stride. Each score adds its d products in the recipe's
// order; x is the outer loop so that the NV x P sums are independent chains in flight
// together (with the groups outer, NV chains of d dependent FMAs each made this loop
// latency-bound, half the kernel's time).
template <int NV, int P, bool kPaired, typename CacheT>
PAGEDLLM_FMA_LOOP void score_tile(const float* q, int64_t d,
                                          const CacheT* const (&keys)[P], int64_t stride,
                                          float* scores) {
  NextLines& next = next_lines;  // looked up once per call: see next_lines
  constexpr Lanes L = kLanesOf<CacheT>;
  // Never escapes, so it stays in registers: accumulated in an array whose address is
  // taken, the compiler treated the sums as memory that the q and key loads might alias
  // and stored them on every step of the loop.
  VecF sums[NV][P][kParts];
  for (int v = 0; v < NV; ++v)
    for (int p = 0; p < P; ++p)
      for (int h = 0; h < kParts; ++h) sums[v][p][h] = vzero();
  for (int64_t i = 0; i < d; ++i) {
    next.issue(kLinesPerStep);
    const int64_t x = term<kPaired>(i);
    VecF qx[NV];
    for (int v = 0; v < NV; ++v) qx[v] = vset1(q[v * d + x]);
    for (int p = 0; p < P; ++p)
      for (int h = 0; h < kParts; ++h) {
        const VecF key = in_register(load_part<L>(keys[p] + x * stride, h));
        for (int v = 0; v < NV; ++v) sums[v][p][h] = vfmadd(qx[v], key, sums[v][p][h]);
      }
  }
  for (int v = 0; v < NV; ++v)
    for (int p = 0; p < P; ++p) {
      in_order<L>(sums[v][p]);
      for (int h = 0; h < kParts; ++h)
        vstore(scores + v * kChunk + 16 * p + kLanes * h, sums[v][p][h]);
    }
}

// The scores of NV query vectors against the chunk's groups of 16 keys that hold visible
// lanes ([lo, hi)), tile by tile, into scores [NV][kChunk]. key_at(g): the keys of group
// g, as in score_tile. Only the visible lanes' scores are used (the softmax masks the
// others to -inf, whatever they hold): tiles with none are not computed, and a group with
// none in a tile that has some reads a visible group's keys (its own table entry may lie
// past the sequence's blocks), so the loop has no branch.
template <int NV, bool kPaired, typename CacheT, typename KeyAt>
inline void chunk_scores(const float* q, int64_t d, int64_t stride, int64_t lo, int64_t hi,
                         const KeyAt& key_at, float* scores) {
  constexpr int P = kTileGroups<NV>;
  const int first = static_cast<int>(lo / 16), last = static_cast<int>((hi - 1) / 16);
  for (int g0 = first / P * P; g0 <= last; g0 += P) {
    const CacheT* keys[P];
    for (int p = 0; p < P; ++p) keys[p] = key_at(std::min(std::max(g0 + p, first), last));
    score_tile<NV, P, kPaired, CacheT>(q, d, keys, stride, scores + 16 * g0);
  }
}

// One query vector's online-softmax step after its scores of a chunk (kChunkVectors
// vectors, in element order): soft cap, mask to the visible lanes [lo, hi), new max,
// probabilities (rounded to bf16 in the paired recipe) stored at probs, running sum.
// Returns the factor its output is rescaled by. The max is exact, whatever the order its
// lanes are compared in; the total adds vector i of the chunk into part i % kParts of one
// group of 16 lanes, reduced by reduce16.
template <bool kPaired>
PAGEDLLM_INLINE inline VecF softmax_vector(VecF (&scores)[kChunkVectors], int64_t lo, int64_t hi,
                           double soft_cap, float& running_max, float& running_sum,
                           float* probs) {
  const bool whole_chunk = lo == 0 && hi == kChunk;  // no lane to mask (most chunks)
  VecF chunk_max = vset1(running_max);
  for (int i = 0; i < kChunkVectors; ++i) {
    if (soft_cap > 0) {
      const VecF cap = vset1(static_cast<float>(soft_cap));
      scores[i] = vmul(cap, vtanh(vdiv(scores[i], cap)));
    }
    if (!whole_chunk) scores[i] = vmask_outside(scores[i], kLanes * i, lo, hi);
    chunk_max = vmax(chunk_max, scores[i]);
  }
  const float new_max = vreduce_max(chunk_max);
  const float correction = running_max == kNegInf ? 0.f : exp_scalar(running_max - new_max);
  VecF total[kParts];
  for (int h = 0; h < kParts; ++h) total[h] = vzero();
  for (int i = 0; i < kChunkVectors; ++i) {
    VecF p = vexp(vsub(scores[i], vset1(new_max)));
    if constexpr (kPaired) p = vround_to_bf16(p);
    vstore(probs + kLanes * i, p);
    total[i % kParts] = vadd(total[i % kParts], p);
  }
  running_sum = running_sum * correction + vreduce16(total);
  running_max = new_max;
  return vset1(correction);
}

// softmax_vector for NV vectors whose scores lie in probs [NV][kChunk], replaced there by
// their probabilities; corr[v]: the factor output v is rescaled by.
template <int NV, bool kPaired>
inline void softmax_chunk(float* probs, int64_t lo, int64_t hi, double soft_cap,
                          float* running_max, float* running_sum, VecF (&corr)[NV]) {
  for (int v = 0; v < NV; ++v) {
    VecF scores[kChunkVectors];
    for (int i = 0; i < kChunkVectors; ++i) scores[i] = vload(probs + v * kChunk + kLanes * i);
    corr[v] = softmax_vector<kPaired>(scores, lo, hi, soft_cap, running_max[v],
                                      running_sum[v], probs + v * kChunk);
  }
}

// acc[v] = acc[v] * corr[v], then acc[v] += probs[v][key] * value(key) for the keys lo..hi
// in the recipe's order (for_each_key), over a slice of G groups of 16 dimensions (from
// x0) of NV outputs of d floats, kept in registers over all the keys (in the values' lane
// order while there). value(key) points at the key's d values (float32 scratch or the
// cache itself), asked once per key: a shift and a multiply, with the groups' blocks
// found once per chunk (group_pointers).
template <int NV, int G, bool kPaired, typename CacheT, typename ValueAt>
PAGEDLLM_FMA_LOOP void accumulate_slice(float* acc, int64_t d, int64_t x0,
                                                const float* probs, const VecF (&corr)[NV],
                                                int64_t lo, int64_t hi, const ValueAt& value) {
  NextLines& next = next_lines;  // looked up once per call: see next_lines
  constexpr Lanes L = kLanesOf<CacheT>;
  VecF a[NV][G][kParts];
  for (int v = 0; v < NV; ++v)
    for (int g = 0; g < G; ++g) {
      for (int h = 0; h < kParts; ++h)
        a[v][g][h] = vmul(vload(acc + v * d + x0 + 16 * g + kLanes * h), corr[v]);
      to_lane_order<L>(a[v][g]);
    }
  for_each_key<kPaired>(lo, hi, [&](int64_t key) PAGEDLLM_INLINE {
    next.issue(kLinesPerStep);
    const CacheT* val = value(key) + x0;
    VecF vx[G][kParts];
    for (int g = 0; g < G; ++g)
      for (int h = 0; h < kParts; ++h) vx[g][h] = in_register(load_part<L>(val + 16 * g, h));
    for (int v = 0; v < NV; ++v) {
      const VecF p = vset1(probs[v * kChunk + key]);
      for (int g = 0; g < G; ++g)
        for (int h = 0; h < kParts; ++h) a[v][g][h] = vfmadd(p, vx[g][h], a[v][g][h]);
    }
  });
  for (int v = 0; v < NV; ++v)
    for (int g = 0; g < G; ++g) {
      in_order<L>(a[v][g]);
      for (int h = 0; h < kParts; ++h)
        vstore(acc + v * d + x0 + 16 * g + kLanes * h, a[v][g][h]);
    }
}

template <int NV, bool kPaired, typename CacheT, typename ValueAt>
inline void accumulate_values(float* acc, int64_t d, const float* probs,
                              const VecF (&corr)[NV], int64_t lo, int64_t hi,
                              const ValueAt& value) {
  constexpr int G = kSliceGroups<NV>;
  int64_t x0 = 0;
  for (; x0 + 16 * G <= d; x0 += 16 * G)
    accumulate_slice<NV, G, kPaired, CacheT>(acc, d, x0, probs, corr, lo, hi, value);
  for (; x0 < d; x0 += 16)  // d % 16 == 0
    accumulate_slice<NV, 1, kPaired, CacheT>(acc, d, x0, probs, corr, lo, hi, value);
}

// NV query vectors (each d floats, one after another in q, already scaled) with the same
// visible lanes [lo, hi) against the chunk loaded in scratch: for each vector the
// operations of attend_chunk (the scalar form), in its order (so the same bits), with the
// loads of keys and values shared. running_max, running_sum: [NV]; acc: [NV][d]; probs:
// [NV][kChunk], the scores and then the probabilities. d % 16 == 0.
template <int NV, bool kPaired>
PAGEDLLM_CHUNK_KERNEL void attend_chunk_group(const float* q, const Scratch& s, int64_t d, int64_t lo,
                               int64_t hi, double soft_cap, float* running_max,
                               float* running_sum, float* acc, float* probs) {
  const float* keys_t = s.keys_t.data();
  chunk_scores<NV, kPaired, float>(q, d, kChunk, lo, hi,
                                   [&](int g) { return keys_t + 16 * g; }, probs);
  VecF corr[NV];
  softmax_chunk<NV, kPaired>(probs, lo, hi, soft_cap, running_max, running_sum, corr);
  const float* values = s.values.data();
  accumulate_values<NV, kPaired, float>(acc, d, probs, corr, lo, hi,
                                        [&](int64_t key) { return values + key * d; });
}

// The same for a chunk read in place from the cache, with no scratch: for rows that see a
// chunk once (decode, speculative verification), widening keys and values into scratch
// would cost more than the attention itself. Needs block_size % 16 == 0, so that each
// group of 16 positions lies in one block; where each visible group starts is found once
// per chunk, not once per key and slice (a 64-bit division per key cost more than the
// key's FMAs).
template <int NV, typename CacheT>
PAGEDLLM_CHUNK_KERNEL void attend_chunk_in_place(const float* q, const CacheT* k_cache, const CacheT* v_cache,
                                  const int32_t* table, const Geometry& geo, int64_t kv_head,
                                  int64_t start, int64_t lo, int64_t hi, double soft_cap,
                                  float* running_max, float* running_sum, float* acc,
                                  float* probs) {
  constexpr int kGroups = kChunk / 16;
  const int64_t d = geo.head_dim, bs = geo.block_size;
  const CacheT* keys[kGroups];    // group g's keys, [D][bs] with its 16 lanes here; null: unseen
  const CacheT* values[kGroups];  // group g's values, [16][D]
  group_pointers(k_cache, v_cache, table, geo, kv_head, start, lo, hi, keys, values);
  constexpr bool kPaired = std::is_same_v<CacheT, bf16>;
  chunk_scores<NV, kPaired, CacheT>(
      q, d, bs, lo, hi, [&](int g) { return keys[g]; }, probs);
  VecF corr[NV];
  softmax_chunk<NV, kPaired>(probs, lo, hi, soft_cap, running_max, running_sum, corr);
  accumulate_values<NV, kPaired, CacheT>(
      acc, d, probs, corr, lo, hi, [&](int64_t key) { return values[key / 16] + (key % 16) * d; });
}
#endif  // PAGEDLLM_VECTOR_ATTENTION

#ifdef PAGEDLLM_AVX512BF16
// ------------------------------------------------------------- vdpbf16ps (AVX512-BF16)
// attend_chunk_in_place over a bf16 cache, each pair of the paired recipe's terms added
// by one vdpbf16ps (the other builds run these additions as two FMAs; the same bits).
//   Scores: rows 2i and 2i + 1 of a 16-position group's keys ([D][bs]: 16 bf16 each) are
//   interleaved by one vpermw into 16 lanes of (dimension 2i, 2i + 1) pairs, multiplied by
//   q's pair i broadcast. 16 lanes are 16 positions, as in the FMA kernels.
//   Outputs: the values of positions 2j and 2j + 1 ([bs][D] rows) are interleaved by
//   vpunpck{l,h}wd into lanes of (2j, 2j + 1) pairs per dimension, times the broadcast
//   pair of probabilities. vpunpck works inside 128-bit lanes, so while an output slice is
//   in registers its dimensions are in that order (kDimsLow / kDimsHigh below), permuted
//   from and back to memory order once per chunk.
// Needs head_dim % 32 == 0 (whole 512-bit rows of 32 values); else the FMA kernel runs.

// q (rounded to bf16, in float32) -> pairs[i] = bf16 bits of q[2i] | those of q[2i + 1] << 16.
inline void bf16_pairs(const float* x, int64_t n, uint32_t* pairs) {
  for (int64_t i = 0; i < n / 2; ++i) {
    uint32_t even, odd;
    std::memcpy(&even, x + 2 * i, 4);
    std::memcpy(&odd, x + 2 * i + 1, 4);
    pairs[i] = (even >> 16) | (odd & 0xFFFF0000u);
  }
}

// vpermw index: 16-bit element 2p <- element p (row 2i, position p), 2p + 1 <- element
// 16 + p (row 2i + 1, position p).
alignas(64) constexpr int16_t kInterleaveRows[32] = {
    0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// 32 rounded probabilities (float32) -> their 16 bf16 pairs: the high halves, elements
// 1, 3, .., 63 of the two vectors.
inline __m512i probability_pairs(const float* p) {
  alignas(64) static const int16_t kHighHalves[32] = {
      1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
      33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
  return _mm512_permutex2var_epi16(_mm512_loadu_si512(p),
                                   _mm512_load_si512(kHighHalves),
                                   _mm512_loadu_si512(p + 16));
}

// Dimensions (of 32) in the lanes of vpunpcklwd's and vpunpckhwd's pairs, and back.
alignas(64) constexpr int32_t kDimsLow[16] = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
alignas(64) constexpr int32_t kDimsHigh[16] = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
alignas(64) constexpr int32_t kFirstSixteen[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
alignas(64) constexpr int32_t kLastSixteen[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};

inline __m512i load_index(const int32_t* index) { return _mm512_load_si512(index); }

// acc[v] = acc[v] * corr[v], then the probabilities (pairs[v][j]: positions 2j, 2j + 1)
// times the values of positions lo .. hi - 1, for dimensions x0 .. x0 + 32H of NV vectors.
template <int NV, int H>
inline void accumulate_slice_bf16(float* acc, int64_t d, int64_t x0,
                                  const uint32_t (&pairs)[NV][kChunk / 2],
                                  const VecF (&corr)[NV], int64_t lo, int64_t hi,
                                  const bf16* const (&values)[kChunk / 16]) {
  NextLines& next = next_lines;  // looked up once per call: see next_lines
  __m512 a[NV][2 * H];  // [v][2h]: dims kDimsLow of the h-th 32; [v][2h + 1]: kDimsHigh
  for (int v = 0; v < NV; ++v)
    for (int h = 0; h < H; ++h) {
      const float* out = acc + v * d + x0 + 32 * h;
      const __m512 first = _mm512_mul_ps(_mm512_loadu_ps(out), corr[v].v);
      const __m512 last = _mm512_mul_ps(_mm512_loadu_ps(out + 16), corr[v].v);
      a[v][2 * h] = _mm512_permutex2var_ps(first, load_index(kDimsLow), last);
      a[v][2 * h + 1] = _mm512_permutex2var_ps(first, load_index(kDimsHigh), last);
    }
  for (int64_t even = lo & ~int64_t{1}; even < hi; even += 2) {
    next.issue(kLinesPerStep);
    const bf16* row = values[even / 16] + (even % 16) * d + x0;  // position even; then + d
    // A pair's invisible member has probability 0; its value is zeroed too (whatever the
    // cache holds there), so that it adds exactly nothing.
    const __mmask32 keep_even = even >= lo ? ~__mmask32{0} : 0;
    const __mmask32 keep_odd = even + 1 < hi ? ~__mmask32{0} : 0;
    __m512i low[H], high[H];
    for (int h = 0; h < H; ++h) {
      const __m512i r0 = _mm512_maskz_loadu_epi16(keep_even, row + 32 * h);
      const __m512i r1 = _mm512_maskz_loadu_epi16(keep_odd, row + d + 32 * h);
      low[h] = _mm512_unpacklo_epi16(r0, r1);
      high[h] = _mm512_unpackhi_epi16(r0, r1);
    }
    for (int v = 0; v < NV; ++v) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[v][even / 2]));
      for (int h = 0; h < H; ++h) {
        a[v][2 * h] = _mm512_dpbf16_ps(a[v][2 * h], (__m512bh)low[h], p);
        a[v][2 * h + 1] = _mm512_dpbf16_ps(a[v][2 * h + 1], (__m512bh)high[h], p);
      }
    }
  }
  for (int v = 0; v < NV; ++v)
    for (int h = 0; h < H; ++h) {
      float* out = acc + v * d + x0 + 32 * h;
      _mm512_storeu_ps(out, _mm512_permutex2var_ps(a[v][2 * h], load_index(kFirstSixteen),
                                                   a[v][2 * h + 1]));
      _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(a[v][2 * h], load_index(kLastSixteen),
                                                        a[v][2 * h + 1]));
    }
}

template <int NV>
inline void attend_chunk_in_place_bf16(const uint32_t* q_pairs, const bf16* k_cache,
                                       const bf16* v_cache, const int32_t* table,
                                       const Geometry& geo, int64_t kv_head, int64_t start,
                                       int64_t lo, int64_t hi, double soft_cap,
                                       float* running_max, float* running_sum, float* acc,
                                       float* probs) {
  NextLines& next = next_lines;  // looked up once per call: see next_lines
  constexpr int kT = kChunk / 16;
  const int64_t d = geo.head_dim, bs = geo.block_size, half = d / 2;
  const bf16* keys[kT];    // group t's keys, [D][bs] with its 16 lanes here; null: unseen
  const bf16* values[kT];  // group t's values, [16][D]
  group_pointers(k_cache, v_cache, table, geo, kv_head, start, lo, hi, keys, values);
  const __m512i interleave = _mm512_load_si512(kInterleaveRows);
  __m512 sums[NV][kT];  // never escapes (see attend_chunk_in_place): stays in registers
  for (int v = 0; v < NV; ++v)
    for (int t = 0; t < kT; ++t) sums[v][t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < half; ++i) {
    next.issue(kLinesPerStep);
    __m512bh qi[NV];
    for (int v = 0; v < NV; ++v)
      qi[v] = (__m512bh)_mm512_set1_epi32(static_cast<int>(q_pairs[v * half + i]));
    for (int t = 0; t < kT; ++t) {
      if (keys[t] == nullptr) continue;
      const bf16* rows = keys[t] + 2 * i * bs;  // dimension 2i; 2i + 1 is bs further
      const __m512i both =
          bs == 16 ? _mm512_loadu_si512(rows)  // the two rows are adjacent
                   : _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(
                                            reinterpret_cast<const __m256i*>(rows))),
                                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + bs)), 1);
      const __m512bh key = (__m512bh)_mm512_permutexvar_epi16(interleave, both);
      for (int v = 0; v < NV; ++v) sums[v][t] = _mm512_dpbf16_ps(sums[v][t], key, qi[v]);
    }
  }
  VecF corr[NV];
  for (int v = 0; v < NV; ++v) {
    VecF scores[kChunkVectors];
    for (int t = 0; t < kT; ++t) scores[t] = {sums[v][t]};
    corr[v] = softmax_vector<true>(scores, lo, hi, soft_cap, running_max[v], running_sum[v],
                                   probs + v * kChunk);
  }
  uint32_t pairs[NV][kChunk / 2];
  for (int v = 0; v < NV; ++v)
    for (int h = 0; h < 2; ++h)
      _mm512_storeu_si512(pairs[v] + 16 * h, probability_pairs(probs + v * kChunk + 32 * h));
  int64_t x0 = 0;
  for (; x0 + 64 <= d; x0 += 64)
    accumulate_slice_bf16<NV, 2>(acc, d, x0, pairs, corr, lo, hi, values);
  for (; x0 < d; x0 += 32) accumulate_slice_bf16<NV, 1>(acc, d, x0, pairs, corr, lo, hi, values);
}

// Items of many rows (prompts) load each chunk once for all their rows. Over a bf16 cache
// with vdpbf16ps, the chunk is loaded as the instruction's pairs, so that every row uses
// the bytes as they lie (the in-place kernels above permute each key and value they read,
// for every group of query vectors; a prompt's 48 vectors per item would repeat that
// work 8 to 16 times):
//   key_pairs   [D / 2][kChunk]  lane p of row i: dimensions (2i, 2i + 1) of position p
//   value_pairs [kChunk / 2][D]  lane x of row j: dimension x of positions (2j, 2j + 1)
// (the low half of a pair is its even member). Positions outside [begin, end) are zero.
// Needs block_size % 16 == 0 and head_dim % 32 == 0 (as the in-place vdpbf16ps kernels).
alignas(64) constexpr int16_t kPairFirstSixteen[32] = {
    0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
    8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
alignas(64) constexpr int16_t kPairLastSixteen[32] = {
    16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
    24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

void load_chunk_pairs(const bf16* k_cache, const bf16* v_cache, const int32_t* table,
                      const Geometry& geo, int64_t kv_head, int64_t start, int64_t begin,
                      int64_t end, Scratch& s) {
  const int64_t d = geo.head_dim, bs = geo.block_size, half = d / 2;
  s.key_pairs.resize(half * kChunk);
  s.value_pairs.resize(kChunk / 2 * d);
  const __m512i interleave = _mm512_load_si512(kInterleaveRows);
  const __m512i first_sixteen = _mm512_load_si512(kPairFirstSixteen);
  const __m512i last_sixteen = _mm512_load_si512(kPairLastSixteen);
  for (int64_t g = 0; g < kChunk / 16; ++g) {  // 16 positions, inside one block
    const int64_t pos = start + 16 * g;
    const int64_t lo = std::clamp<int64_t>(begin - pos, 0, 16);
    const int64_t hi = std::clamp<int64_t>(end - pos, 0, 16);
    const __mmask16 valid = hi > lo ? static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1)) : 0;
    // this head's block (an unread table entry may lie past the sequence's blocks)
    const int64_t block = valid ? static_cast<int64_t>(table[pos / bs]) * geo.block_stride +
                                      kv_head * geo.head_stride
                                : 0;
    // keys: rows 2i and 2i + 1 ([D][bs]) interleaved, as attend_chunk_in_place_bf16 does
    for (int64_t i = 0; i < half; ++i) {
      __m512i pairs = _mm512_setzero_si512();
      if (valid) {
        const bf16* row = k_cache + block + 2 * i * bs + pos % bs;
        const __m256i even = _mm256_maskz_loadu_epi16(valid, row);
        const __m256i odd = _mm256_maskz_loadu_epi16(valid, row + bs);
        pairs = _mm512_permutexvar_epi16(
            interleave, _mm512_inserti64x4(_mm512_castsi256_si512(even), odd, 1));
      }
      _mm512_storeu_si512(s.key_pairs.data() + i * kChunk + 16 * g, pairs);
    }
    // values: the rows ([bs][D]) of positions 2j and 2j + 1, 32 dimensions at a time
    for (int64_t j = 0; j < 8; ++j) {
      const __mmask32 keep_even = (valid >> (2 * j)) & 1 ? ~__mmask32{0} : 0;
      const __mmask32 keep_odd = (valid >> (2 * j + 1)) & 1 ? ~__mmask32{0} : 0;
      const bf16* even_row = v_cache + block + (pos % bs + 2 * j) * d;
      uint32_t* dst = s.value_pairs.data() + (8 * g + j) * d;
      for (int64_t x0 = 0; x0 < d; x0 += 32) {
        const __m512i even = _mm512_maskz_loadu_epi16(keep_even, even_row + x0);
        const __m512i odd = _mm512_maskz_loadu_epi16(keep_odd, even_row + d + x0);
        _mm512_storeu_si512(dst + x0, _mm512_permutex2var_epi16(even, first_sixteen, odd));
        _mm512_storeu_si512(dst + x0 + 16,
                            _mm512_permutex2var_epi16(even, last_sixteen, odd));
      }
    }
  }
}

// NV query vectors with the same visible lanes [lo, hi) against the chunk in key_pairs
// and value_pairs: the operations of attend_chunk_in_place_bf16 (the same bits), with
// every load used as it lies.
template <int NV>
inline void attend_chunk_pairs(const uint32_t* q_pairs, const Scratch& s, int64_t d,
                               int64_t lo, int64_t hi, double soft_cap, float* running_max,
                               float* running_sum, float* acc, float* probs) {
  constexpr int kT = kChunk / 16;
  const int64_t half = d / 2;
  __m512 sums[NV][kT];  // never escapes (see attend_chunk_in_place): stays in registers
  for (int v = 0; v < NV; ++v)
    for (int t = 0; t < kT; ++t) sums[v][t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < half; ++i) {
    __m512bh keys[kT];
    for (int t = 0; t < kT; ++t)
      keys[t] = (__m512bh)_mm512_loadu_si512(s.key_pairs.data() + i * kChunk + 16 * t);
    for (int v = 0; v < NV; ++v) {
      const __m512bh qi = (__m512bh)_mm512_set1_epi32(static_cast<int>(q_pairs[v * half + i]));
      for (int t = 0; t < kT; ++t) sums[v][t] = _mm512_dpbf16_ps(sums[v][t], keys[t], qi);
    }
  }
  VecF corr[NV];
  for (int v = 0; v < NV; ++v) {
    VecF scores[kChunkVectors];
    for (int t = 0; t < kT; ++t) scores[t] = {sums[v][t]};
    corr[v] = softmax_vector<true>(scores, lo, hi, soft_cap, running_max[v], running_sum[v],
                                   probs + v * kChunk);
  }
  uint32_t pairs[NV][kChunk / 2];
  for (int v = 0; v < NV; ++v)
    for (int h = 0; h < 2; ++h)
      _mm512_storeu_si512(pairs[v] + 16 * h, probability_pairs(probs + v * kChunk + 32 * h));
  // Position pairs lo / 2 .. (hi - 1) / 2; a pair's invisible member has probability 0
  // and a finite value (a loaded key, or zero), so it adds exactly nothing.
  for (int64_t x0 = 0; x0 < d; x0 += 32) {
    __m512 a[NV][2];
    for (int v = 0; v < NV; ++v)
      for (int w = 0; w < 2; ++w)
        a[v][w] = _mm512_mul_ps(_mm512_loadu_ps(acc + v * d + x0 + 16 * w), corr[v].v);
    for (int64_t j = lo / 2; 2 * j < hi; ++j) {
      const uint32_t* row = s.value_pairs.data() + j * d + x0;
      const __m512bh v0 = (__m512bh)_mm512_loadu_si512(row);
      const __m512bh v1 = (__m512bh)_mm512_loadu_si512(row + 16);
      for (int v = 0; v < NV; ++v) {
        const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[v][j]));
        a[v][0] = _mm512_dpbf16_ps(a[v][0], v0, p);
        a[v][1] = _mm512_dpbf16_ps(a[v][1], v1, p);
      }
    }
    for (int v = 0; v < NV; ++v)
      for (int w = 0; w < 2; ++w) _mm512_storeu_ps(acc + v * d + x0 + 16 * w, a[v][w]);
  }
}

// Vectors first .. first + count of the item, kInPlaceGroup at a time, against the chunk
// in the pair scratch.
inline void attend_vectors_pairs(Scratch& s, int64_t first, int64_t count, int64_t d,
                                 int64_t lo, int64_t hi, double soft_cap) {
  for (int64_t v = first; v < first + count; v += kInPlaceGroup) {
    const uint32_t* q_pairs = s.q_pairs.data() + v * (d / 2);
    float* acc = s.acc.data() + v * d;
    float* maxs = s.maxs.data() + v;
    float* sums = s.sums.data() + v;
    float* probs = s.probs.data();
#define PAGEDLLM_PAIRS(NV) \
  attend_chunk_pairs<NV>(q_pairs, s, d, lo, hi, soft_cap, maxs, sums, acc, probs)
    switch (std::min<int64_t>(kInPlaceGroup, first + count - v)) {
      case 6: PAGEDLLM_PAIRS(6); break;
      case 5: PAGEDLLM_PAIRS(5); break;
      case 4: PAGEDLLM_PAIRS(4); break;
      case 3: PAGEDLLM_PAIRS(3); break;
      case 2: PAGEDLLM_PAIRS(2); break;
      default: PAGEDLLM_PAIRS(1); break;
    }
#undef PAGEDLLM_PAIRS
  }
}
#endif  // PAGEDLLM_AVX512BF16

// The `count` query vectors of one row (its G heads: vectors first .. first + count of the
// item) against the loaded chunk, all with visible lanes [lo, hi).
template <bool kPaired>
inline void attend_row_chunk(Scratch& s, int64_t first, int64_t count, int64_t d, int64_t lo,
                             int64_t hi, double soft_cap) {
#ifdef PAGEDLLM_VECTOR_ATTENTION
  if (d % 16 == 0) {
    for (int64_t v = first; v < first + count; v += kGroup) {
      float* q = s.q.data() + v * d;
      float* acc = s.acc.data() + v * d;
      float* maxs = s.maxs.data() + v;
      float* sums = s.sums.data() + v;
      switch (std::min<int64_t>(kGroup, first + count - v)) {
        case 4: attend_chunk_group<4, kPaired>(q, s, d, lo, hi, soft_cap, maxs, sums, acc, s.probs.data()); break;
        case 3: attend_chunk_group<3, kPaired>(q, s, d, lo, hi, soft_cap, maxs, sums, acc, s.probs.data()); break;
        case 2: attend_chunk_group<2, kPaired>(q, s, d, lo, hi, soft_cap, maxs, sums, acc, s.probs.data()); break;
        default: attend_chunk_group<1, kPaired>(q, s, d, lo, hi, soft_cap, maxs, sums, acc, s.probs.data()); break;
      }
    }
    return;
  }
#endif
  for (int64_t v = first; v < first + count; ++v)
    attend_chunk<kPaired>(s.q.data() + v * d, s, d, lo, hi, soft_cap, s.maxs[v], s.sums[v],
                          s.acc.data() + v * d, s.probs.data());
}

#ifdef PAGEDLLM_VECTOR_ATTENTION
// attend_row_chunk for a chunk read in place (attend_chunk_in_place).
template <typename CacheT>
inline void attend_row_in_place(Scratch& s, int64_t first, int64_t count, const CacheT* k_cache,
                                const CacheT* v_cache, const int32_t* table, const Geometry& geo,
                                int64_t kv_head, int64_t start, int64_t lo, int64_t hi,
                                double soft_cap) {
  const int64_t d = geo.head_dim;
#ifdef PAGEDLLM_AVX512BF16
  const bool dot_bf16 = std::is_same_v<CacheT, bf16> && d % 32 == 0;
#endif
  for (int64_t v = first; v < first + count; v += kInPlaceGroup) {
    const float* q = s.q.data() + v * d;
    float* acc = s.acc.data() + v * d;
    float* maxs = s.maxs.data() + v;
    float* sums = s.sums.data() + v;
    float* probs = s.probs.data();
#ifdef PAGEDLLM_AVX512BF16
    if constexpr (std::is_same_v<CacheT, bf16>) {
      if (dot_bf16) {
        const uint32_t* q_pairs = s.q_pairs.data() + v * (d / 2);
#define PAGEDLLM_IN_PLACE_BF16(NV)                                                          \
  attend_chunk_in_place_bf16<NV>(q_pairs, k_cache, v_cache, table, geo, kv_head, start, lo, \
                                 hi, soft_cap, maxs, sums, acc, probs)
        switch (std::min<int64_t>(kInPlaceGroup, first + count - v)) {
          case 6: PAGEDLLM_IN_PLACE_BF16(6); break;
          case 5: PAGEDLLM_IN_PLACE_BF16(5); break;
          case 4: PAGEDLLM_IN_PLACE_BF16(4); break;
          case 3: PAGEDLLM_IN_PLACE_BF16(3); break;
          case 2: PAGEDLLM_IN_PLACE_BF16(2); break;
          default: PAGEDLLM_IN_PLACE_BF16(1); break;
        }
#undef PAGEDLLM_IN_PLACE_BF16
        continue;
      }
    }
#endif
#define PAGEDLLM_IN_PLACE(NV)                                                                  \
  attend_chunk_in_place<NV>(q, k_cache, v_cache, table, geo, kv_head, start, lo, hi, soft_cap, \
                            maxs, sums, acc, probs)
    switch (std::min<int64_t>(kInPlaceGroup, first + count - v)) {
#ifdef PAGEDLLM_AVX512
      case 6: PAGEDLLM_IN_PLACE(6); break;
      case 5: PAGEDLLM_IN_PLACE(5); break;
#endif
      case 4: PAGEDLLM_IN_PLACE(4); break;
      case 3: PAGEDLLM_IN_PLACE(3); break;
      case 2: PAGEDLLM_IN_PLACE(2); break;
      default: PAGEDLLM_IN_PLACE(1); break;
    }
#undef PAGEDLLM_IN_PLACE
  }
}
#endif

// Whether items of few rows can read the cache in place (the vector kernels, 16-lane
// groups of keys inside one block; the same test for AVX2, so that a geometry takes the
// same path, with the same bits, on either).
inline bool can_read_in_place(const Geometry& geo) {
#ifdef PAGEDLLM_VECTOR_ATTENTION
  return geo.block_size % 16 == 0 && geo.head_dim % 16 == 0;
#else
  (void)geo;
  return false;
#endif
}

// Whether the whole chunk at `start` is visible to every row (first/last: each row's
// visible keys, inclusive).
inline bool visible_to_all(const std::vector<int64_t>& first, const std::vector<int64_t>& last,
                           int64_t start) {
  for (size_t r = 0; r < first.size(); ++r)
    if (first[r] > start || last[r] + 1 < start + kChunk) return false;
  return true;
}

// Aims next_lines at the first chunk that `item` reads, of its first KV head: the keys
// its first row sees (all of them up to a sliding window) start there.
template <typename CacheT>
void aim_at_first_chunk(const Item& item, const CacheT* k_cache, const CacheT* v_cache,
                        const int32_t* cu, const int32_t* lens, const int32_t* tables,
                        const Geometry& geo, int64_t window) {
  const int64_t b = item.seq, query_len = cu[b + 1] - cu[b];
  const int64_t last = lens[b] - query_len + item.first_row;  // the first row's last key
  const int64_t first = window > 0 ? std::max<int64_t>(0, last - window + 1) : 0;
  const int64_t start = first / kChunk * kChunk;
  next_lines.aim(k_cache, v_cache, tables + b * geo.max_blocks, geo, item.kv_head, start,
                 std::min(start + kChunk, last + 1));
}

template <typename CacheT>
void attend_item(const Item& item, const Item* next_item, const float* qp,
                 const CacheT* k_cache, const CacheT* v_cache, float* op, const int32_t* cu,
                 const int32_t* lens, const int32_t* tables, const Geometry& geo, double scale,
                 int64_t window, double soft_cap, Scratch& s) {
  const int64_t d = geo.head_dim, g_count = geo.group, b = item.seq;
  const int64_t query_len = cu[b + 1] - cu[b];
  constexpr bool kPaired = std::is_same_v<CacheT, bf16>;  // the recipe (see round_to_bf16)
  // Vector v = (head i, row r, query head g) at ((i * num_rows) + r) * G + g.
  const int64_t per_head = item.num_rows * g_count;
  const int64_t vectors = item.num_kv_heads * per_head;
  s.q.resize(vectors * d);
  s.acc.assign(vectors * d, 0.f);
  s.maxs.assign(vectors, kNegInf);
  s.sums.assign(vectors, 0.f);
  int64_t lowest = std::numeric_limits<int64_t>::max(), highest = -1;
  std::vector<int64_t> first(item.num_rows), last(item.num_rows);  // visible keys, inclusive
  for (int64_t r = 0; r < item.num_rows; ++r) {
    const int64_t j = item.first_row + r;
    last[r] = lens[b] - query_len + j;
    first[r] = window > 0 ? std::max<int64_t>(0, last[r] - window + 1) : 0;
    lowest = std::min(lowest, first[r]);
    highest = std::max(highest, last[r]);
    for (int64_t i = 0; i < item.num_kv_heads; ++i) {
      const int64_t h = item.kv_head + i;
      const float* src = qp + (cu[b] + j) * geo.q_row_stride + h * g_count * d;
      float* dst = s.q.data() + (i * per_head + r * g_count) * d;
      for (int64_t e = 0; e < g_count * d; ++e) dst[e] = src[e] * static_cast<float>(scale);
      if constexpr (kPaired)
        for (int64_t e = 0; e < g_count * d; ++e) dst[e] = round_to_bf16(dst[e]);
    }
  }
  const int32_t* table = tables + b * geo.max_blocks;
  // Few rows read each chunk in place; more share one float32 copy of it.
  const bool in_place = item.num_rows <= kInPlaceRows && can_read_in_place(geo);
  // More rows over a bf16 cache, where vdpbf16ps exists: each chunk loaded as its pairs.
  [[maybe_unused]] bool pairs_scratch = false;
#ifdef PAGEDLLM_AVX512BF16
  pairs_scratch = kPaired && !in_place && can_read_in_place(geo) && d % 32 == 0;
  if (kPaired && (in_place || pairs_scratch)) {  // the vdpbf16ps kernels take q as bf16 pairs
    s.q_pairs.resize(vectors * d / 2);
    bf16_pairs(s.q.data(), vectors * d, s.q_pairs.data());
  }
#endif
  TORCH_CHECK(in_place || item.num_kv_heads == 1, "attention: only in-place items span heads");
  next_lines.clear();
  const bool prefetch = in_place && attention_prefetch.load(std::memory_order_relaxed);
  for (int64_t start = (lowest / kChunk) * kChunk; start <= highest; start += kChunk) {
    const int64_t begin = std::max(start, lowest), end = std::min(start + kChunk, highest + 1);
#ifdef PAGEDLLM_AVX512BF16
    if constexpr (kPaired) {
      if (pairs_scratch) {
        load_chunk_pairs(k_cache, v_cache, table, geo, item.kv_head, start, begin, end, s);
        if (visible_to_all(first, last, start)) {  // all the item's vectors, 6 at a time
          attend_vectors_pairs(s, 0, per_head, d, 0, kChunk, soft_cap);
          continue;
        }
        for (int64_t r = 0; r < item.num_rows; ++r) {
          const int64_t lo = std::max(first[r], start) - start;
          const int64_t hi = std::min(last[r] + 1, start + kChunk) - start;
          if (lo < hi) attend_vectors_pairs(s, r * g_count, g_count, d, lo, hi, soft_cap);
        }
        continue;
      }
    }
#endif
    if (!in_place) load_chunk(k_cache, v_cache, table, geo, item.kv_head, start, begin, end, s);
    // Where every row sees the whole chunk (all chunks but the last of a verification or
    // short prompt step), the rows' vectors are attended together, kGroup at a time across
    // rows: more vectors share each key and value load. Each vector's arithmetic is
    // unchanged, so are its bits.
    [[maybe_unused]] const bool rows_together =
        in_place && item.num_rows > 1 && visible_to_all(first, last, start);
    // The heads of a chunk one after another: a block holds the keys (and the values) of
    // all its KV heads side by side, so an item of all heads reads each block's bytes in
    // one pass.
    for (int64_t i = 0; i < item.num_kv_heads; ++i) {
      if (prefetch) {  // the lines of the head's chunk after this one (top of this file)
        if (i + 1 < item.num_kv_heads)
          next_lines.aim(k_cache, v_cache, table, geo, item.kv_head + i + 1, start,
                         std::min(start + kChunk, highest + 1));
        else if (start + kChunk <= highest)
          next_lines.aim(k_cache, v_cache, table, geo, item.kv_head, start + kChunk,
                         std::min(start + 2 * kChunk, highest + 1));
        else if (next_item != nullptr)
          aim_at_first_chunk(*next_item, k_cache, v_cache, cu, lens, tables, geo, window);
        else
          next_lines.clear();
      }
#ifdef PAGEDLLM_VECTOR_ATTENTION
      if (rows_together) {
        attend_row_in_place(s, i * per_head, per_head, k_cache, v_cache, table, geo,
                            item.kv_head + i, start, 0, kChunk, soft_cap);
        continue;
      }
#endif
      for (int64_t r = 0; r < item.num_rows; ++r) {
        const int64_t lo = std::max(first[r], start) - start;
        const int64_t hi = std::min(last[r] + 1, start + kChunk) - start;
        if (lo >= hi) continue;  // none of this chunk's keys is visible to this row
        const int64_t v0 = i * per_head + r * g_count;
#ifdef PAGEDLLM_VECTOR_ATTENTION
        if (in_place) {
          attend_row_in_place(s, v0, g_count, k_cache, v_cache, table, geo, item.kv_head + i,
                              start, lo, hi, soft_cap);
          continue;
        }
#endif
        attend_row_chunk<kPaired>(s, v0, g_count, d, lo, hi, soft_cap);
      }
    }
  }
  for (int64_t i = 0; i < item.num_kv_heads; ++i) {
    const int64_t h = item.kv_head + i;
    for (int64_t r = 0; r < item.num_rows; ++r) {
      float* dst = op + (cu[b] + item.first_row + r) * geo.out_row_stride + h * g_count * d;
      for (int64_t g = 0; g < g_count; ++g) {
        const int64_t v = i * per_head + r * g_count + g;
        const float inv = 1.0f / s.sums[v];
        for (int64_t x = 0; x < d; ++x) dst[g * d + x] = s.acc[v * d + x] * inv;
      }
    }
  }
}

template <typename CacheT>
void attend(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, Tensor& out,
            const std::vector<Item>& items, const int32_t* cu, const int32_t* lens,
            const int32_t* tables, const Geometry& geo, double scale, int64_t window,
            double soft_cap) {
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const CacheT* kc = k_cache.data_ptr<CacheT>();
  const CacheT* vc = v_cache.data_ptr<CacheT>();
  // Items sorted by cost, each a chunk claimed by whichever thread is free: the largest
  // are taken first, and a thread that is late (descheduled) leaves its share to the others.
  run_chunks(static_cast<int64_t>(items.size()), [&](int64_t i) {
    thread_local Scratch s;
    s.keys_t.resize(geo.head_dim * kChunk);
    s.values.resize(kChunk * geo.head_dim);
    s.probs.resize(kChunk * std::max(kGroup, kInPlaceGroup));
    // The next item in the list is the one the next free thread claims (often this one).
    const Item* next = i + 1 < static_cast<int64_t>(items.size()) ? &items[i + 1] : nullptr;
    attend_item(items[i], next, qp, kc, vc, op, cu, lens, tables, geo, scale, window, soft_cap,
                s);
  });
}

// Every index the step's metadata gives attention, checked before any is used: each
// sequence's rows lie within q, its keys within its block table's columns, and every block
// it reads within the cache. (A bad entry would otherwise read or write another request's
// blocks, or outside the cache.)
void check_attention_indices(const Tensor& seqs, const Tensor& cu, const Tensor& lens,
                             const Tensor& tables, int64_t rows, int64_t num_blocks,
                             int64_t block_size) {
  const int64_t batch = lens.numel(), columns = tables.dim() == 2 ? tables.size(1) : -1;
  TORCH_CHECK(cu.numel() == batch + 1 && tables.dim() == 2 && tables.size(0) >= batch,
              "attention: ", batch, " sequences need ", batch + 1, " cu_seqlens_q and a block "
              "table row each, got ", cu.numel(), " and ", tables.sizes());
  const int64_t* seq_p = seqs.data_ptr<int64_t>();
  const int32_t* cu_p = cu.data_ptr<int32_t>();
  const int32_t* len_p = lens.data_ptr<int32_t>();
  const int32_t* table_p = tables.data_ptr<int32_t>();
  for (int64_t i = 0; i < seqs.numel(); ++i) {
    const int64_t b = seq_p[i];
    TORCH_CHECK(b >= 0 && b < batch, "attention: sequence ", b, " of ", batch);
    const int64_t first = cu_p[b], last = cu_p[b + 1], keys = len_p[b];
    TORCH_CHECK(0 <= first && first <= last && last <= rows, "attention: sequence ", b,
                "'s rows ", first, "..", last, " are not within the ", rows, " rows of q");
    TORCH_CHECK(last - first <= keys && keys <= columns * block_size, "attention: sequence ",
                b, " has ", keys, " keys for ", last - first, " rows and ", columns,
                " blocks of ", block_size, " in its table");
    for (int64_t j = 0; j < (keys + block_size - 1) / block_size; ++j) {
      const int32_t block = table_p[b * columns + j];
      TORCH_CHECK(block >= 0 && block < num_blocks, "attention: sequence ", b, "'s block ", j,
                  " is ", block, ", outside the cache's ", num_blocks, " blocks");
    }
  }
}

void paged_attention_rows_(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                           Tensor& out, const Tensor& seq_ids, const Tensor& cu_seqlens_q,
                           const Tensor& seq_lens, const Tensor& block_tables, double scale,
                           int64_t window, double soft_cap) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "q and out must be float32");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q heads must be contiguous");
  TORCH_CHECK(out.stride(2) == 1 && out.stride(1) == out.size(2), "out heads must be contiguous");
  TORCH_CHECK(out.sizes() == q.sizes(), "out must be shaped like q ", q.sizes(), ", got ",
              out.sizes());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "caches must share a dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(k_cache.scalar_type() != at::kBFloat16 || q.size(2) % 2 == 0,
              "bf16 caches need an even head_dim (their sums take dimensions in pairs)");
  TORCH_CHECK(q.size(2) == k_cache.size(2) && v_cache.size(3) == q.size(2) &&
                  v_cache.size(2) == k_cache.size(3) && v_cache.size(1) == k_cache.size(1),
              "caches must be k [blocks, Hkv, D, block_size] and v [blocks, Hkv, block_size, D]");
  Tensor seqs = seq_ids.to(at::kLong).contiguous();
  Tensor cu = cu_seqlens_q.to(at::kInt).contiguous();
  Tensor lens = seq_lens.to(at::kInt).contiguous();
  Tensor tables = block_tables.to(at::kInt).contiguous();
  const Geometry geo{q.size(1),
                     k_cache.size(1),
                     q.size(1) / k_cache.size(1),
                     q.size(2),
                     k_cache.size(3),
                     tables.size(1),
                     k_cache.size(2) * k_cache.size(3),
                     k_cache.size(1) * k_cache.size(2) * k_cache.size(3),
                     q.stride(0),
                     out.stride(0),
                     k_cache.size(0)};
  const int32_t* cu_p = cu.data_ptr<int32_t>();
  const int32_t* len_p = lens.data_ptr<int32_t>();
  std::vector<Item> items;
  const int64_t* seq_p = seqs.data_ptr<int64_t>();
  check_attention_indices(seqs, cu, lens, tables, q.size(0), k_cache.size(0), k_cache.size(3));
  // Items of few rows (read in place) take all KV heads of their sequence at once when
  // there are enough sequences to keep every thread busy: reading each block's heads in
  // one pass instead of one head at a time took decode attention over 64 sequences x 192
  // keys from 14.3 to 13.8 ms per step (30 layers). Every head's arithmetic is the same.
  const bool whole_sequences =
      can_read_in_place(geo) && seqs.numel() >= kSequencesPerThread * pool_threads();
  // With fewer (sequence, KV head) items than two per thread (one sequence verifying its
  // drafts: 3 items of 5 rows on 2 threads ran as 2 + 1), in-place items of several rows
  // are split by rows, into up to `row_parts` items.
  int64_t row_parts = 1;
  if (!whole_sequences && can_read_in_place(geo)) {
    const int64_t base_items = seqs.numel() * geo.kv_heads;
    row_parts = std::max<int64_t>(1, (2 * pool_threads() + base_items - 1) / base_items);
  }
  for (int64_t i = 0; i < seqs.numel(); ++i) {
    const int64_t b = seq_p[i];
    const int64_t query_len = cu_p[b + 1] - cu_p[b];
    for (int64_t j0 = 0; j0 < query_len; j0 += kQueryBlock) {
      const int64_t rows = std::min(kQueryBlock, query_len - j0);
      const int64_t keys = len_p[b] - query_len + j0 + rows;
      const int64_t span = window > 0 ? std::min<int64_t>(keys, window + rows) : keys;
      if (whole_sequences && rows <= kInPlaceRows) {
        items.push_back({b, 0, j0, rows, geo.kv_heads, span * rows * geo.kv_heads});
        continue;
      }
      if (rows <= kInPlaceRows && row_parts > 1) {
        const int64_t part = (rows + row_parts - 1) / row_parts;
        for (int64_t h = 0; h < geo.kv_heads; ++h)
          for (int64_t r0 = 0; r0 < rows; r0 += part) {
            const int64_t n = std::min(part, rows - r0);
            items.push_back({b, h, j0 + r0, n, 1, (span - rows + r0 + n) * n});
          }
        continue;
      }
      for (int64_t h = 0; h < geo.kv_heads; ++h) items.push_back({b, h, j0, rows, 1, span * rows});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int32_t* table_p = tables.data_ptr<int32_t>();
  if (k_cache.scalar_type() == at::kBFloat16) {
    attend<bf16>(q, k_cache, v_cache, out, items, cu_p, len_p, table_p, geo, scale, window,
                 soft_cap);
  } else {
    TORCH_CHECK(k_cache.scalar_type() == at::kFloat, "KV cache must be float32 or bfloat16");
    attend<float>(q, k_cache, v_cache, out, items, cu_p, len_p, table_p, geo, scale, window,
                  soft_cap);
  }
}

}  // namespace

namespace api {
void paged_attention_rows_(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                           Tensor& out, const Tensor& seq_ids, const Tensor& cu_seqlens_q,
                           const Tensor& seq_lens, const Tensor& block_tables, double scale,
                           int64_t window, double soft_cap) {
  pagedllm::paged_attention_rows_(q, k_cache, v_cache, out, seq_ids, cu_seqlens_q, seq_lens,
                                  block_tables, scale, window, soft_cap);
}
}  // namespace api
}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def(
      "paged_attention_rows_(Tensor q, Tensor k_cache, Tensor v_cache, Tensor(a!) out, "
      "Tensor seq_ids, Tensor cu_seqlens_q, Tensor seq_lens, Tensor block_tables, float scale, "
      "int window, float soft_cap) -> ()",
      &pagedllm::paged_attention_rows_);
  // Whether in-place attention prefetches the next chunk's lines (on by default; the same
  // results either way): returns the setting it replaces. For benchmarks to measure it.
  m.def("set_attention_prefetch(bool on) -> bool", [](bool on) {
    return pagedllm::attention_prefetch.exchange(on);
  });
}

// Could prompt attention use AMX BF16 tiles and keep the bits of decode attention?
//
// pagedllm's attention (kernels/csrc/attention.cpp) gives a query row the same bits whether
// it is decoded alone or computed inside a prompt chunk: over a bf16 cache every dot
// product is one chain of VDPBF16PS into a float32 accumulator. A prompt chunk could
// compute its scores 8x faster with TDPBF16PS (16 x 16 outputs per instruction), but only
// if the tile instruction's float32 sums are the chain's bit for bit. This program checks
// that on random data: for C += A . B over 64 values of K (two TDPBF16PS of 32), each of
// C's elements against
//   chain        VDPBF16PS over the 32 pairs in order (the attention kernels' sums)
//   swapped      the same with each pair's members swapped
//   two FMAs     a float32 FMA per product, even member first
//
//   g++ -O2 -march=native -mamx-tile -mamx-bf16 -mavx512bf16 benchmarks/amx_bf16_sums.cpp \
//       -o /tmp/amx_bf16_sums && /tmp/amx_bf16_sums
//
// Measured on the Xeon with AMX of BENCHMARKS.md (512,000 elements): 43.3% of them differ
// from the chain, from the swapped chain and from the FMAs alike. AMX BF16 rounds its sums
// otherwise, so a prompt's rows computed on tiles would not be their decoded selves.
// (kernels/csrc/linear_amx_bf16.cpp found the same for single pairs, which is why only
// the encoders' dense linears use these tiles.)
#include "amx_bench.h"

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>

namespace {

uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A [16 rows][16 pairs] and B [16 pairs][16 columns x 2] of bf16, one TDPBF16PS's operands.
struct Operands {
  alignas(64) uint16_t a[16][32];
  alignas(64) uint16_t b[16][32];
};

}  // namespace

int main() {
  if (!amx_bench::start_square_tiles()) return 1;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.f, 1.f);
  long differ[3] = {0, 0, 0}, elements = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    Operands ops[2];
    alignas(64) float start[16][16], tiles[16][16];
    for (Operands& o : ops)
      for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 32; ++j) {
          o.a[i][j] = to_bf16(normal(rng) * static_cast<float>(trial % 7 + 1));
          o.b[i][j] = to_bf16(normal(rng));
        }
    for (auto& row : start)
      for (float& v : row) v = normal(rng) * 10.f;
    std::memcpy(tiles, start, sizeof tiles);
    _tile_loadd(0, tiles, 64);
    _tile_loadd(4, ops[0].a, 64);
    _tile_loadd(6, ops[0].b, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(5, ops[1].a, 64);
    _tile_loadd(7, ops[1].b, 64);
    _tile_dpbf16ps(0, 5, 7);
    _tile_stored(0, tiles, 64);
    for (int m = 0; m < 16; ++m) {
      __m512 chain = _mm512_loadu_ps(start[m]), swapped = chain, fmas = chain;
      for (const Operands& o : ops)
        for (int p = 0; p < 16; ++p) {
          const __m512i b = _mm512_load_si512(o.b[p]);  // 16 columns x (even, odd)
          const uint32_t pair = o.a[m][2 * p] | (static_cast<uint32_t>(o.a[m][2 * p + 1]) << 16);
          const uint32_t swapped_pair = o.a[m][2 * p + 1] | (static_cast<uint32_t>(o.a[m][2 * p]) << 16);
          const __m512i swapped_b = _mm512_or_si512(_mm512_srli_epi32(b, 16), _mm512_slli_epi32(b, 16));
          chain = _mm512_dpbf16_ps(chain, (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)), (__m512bh)b);
          swapped = _mm512_dpbf16_ps(swapped, (__m512bh)_mm512_set1_epi32(static_cast<int>(swapped_pair)),
                                     (__m512bh)swapped_b);
          const __m512 even_b = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
          const __m512 odd_b = _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32(~0xFFFF)));
          fmas = _mm512_fmadd_ps(_mm512_set1_ps(from_bf16(o.a[m][2 * p])), even_b, fmas);
          fmas = _mm512_fmadd_ps(_mm512_set1_ps(from_bf16(o.a[m][2 * p + 1])), odd_b, fmas);
        }
      alignas(64) float got[3][16];
      _mm512_store_ps(got[0], chain);
      _mm512_store_ps(got[1], swapped);
      _mm512_store_ps(got[2], fmas);
      for (int n = 0; n < 16; ++n, ++elements)
        for (int v = 0; v < 3; ++v) differ[v] += std::memcmp(&got[v][n], &tiles[m][n], 4) != 0;
    }
  }
  std::printf("%ld elements of C += A . B over 64 values of K; TDPBF16PS differs from\n", elements);
  std::printf("  the VDPBF16PS chain in %.1f%%, the swapped chain in %.1f%%, two FMAs in %.1f%%\n",
              100.0 * differ[0] / elements, 100.0 * differ[1] / elements,
              100.0 * differ[2] / elements);
  _tile_release();
  return 0;
}

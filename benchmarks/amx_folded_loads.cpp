// Where the folded AMX kernel's tile work waits: on its tile loads, or on TDPBSSD?
//
// pagedllm's folded K-quant kernel (kernels/csrc/linear_packed.cpp, amx_folded_tile_rows)
// computes, per 16 x 16 block of outputs and super block of 256 values of K, 8 TDPBSSD
// (4 steps of 64 values, a lo and a hi weight tile each) from 4 A tiles of activations
// (4 KiB) and 8 B tiles of folded weights (8 KiB), then stores the two accumulators. This
// program runs only that tile sequence, one thread, over the data of a whole linear laid
// out as the kernel lays it out (A: [chunks][K/64][16 x 64], B: [tiles][K/64][2][16 x 64]),
// in three loop orders:
//
//   whole    per weight tile, every chunk of x, K whole    (the kernel before 4b130ba)
//   slices   per weight tile and slice of 2 super blocks, every chunk: a slice's 16 KiB
//            of B tiles stay in L1 while the chunks pass   (the kernel from 4b130ba)
//   l1       one chunk and one tile, K = 256, repeated: everything in L1 (the floor)
//
//   g++ -O2 -march=native -mamx-tile -mamx-int8 benchmarks/amx_folded_loads.cpp -o /tmp/amx_loads
//   /tmp/amx_loads [K chunks tiles]    (Linux 5.16+ on a CPU with AMX; default 2048 16 8)
//
// Measured on the 2-core Xeon with AMX of BENCHMARKS.md (one thread, ns per block and
// super block, 8 TDPBSSD each; three runs, 16 and 32 chunks alike):
//   whole, K = 2,048, 8 weight tiles     80-83
//   slices of 2                          55-57
//   all in L1                            47-48
// The kernel's whole loop adds the float steps of each block and the making of the B
// tiles; with slices the whole-model gain was 2-12% (BENCHMARKS.md).
#include "amx_bench.h"

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

// Tile loads and stores that tell the compiler which memory they touch (as amx.h does).
#define TILE_LOAD(T, base)                                                 \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #T                             \
               :                                                           \
               : "r"(base), "r"(64L),                                      \
                 "m"(*reinterpret_cast<const char(*)[1024]>(base)))
#define TILE_STORE(T, base)                                                \
  asm volatile("tilestored %%tmm" #T ", (%1,%2,1)"                         \
               : "=m"(*reinterpret_cast<int32_t(*)[256]>(base))            \
               : "r"(base), "r"(64L))

alignas(64) int32_t sink[2][256];

// One super block (4 steps of 64 values of K) of one chunk against one weight tile,
// alternating two sets of A and B tiles as the kernel does.
inline void super_block(const int8_t* a, const int8_t* b) {
  _tile_zero(0);
  _tile_zero(1);
  for (int step = 0; step < 4; step += 2) {
    TILE_LOAD(4, a + step * 1024);
    TILE_LOAD(2, b + step * 2048);
    TILE_LOAD(3, b + step * 2048 + 1024);
    _tile_dpbssd(0, 4, 2);
    _tile_dpbssd(1, 4, 3);
    TILE_LOAD(5, a + (step + 1) * 1024);
    TILE_LOAD(6, b + (step + 1) * 2048);
    TILE_LOAD(7, b + (step + 1) * 2048 + 1024);
    _tile_dpbssd(0, 5, 6);
    _tile_dpbssd(1, 5, 7);
  }
  TILE_STORE(0, sink[0]);
  TILE_STORE(1, sink[1]);
}

// The best of 7 timed runs after a warm one.
template <typename Fn>
double ns_per_block(long blocks, const Fn& fn) {
  fn();
  double best = 1e30;
  for (int run = 0; run < 7; ++run) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    const std::chrono::duration<double, std::nano> took = std::chrono::steady_clock::now() - start;
    if (took.count() < best) best = took.count();
  }
  return best / blocks;
}

}  // namespace

int main(int argc, char** argv) {
  if (!amx_bench::start_square_tiles()) return 1;
  const long k = argc > 3 ? std::atol(argv[1]) : 2048, chunks = argc > 3 ? std::atol(argv[2]) : 16,
             tiles = argc > 3 ? std::atol(argv[3]) : 8;
  const long steps = k / 64, supers = k / 256;
  auto* a = static_cast<int8_t*>(std::aligned_alloc(64, chunks * steps * 1024));
  auto* b = static_cast<int8_t*>(std::aligned_alloc(64, tiles * steps * 2048));
  std::memset(a, 1, chunks * steps * 1024);
  std::memset(b, 1, tiles * steps * 2048);
  const long blocks = chunks * tiles * supers;

  const double whole = ns_per_block(blocks, [&] {
    for (long t = 0; t < tiles; ++t)
      for (long c = 0; c < chunks; ++c)
        for (long s = 0; s < supers; ++s)
          super_block(a + (c * steps + 4 * s) * 1024, b + (t * steps + 4 * s) * 2048);
  });
  const double sliced = ns_per_block(blocks, [&] {
    for (long t = 0; t < tiles; ++t)
      for (long s0 = 0; s0 < supers; s0 += 2)
        for (long c = 0; c < chunks; ++c)
          for (long s = s0; s < s0 + 2 && s < supers; ++s)
            super_block(a + (c * steps + 4 * s) * 1024, b + (t * steps + 4 * s) * 2048);
  });
  const long repeats = 100000;
  const double l1 = ns_per_block(repeats, [&] {
    for (long i = 0; i < repeats; ++i) super_block(a, b);
  });
  std::printf("K = %ld, %ld chunks of 16 rows, %ld weight tiles: ns per block and super block\n",
              k, chunks, tiles);
  std::printf("  whole %.1f   slices of 2 %.1f   all in L1 %.1f\n", whole, sliced, l1);
  _tile_release();
  std::free(a);
  std::free(b);
  return 0;
}

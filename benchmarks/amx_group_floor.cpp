// How fast can an AMX-INT8 kernel with a float scale per 32-value group be?
//
// pagedllm's packed linears (kernels/csrc/linear_packed.cpp, `amx_tile_rows`) multiply
// int8 activations by K-quant weights whose every group of 32 (Q4_K) or 16 (Q6_K) values
// has its own scale and min. For one block of 16 activation rows x 16 weight rows and one
// group, the kernel runs one TDPBSSD (16 x 16 x 32 into int32 C), stores C, and applies
// the group's scales in AVX-512: per row, a convert, a multiply of the two scales, a fused
// multiply-add, and one more for the min. This program times those two halves alone and
// together, on data in L1, to show where the floor is:
//
//   g++ -O2 -march=native -mamx-tile -mamx-int8 benchmarks/amx_group_floor.cpp -o /tmp/amx_floor
//   /tmp/amx_floor      (Linux 5.16+ on a CPU with AMX; one thread)
//
// Measured on the 2-core Xeon with AMX of BENCHMARKS.md (Emerald Rapids, one thread):
//   tile work only (zero, 2 loads, TDPBSSD, store)   14.6-14.8 ns a block
//   tile work without the store                        10.5-10.8 ns
//   float steps only: scale / scale + min              13.4 / 18.8-19.7 ns
//   both: scale / scale + min, as the kernel           33.2 / 37.2-45.7 ns (two builds)
//   both, the floats reading another buffer            32.3 ns
//   tile work of 2 x 2 blocks a group (4 accumulators) 14.5-14.9 ns a block: no gain
// The tile work and the AVX-512 float steps do not overlap (not even when the float steps
// read a buffer the tile store does not touch), so a block costs their sum, and the float
// steps, fixed by the recipe that gives AMX and VNNI the same bits, are half of it or
// more. The kernel itself runs at ~45 ns a block over a layer's weights (the KScale decode
// per group, weight unpacking and L2 traffic besides), so this recipe has at most ~20%
// left; a large gain needs fewer float steps per multiply, i.e. another recipe.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

constexpr int kGroup = 32, kGroups = 32;  // K = 1024
constexpr long kIterations = 100000;

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tile loads and stores that tell the compiler which memory they touch (as amx.h does).
#define TILE_LOAD(T, base, stride)                                        \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #T                            \
               :                                                          \
               : "r"(base), "r"(static_cast<long>(stride)),               \
                 "m"(*reinterpret_cast<const char(*)[512]>(base)))
#define TILE_STORE(T, base)                                               \
  asm volatile("tilestored %%tmm" #T ", (%1,%2,1)"                        \
               : "=m"(*reinterpret_cast<int32_t(*)[256]>(base))           \
               : "r"(base), "r"(64L))

std::vector<int8_t> activations(kGroups * 16 * kGroup * 2, 1), weights(kGroups * kGroup * 16 * 2, 1);
std::vector<float> row_scales(kGroups * 16, 0.5f), lane_scales(kGroups * 16, 0.25f);

// kTiles: run the tile work; kFloat: 0 none, 1 scale, 2 scale + min; kStore: store C;
// kSeparate: the float steps read a buffer the tile store does not write.
template <bool kTiles, int kFloat, bool kStore = true, bool kSeparate = false>
float one_by_one(long iterations) {
  alignas(64) int32_t sums[2][256] = {};
  alignas(64) static int32_t elsewhere[2][256];
  float sink = 0.f;
  for (long it = 0; it < iterations; ++it) {
    __m512 acc[16];
    for (auto& a : acc) a = _mm512_setzero_ps();
    for (int g = 0; g < kGroups; ++g) {
      const int8_t* a = activations.data() + g * 512;
      const int8_t* b = weights.data() + g * 512;
      if (kTiles) {  // two accumulators in turn: group g + 1's product beside group g's floats
        if (g & 1) {
          _tile_zero(1); TILE_LOAD(5, a, kGroup); TILE_LOAD(7, b, 64); _tile_dpbssd(1, 5, 7);
          if (kStore) TILE_STORE(1, sums[1]);
        } else {
          _tile_zero(0); TILE_LOAD(4, a, kGroup); TILE_LOAD(6, b, 64); _tile_dpbssd(0, 4, 6);
          if (kStore) TILE_STORE(0, sums[0]);
        }
      }
      if (kFloat > 0) {
        const int32_t* group_sums = kSeparate ? elsewhere[(g + 1) & 1] : sums[(g + 1) & 1];
        const __m512 s = _mm512_loadu_ps(lane_scales.data() + g * 16);
        const float* d = row_scales.data() + g * 16;
        for (int r = 0; r < 16; ++r)
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(group_sums + r * 16)),
                                   _mm512_mul_ps(s, _mm512_set1_ps(d[r])), acc[r]);
        if (kFloat == 2)
          for (int r = 0; r < 16; ++r) acc[r] = _mm512_fmadd_ps(s, _mm512_set1_ps(d[r]), acc[r]);
      }
    }
    for (auto& a : acc) sink += _mm512_reduce_add_ps(a);
  }
  return sink;
}

// Tile work only, 2 x 2 a group: two 16-row chunks of activations x two weight tiles.
float two_by_two(long iterations) {
  alignas(64) int32_t sums[4][256];
  for (long it = 0; it < iterations; ++it)
    for (int g = 0; g < kGroups; ++g) {
      const int8_t* a = activations.data() + g * 1024;
      const int8_t* b = weights.data() + g * 1024;
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      TILE_LOAD(4, a, kGroup); TILE_LOAD(5, a + 512, kGroup);
      TILE_LOAD(6, b, 64); TILE_LOAD(7, b + 512, 64);
      _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 4, 7); _tile_dpbssd(2, 5, 6); _tile_dpbssd(3, 5, 7);
      TILE_STORE(0, sums[0]); TILE_STORE(1, sums[1]); TILE_STORE(2, sums[2]); TILE_STORE(3, sums[3]);
    }
  return static_cast<float>(sums[0][0]);
}

template <typename Run>
void report(const char* name, Run run, double blocks_per_iteration) {
  double best = 1e30;
  for (int round = 0; round < 3; ++round) {
    const auto start = std::chrono::steady_clock::now();
    volatile float keep = run(kIterations);
    (void)keep;
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  const double blocks = kIterations * blocks_per_iteration;
  std::printf("%-40s %6.1f ns a 16x16x32 block, %5.0f GFLOP/s\n", name, best / blocks * 1e9,
              blocks * 2 * 16 * 16 * kGroup / best / 1e9);
}

}  // namespace

int main() {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) != 0) {
    std::printf("Linux gave no AMX tile state (no AMX, or a kernel before 5.16)\n");
    return 1;
  }
  TileConfig config{};
  config.palette = 1;
  for (int t = 0; t < 4; ++t) config.rows[t] = 16, config.colsb[t] = 64;          // C
  for (int t = 4; t < 6; ++t) config.rows[t] = 16, config.colsb[t] = kGroup;      // A
  for (int t = 6; t < 8; ++t) config.rows[t] = kGroup / 4, config.colsb[t] = 64;  // B
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
  report("tile work only", one_by_one<true, 0>, kGroups);
  report("tile work without the store", one_by_one<true, 0, false>, kGroups);
  report("float steps only (scale)", one_by_one<false, 1>, kGroups);
  report("float steps only (scale + min)", one_by_one<false, 2>, kGroups);
  report("both (scale)", one_by_one<true, 1>, kGroups);
  report("both (scale + min), as the kernel", one_by_one<true, 2>, kGroups);
  report("both, floats on a separate buffer", one_by_one<true, 1, true, true>, kGroups);
  report("tile work only, 2 x 2 blocks a group", two_by_two, kGroups * 4);
  _tile_release();
  return 0;
}

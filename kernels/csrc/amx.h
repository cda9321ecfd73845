// Intel AMX (Advanced Matrix Extensions) for the packed linears: the tile registers'
// layout, and turning them on.
//
// AMX adds eight tile registers of up to 16 rows x 64 bytes and one instruction that
// multiplies two of them into a third: TDPBSUD C += A . B with A signed bytes [16, 4k] and
// B unsigned bytes [k, 64] in VNNI order (row p, byte 4n + j holds B's column n at depth
// 4p + j), C int32 [16, 16]. The sums are exact integers, as vpdpbusd's are, so a kernel
// that gets its integer sums from AMX and does the same float32 steps afterwards gives the
// same bits as one that gets them from VNNI.
//
// Linux hands out the 8 KiB of tile state only to a process that asks for it
// (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), kernel 5.16+); every thread then
// loads a tile configuration before its first tile instruction, and releases the tiles
// when done so that the kernel need not save them at each context switch.
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && \
    defined(__AVX512BW__)
#define PAGEDLLM_AMX 1
#include <immintrin.h>
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PAGEDLLM_AMX_BF16 1  // TDPBF16PS: linear_amx_bf16.cpp
#endif
#endif

namespace pagedllm {
namespace amx {

// True when this process may run AMX int8 now: compiled in, the CPU has it, Linux granted
// the tile state, and it was not switched off (set_enabled(false), or the environment
// variable PAGEDLLM_DISABLE_AMX=1). Asks Linux once.
bool enabled();

// Switch AMX on (when available) or off for this process; returns enabled().
bool set_enabled(bool on);

// enabled(), and the CPU has AMX-BF16 (TDPBF16PS) and the build compiled it in.
bool bf16_enabled();

#ifdef PAGEDLLM_AMX
// The tiles of the packed kernels, for weight groups of `group` (16 or 32) values of K
// (tile numbers are instruction immediates):
//   0-1  accumulators C: int32 [16 rows of x, 16 output rows of the weight]
//   4-5  activations A: 16 rows of x, `group` int8 values of K
//   6-7  weights B: group/4 rows x 64 bytes, the same values of K for 16 output rows
// Loads that configuration on the calling thread (cheap; once per parallel chunk).
void configure_thread(int group);
inline void release_thread() { _tile_release(); }

// Every tile 16 rows x 64 bytes (the bf16 kernel's 2 x 2 blocking, linear_amx_bf16.cpp):
//   0-3  accumulators C: float32 [16 rows of x, 16 outputs]
//   4-5  activations A: 16 rows of x, 32 bf16 values of K
//   6-7  weights B: 16 pairs of K x 16 outputs x 2 (VNNI order)
void configure_thread_square();

// Tile loads and stores that name the memory they touch: GCC's _tile_loadd does not say
// that it reads memory, and _tile_stored clobbers all of it, which keeps every accumulator
// of the float steps around it in memory instead of registers. T is the tile number.
//   load:  `bytes` contiguous bytes at base (rows of `stride` bytes, stride = row width)
//   store: int32 [16, 16] (a full accumulator tile) at base, rows of 64 bytes
#define PAGEDLLM_TILE_LOAD(T, base, stride, bytes)                                  \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #T                                      \
               :                                                                    \
               : "r"(base), "r"(static_cast<long>(stride)),                         \
                 "m"(*reinterpret_cast<const char(*)[bytes]>(base)))
#define PAGEDLLM_TILE_STORE(T, base)                                                \
  asm volatile("tilestored %%tmm" #T ", (%1,%2,1)"                                  \
               : "=m"(*reinterpret_cast<int32_t(*)[256]>(base))                     \
               : "r"(base), "r"(64L))
#endif

}  // namespace amx
}  // namespace pagedllm

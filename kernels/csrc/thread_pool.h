// The fast path's own thread pool: parallel loops that degrade to one thread's speed, not
// below it, when the cores are shared.
//
// Why not at::parallel_for (OpenMP): a parallel region ends when every thread of the team
// has finished its fixed share. On a busy machine (a laptop running other things, tests
// beside the engine) one of our threads is often descheduled, and each of the ~150 regions
// of a decode step then waits for it: a one-row step measured 118 ms with 2 OpenMP threads
// against 20 ms with one. Here a loop is cut into chunks that the calling thread and the
// workers claim from one counter; the caller runs whatever nobody else has claimed and
// waits only for chunks already running elsewhere. A descheduled worker simply gets no work.
//
// The results never depend on who ran a chunk: every kernel computes each output element
// entirely inside one chunk.

#pragma once

#include <cstdint>
#include <functional>

namespace pagedllm {

// Threads a loop may use: torch's intra-op setting (torch.set_num_threads).
int64_t pool_threads();

// fn(c) for every chunk c in [0, chunks), on this thread and the pool's workers.
void run_chunks(int64_t chunks, const std::function<void(int64_t)>& fn);

// f(b, e) over sub-ranges of [begin, end) of at least `grain` items (as at::parallel_for).
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  constexpr int64_t kChunksPerThread = 4;  // small enough that a late thread costs little
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t threads = pool_threads();
  grain = grain < 1 ? 1 : grain;
  if (threads <= 1 || n <= grain) {
    f(begin, end);
    return;
  }
  int64_t chunks = (n + grain - 1) / grain;
  if (chunks > threads * kChunksPerThread) chunks = threads * kChunksPerThread;
  const int64_t size = (n + chunks - 1) / chunks;
  chunks = (n + size - 1) / size;
  run_chunks(chunks, [&](int64_t c) {
    const int64_t b = begin + c * size;
    f(b, b + size < end ? b + size : end);
  });
}

}  // namespace pagedllm

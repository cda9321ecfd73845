// The pool behind run_chunks (see thread_pool.h for why it exists).
//
// One job at a time, published by the calling thread in a single 64-bit ticket:
//
//     ticket = [ generation : 24 | chunks : 20 | next chunk : 20 ]
//
// Claiming a chunk is a compare-and-swap that increments `next` only while the generation
// is the one the claimer saw, so a worker that wakes late can never take a chunk of a later
// job with an earlier job's function. The caller claims chunks like any worker, then waits
// until every claimed chunk has finished (`done`); it never waits for a worker that claimed
// nothing. Workers spin for a short while after a job (the next region of a step comes
// within microseconds), then sleep on a condition variable.

#include "thread_pool.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>
#include <pthread.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace pagedllm {
namespace {

constexpr int kGenShift = 40, kChunkShift = 20;
constexpr uint64_t kField = (1ull << 20) - 1;
constexpr auto kSpin = std::chrono::microseconds(2000);  // before a worker sleeps

inline void relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

class Pool {
 public:
  // Runs chunks [0, chunks) of fn with up to `threads` threads, this one included.
  void run(int64_t chunks, int64_t threads, const std::function<void(int64_t)>& fn) {
    std::lock_guard<std::mutex> one_job(job_lock_);  // callers from several threads queue
    ensure_workers(threads - 1);
    fn_.store(&fn, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    active_.store(threads - 1, std::memory_order_relaxed);
    const uint64_t gen = (generation_ + 1) & ((1ull << 24) - 1);
    generation_ = gen;
    ticket_.store((gen << kGenShift) | (static_cast<uint64_t>(chunks) << kChunkShift));
    if (sleepers_.load() > 0) {
      { std::lock_guard<std::mutex> lk(sleep_lock_); }
      wake_.notify_all();
    }
    work(gen);
    while (done_.load(std::memory_order_acquire) < chunks) relax();
    // Every chunk has finished (none is still using fn): a chunk's exception can be rethrown.
    std::exception_ptr failure;
    {
      std::lock_guard<std::mutex> lk(failure_lock_);
      std::swap(failure, failure_);
    }
    if (failure) std::rethrow_exception(failure);
  }

 private:
  // Claims and runs chunks of job `gen` until none is left.
  void work(uint64_t gen) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    while ((t >> kGenShift) == gen && (t & kField) < ((t >> kChunkShift) & kField)) {
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) continue;
      try {
        (*fn_.load(std::memory_order_acquire))(static_cast<int64_t>(t & kField));
      } catch (...) {  // kept for the caller, which rethrows it once every chunk is done
        std::lock_guard<std::mutex> lk(failure_lock_);
        if (!failure_) failure_ = std::current_exception();
      }
      done_.fetch_add(1, std::memory_order_release);
      t = ticket_.load(std::memory_order_acquire);
    }
  }

  void ensure_workers(int64_t count) {
    while (static_cast<int64_t>(workers_.size()) < count) {
      const int64_t id = static_cast<int64_t>(workers_.size());
      workers_.emplace_back([this, id] { worker_loop(id); });
      workers_.back().detach();  // lives as long as the process
    }
  }

  void worker_loop(int64_t id) {
    uint64_t seen = ticket_.load() >> kGenShift;
    for (;;) {
      uint64_t gen = ticket_.load(std::memory_order_acquire) >> kGenShift;
      const auto deadline = std::chrono::steady_clock::now() + kSpin;
      for (int spins = 0; gen == seen; ++spins) {
        relax();
        gen = ticket_.load(std::memory_order_acquire) >> kGenShift;
        if ((spins & 63) == 63 && gen == seen && std::chrono::steady_clock::now() > deadline) {
          std::unique_lock<std::mutex> lk(sleep_lock_);
          sleepers_.fetch_add(1);
          wake_.wait(lk, [&] { return (ticket_.load() >> kGenShift) != seen; });
          sleepers_.fetch_sub(1);
          gen = ticket_.load(std::memory_order_acquire) >> kGenShift;
        }
      }
      seen = gen;
      if (id < active_.load(std::memory_order_relaxed)) work(gen);
    }
  }

  std::mutex job_lock_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> ticket_{0};
  std::atomic<const std::function<void(int64_t)>*> fn_{nullptr};
  std::atomic<int64_t> done_{0};
  std::atomic<int64_t> active_{0};
  std::atomic<int64_t> sleepers_{0};
  uint64_t generation_ = 0;
  std::mutex sleep_lock_;
  std::condition_variable wake_;
  std::mutex failure_lock_;
  std::exception_ptr failure_;
};

Pool* pool = nullptr;
std::once_flag pool_once;

// A forked child has none of the parent's worker threads (and maybe a mutex a worker held):
// it starts a pool of its own. The parent's is left as it was (never freed: its threads
// are gone in the child, and destroying it there would be undefined).
void forget_pool_in_child() {
  pool = new Pool();
}

Pool& the_pool() {
  std::call_once(pool_once, [] {
    pool = new Pool();
    pthread_atfork(nullptr, nullptr, forget_pool_in_child);
  });
  return *pool;
}

thread_local bool inside_chunk = false;
// Set by kernel_thread(): the pool's threads for loops this thread starts (0: torch's).
thread_local int64_t own_pool_threads = 0;

// Makes the calling thread one that runs the fast path's kernels (the engine's thread):
// the pool's loops it starts use `threads` threads, and torch's own ops on it run on it
// alone. Why: after each of torch's parallel regions (an index or a copy of a few
// thousand elements, the sampler's softmax) its OpenMP worker spins for milliseconds
// waiting for the next one, on the core the pool's worker needs. Beside the engine's
// steps that spin took a quarter of a core, and the LM head of a 16-sequence decode step
// took 5.2 ms instead of 3.3 (2 cores, Zen 4); torch's ops in a step are small enough
// that one thread does them as fast.
void kernel_thread(int64_t threads) {
  TORCH_CHECK(threads >= 1, "kernel_thread: threads must be at least 1, got ", threads);
  at::get_num_threads();  // torch's first call on a thread sets its OpenMP threads: do it now
  own_pool_threads = threads;
  omp_set_num_threads(1);  // this thread's OpenMP setting only, which torch's loops read
}

}  // namespace

int64_t pool_threads() {
  if (inside_chunk) return 1;
  return own_pool_threads > 0 ? own_pool_threads : std::max<int64_t>(1, at::get_num_threads());
}

void run_chunks(int64_t chunks, const std::function<void(int64_t)>& fn) {
  const int64_t threads = std::min<int64_t>(pool_threads(), chunks);
  TORCH_CHECK(chunks < static_cast<int64_t>(kField), "too many chunks: ", chunks);
  auto guarded = [&](int64_t c) {  // a loop inside a chunk runs on its thread alone
    struct Nested {  // restores the flag even when fn throws
      bool outer = inside_chunk;
      Nested() { inside_chunk = true; }
      ~Nested() { inside_chunk = outer; }
    } nested;
    fn(c);
  };
  if (threads <= 1) {
    for (int64_t c = 0; c < chunks; ++c) guarded(c);
    return;
  }
  const std::function<void(int64_t)> job = guarded;
  the_pool().run(chunks, threads, job);
}

}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  // See kernel_thread above: the engine's thread calls it once, with torch's thread count.
  m.def("kernel_thread(int threads) -> ()", &pagedllm::kernel_thread);
  // The threads a loop started on the calling thread would use now.
  m.def("pool_threads() -> int", &pagedllm::pool_threads);
}

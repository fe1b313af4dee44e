// See thread_pool.h for why the kernels run on a pool of their own.
//
// The pool's state is one 64-bit word: a generation number (one per call) in the high 32
// bits, a "closed" bit, and the number of workers inside the current call's body. A worker
// joins a call by raising the count with a compare-and-swap that also checks the generation
// is current and open, so it can never enter a call that has ended; the caller closes the
// call when its own share is done and waits for the count to fall to zero.

#include "thread_pool.h"

#include <ATen/Parallel.h>
#include <pthread.h>
#include <torch/library.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "op_library.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace baton {
namespace {

constexpr uint64_t kClosed = uint64_t{1} << 31;
constexpr uint64_t kCountMask = kClosed - 1;
constexpr auto kSpin = std::chrono::microseconds(50);  // pause-spinning: kernels of one step
constexpr auto kYield = std::chrono::microseconds(2000);  // then yielding: a step's Python work

inline uint64_t generation(uint64_t s) { return s >> 32; }
inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

struct Pool {
  std::atomic<uint64_t> state{kClosed};  // generation 0, closed: nothing to join
  // The current call's; written while no worker is inside, published by `state`.
  std::atomic<void (*)(void*)> fn{nullptr};
  std::atomic<void*> ctx{nullptr};
  std::atomic<uint64_t> max_workers{0};
  std::mutex caller;         // one call at a time
  std::mutex sleep_mutex;
  std::condition_variable wake;
  std::atomic<int> sleepers{0};
  std::atomic<int64_t> joins{0};  // worker entries into a call's body, for the tests
  int num_workers = 0;

  void grow(int workers) {
    for (; num_workers < workers; ++num_workers) std::thread([this] { work(); }).detach();
  }

  // Waits for a generation other than `seen`: spins, then yields, then sleeps.
  uint64_t next(uint64_t seen) {
    const auto start = std::chrono::steady_clock::now();
    for (uint32_t i = 1;; ++i) {
      const uint64_t s = state.load(std::memory_order_acquire);
      if (generation(s) != seen) return s;
      if ((i & 63) != 0) {
        cpu_relax();
        continue;
      }
      const auto waited = std::chrono::steady_clock::now() - start;
      if (waited < kSpin) continue;
      if (waited < kYield) {
        sched_yield();
        continue;
      }
      std::unique_lock<std::mutex> lock(sleep_mutex);
      sleepers.fetch_add(1);
      wake.wait(lock, [&] { return generation(state.load()) != seen; });
      sleepers.fetch_sub(1);
      return state.load(std::memory_order_acquire);
    }
  }

  void work() {
    uint64_t seen = 0;
    for (;;) {
      uint64_t s = next(seen);
      seen = generation(s);
      // Join unless the call has closed (or a newer one began) or has its workers already.
      while (generation(s) == seen && !(s & kClosed) &&
             (s & kCountMask) < max_workers.load(std::memory_order_relaxed)) {
        if (state.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
          joins.fetch_add(1, std::memory_order_relaxed);
          fn.load(std::memory_order_relaxed)(ctx.load(std::memory_order_relaxed));
          state.fetch_sub(1, std::memory_order_release);
          break;
        }
      }
    }
  }

  void run(int64_t num_threads, void (*f)(void*), void* c) {
    grow(static_cast<int>(num_threads) - 1);
    fn.store(f, std::memory_order_relaxed);
    ctx.store(c, std::memory_order_relaxed);
    max_workers.store(static_cast<uint64_t>(num_threads - 1), std::memory_order_relaxed);
    const uint64_t s = state.load(std::memory_order_relaxed);
    state.store((generation(s) + 1) << 32);  // open, nobody inside (seq_cst: pairs with sleepers)
    if (sleepers.load() > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex);
      wake.notify_all();
    }
    struct Close {  // also when f throws: no worker may outlive the caller's frame
      Pool* pool;
      ~Close() {
        pool->state.fetch_or(kClosed, std::memory_order_acq_rel);
        // A worker still inside holds an item; yield now and then in case it waits for
        // this very core.
        for (uint32_t i = 1; (pool->state.load(std::memory_order_acquire) & kCountMask) != 0; ++i) {
          if ((i & 1023) == 0) sched_yield();
          else cpu_relax();
        }
      }
    } close{this};
    f(c);
  }
};

Pool* the_pool = nullptr;  // leaked on purpose: detached workers use it until the process ends
std::mutex pool_mutex;

std::atomic<bool> enabled{[] {
  const char* v = std::getenv("BATON_CPU_THREAD_POOL");
  return v != nullptr && std::strcmp(v, "1") == 0;
}()};

Pool* pool() {
  std::lock_guard<std::mutex> lock(pool_mutex);
  if (the_pool == nullptr) {
    the_pool = new Pool();
    // A forked child has none of the workers: it starts a pool of its own on first use.
    pthread_atfork(nullptr, nullptr, [] { the_pool = nullptr; });
  }
  return the_pool;
}

}  // namespace

void run_on_threads_impl(int64_t num_threads, void (*fn)(void*), void* ctx) {
  if (num_threads <= 1) {
    fn(ctx);
    return;
  }
  if (enabled.load(std::memory_order_relaxed)) {
    Pool* p = pool();
    std::unique_lock<std::mutex> lock(p->caller, std::try_to_lock);
    if (lock.owns_lock()) {
      p->run(num_threads, fn, ctx);
      return;
    }
  }
  at::parallel_for(0, num_threads, 1, [&](int64_t, int64_t) { fn(ctx); });
}

bool thread_pool_enabled() { return enabled.load(std::memory_order_relaxed); }

// Turns the pool on or off for later calls; returns whether it was on.
bool set_thread_pool(bool on) { return enabled.exchange(on); }

// How many times a pool worker has joined a call, since the process (or its pool) began.
int64_t thread_pool_joins() { return pool()->joins.load(); }

}  // namespace baton

TORCH_LIBRARY_FRAGMENT(BATON_CPU_LIB, m) {
  m.def("set_thread_pool(bool on) -> bool", &baton::set_thread_pool);
  m.def("thread_pool_joins() -> int", &baton::thread_pool_joins);
}

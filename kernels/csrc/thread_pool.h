// Baton's own pool of kernel threads: `baton::run_on_threads(n, body)` runs body() on the
// calling thread and on up to n - 1 pool workers, and returns once every thread that entered
// body has left it. The kernels' bodies take work items from a shared counter, so whoever
// is running does the work; `baton::parallel_for` does the same for a range of rows.
//
// Why not at::parallel_for (OpenMP): an OpenMP region ends at a barrier that every thread of
// the team must reach, so when another process (the gateway, the client, Ray) preempts one
// of the engine's two threads, the other waits at the barrier until the preempted thread
// runs again, even if that thread took no work: served on 2 cores, decode steps ran much
// slower than the same engine alone (docs/benchmarks.md, sessions 23 and 26). Here a worker
// that has not started when the work runs out does not join: the caller waits only for
// workers that hold an item.
//
// Idle workers spin briefly (the next kernel of a step follows within microseconds), then
// yield the core between spins (a step's Python work takes a millisecond or two, and other
// processes may want the core meanwhile), then sleep until the next call.
//
// The pool is on where BATON_CPU_THREAD_POOL=1, or after `set_thread_pool(true)`. The
// engine's own process (services/engine/api/engine_child.py) sets it, with OpenMP's passive
// wait policy: an OpenMP worker spinning after torch's own parallel ops would take the core
// that the pool's worker needs. Where the pool is off, and for a call made while another
// thread of the process is using the pool, the kernels run on at::parallel_for.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <utility>

namespace baton {

void run_on_threads_impl(int64_t num_threads, void (*fn)(void*), void* ctx);
bool thread_pool_enabled();

template <typename Body>
void run_on_threads(int64_t num_threads, Body&& body) {
  using B = std::remove_reference_t<Body>;
  run_on_threads_impl(num_threads, [](void* ctx) { (*static_cast<B*>(ctx))(); }, static_cast<void*>(&body));
}

// at::parallel_for's contract (f(b, e) over [begin, end), at least `grain` per piece, the
// calling thread alone when the range is smaller) on the pool where it is on: the range is
// cut into pieces, about four per thread, taken from a shared counter.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (!thread_pool_enabled()) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  const int64_t n = end - begin;
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + grain - 1) / grain);
  if (threads <= 1) {
    f(begin, end);
    return;
  }
  const int64_t piece = std::max<int64_t>(grain, (n + 4 * threads - 1) / (4 * threads));
  std::atomic<int64_t> next{begin};
  run_on_threads(threads, [&] {
    for (int64_t b = next.fetch_add(piece); b < end; b = next.fetch_add(piece)) f(b, std::min(end, b + piece));
  });
}

}  // namespace baton

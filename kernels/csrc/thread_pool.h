// Baton's own pool of kernel threads: `baton::run_on_threads(n, body)` runs body() on the
// calling thread and on up to n - 1 pool workers, and returns once every thread that entered
// body has left it. The kernels' bodies take work items from a shared counter, so whoever
// is running does the work.
//
// Why not at::parallel_for (OpenMP): an OpenMP region ends at a barrier that every thread of
// the team must reach, so when another process (the gateway, the client, Ray) preempts one
// of the engine's two threads, the other waits at the barrier until the preempted thread
// runs again, even if that thread took no work. Served on 2 cores, decode steps ran ~44%
// slower than the same engine alone (docs/benchmarks.md, session 23). Here a worker that has
// not started when the work runs out simply does not join: the caller waits only for
// workers that hold an item.
//
// Idle workers spin briefly (the next kernel of a step follows within microseconds), then
// yield the core between spins (a step's Python work takes a millisecond or two, and other
// processes may want the core meanwhile), then sleep until the next call.
// The pool is on where BATON_CPU_THREAD_POOL=1 (the engine's own process sets it, with
// OpenMP's passive wait policy: an OpenMP worker spinning after torch's own parallel ops
// takes the core the pool's worker needs, which made the pool's decode step ~20% slower than
// OpenMP's), or after `set_thread_pool(true)`. Otherwise, and for a call made while another
// thread of the process is using the pool, the bodies run on at::parallel_for.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

namespace baton {

void run_on_threads_impl(int64_t num_threads, void (*fn)(void*), void* ctx);

template <typename Body>
void run_on_threads(int64_t num_threads, Body&& body) {
  using B = std::remove_reference_t<Body>;
  run_on_threads_impl(num_threads, [](void* ctx) { (*static_cast<B*>(ctx))(); }, static_cast<void*>(&body));
}

}  // namespace baton

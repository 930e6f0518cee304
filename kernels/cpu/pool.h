// A work-sharing pool for the CPU kernels: parallel_for(n, f) runs f(0..n-1) on the calling thread and the
// pool's workers, each claiming the next index as it becomes free.
//
// Why not OpenMP: an OpenMP region starts and ends with the whole team. With passive waiting (needed on
// shared cores) waking the sleeping team costs tens of microseconds per region in a VM, and a decode step
// of one sequence runs ~150 regions (14 ms of a 36 ms step measured); with spinning, a team member that the
// OS has preempted stalls every region (10-70x slower steps). Here the caller never waits for a worker to
// start: it claims indices itself, a sleeping or preempted worker simply takes none, and the caller waits
// only for indices a worker has already claimed. Workers spin briefly between calls (yielding the core
// to anyone runnable), then sleep.
#pragma once
#include <cstdint>
#include <type_traits>

namespace pagedserve {

void parallel_for(int64_t n, void (*fn)(void*, int64_t), void* ctx);

template <typename F>
void parallel_for(int64_t n, F&& f) {
  using Fn = typename std::remove_reference<F>::type;
  parallel_for(n, [](void* ctx, int64_t i) { (*static_cast<Fn*>(ctx))(i); }, static_cast<void*>(&f));
}

}  // namespace pagedserve

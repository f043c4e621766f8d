// Work split over XLA's intra-op threads, for ppojax's FFI handlers (included by stacked_gemm.cc and
// adam_in_place.cc; the builds add this folder to the include path).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ppojax {

// share(i) for every i in [0, shares), on the calling thread and XLA's intra-op threads (oneDNN's and OpenMP's own
// threads would compete with XLA's for the cores between calls). Shares are claimed, never assigned: the caller
// runs those no other thread has taken and waits only for shares already running, so it cannot wait on a task
// queued behind a busy pool; a task that starts after the last share was claimed finds nothing to do.
template <typename F>
void Parallel(xla::ffi::ThreadPool& pool, int shares, const F& share) {
  struct Claims {
    std::atomic<int> next{0}, done{0};
  };
  auto claims = std::make_shared<Claims>();
  auto work = [claims, &share, shares] {  // `share` is only called while the caller still waits
    for (int i; (i = claims->next.fetch_add(1)) < shares;) {
      share(i);
      claims->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int helpers = static_cast<int>(std::min<int64_t>(pool.num_threads(), shares - 1));
  for (int h = 0; h < helpers; ++h) pool.Schedule(decltype(work)(work));  // a copy each
  work();
  // the shares left are running: spin briefly, then give the core away (a busy machine may have descheduled them)
  for (int spins = 0; claims->done.load(std::memory_order_acquire) < shares; ++spins)
    spins < 4096 ? _mm_pause() : std::this_thread::yield();
}

}  // namespace ppojax

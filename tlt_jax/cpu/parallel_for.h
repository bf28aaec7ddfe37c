// ParallelFor over XLA's intra-op thread pool, for the CPU kernels called through the FFI.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace tlt_cpu {

// Runs body(begin, end) over [0, n) split into `chunks` ranges, which the caller and the
// pool's threads claim in turn (a few per thread even out a thread that starts late). The
// caller waits only for chunks another thread has claimed (running), never for a task still
// queued: two calls on a two-thread pool cannot wait on each other.
inline void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, int64_t chunks_per_thread,
                        std::function<void(int64_t, int64_t)> body) {
  struct Job {
    std::function<void(int64_t, int64_t)> body;
    int64_t n, chunk, chunks;
    std::atomic<int64_t> next{0}, done{0};

    void work() {
      for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
        body(c * chunk, std::min(n, (c + 1) * chunk));
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  if (n <= 0) return;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  auto job = std::make_shared<Job>();
  job->body = std::move(body);
  job->n = n;
  job->chunk = std::max<int64_t>(1, n / (chunks_per_thread * threads));
  job->chunks = (n + job->chunk - 1) / job->chunk;
  for (int64_t t = 1; t < std::min(threads, job->chunks); ++t)
    pool.Schedule([job] { job->work(); });
  job->work();
  // Yield rather than spin: with more threads than cores (parallel test processes) the
  // thread we wait for may need this core.
  while (job->done.load(std::memory_order_acquire) < job->chunks) std::this_thread::yield();
}

}  // namespace tlt_cpu

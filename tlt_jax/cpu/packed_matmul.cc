// y_i[M, N_i] = x[M, K] @ w_i for float32 weights packed as [ceil(N / 24), K, 24] column panels
// (zero-padded), for the rollout's small-M matmuls on x86 CPUs with AVX2 and FMA.
//
// Why: at 4-16 rows XLA's CPU dot (like OpenBLAS) runs 2-3x below the weights' streaming
// rate, while one contiguous panel per 24 output columns streams at the GEMV rate and
// serves every row from registers. Each output element is one FMA chain over k in order,
// whatever M is, so a row gets the same bits alone (decode) or with others (SD verify).
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 24;  // output columns per panel: 3 AVX registers
constexpr int64_t kRows = 4;    // rows of x per pass: 12 accumulators of 16 registers

// y[0:R, n0:n0+24] (only `width` columns kept) from x[0:R, :] and one panel [K, 24].
template <int R>
void panel_rows(const float* x, const float* panel, float* y, int64_t k, int64_t n,
                int64_t n0, int64_t width) {
  __m256 acc[R][3];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int j = 0; j < 3; ++j) acc[r][j] = _mm256_setzero_ps();
  const float* w = panel;
  for (int64_t i = 0; i < k; ++i, w += kPanel) {
    const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8),
                 w2 = _mm256_loadu_ps(w + 16);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 xi = _mm256_broadcast_ss(x + r * k + i);
      acc[r][0] = _mm256_fmadd_ps(xi, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xi, w1, acc[r][1]);
      acc[r][2] = _mm256_fmadd_ps(xi, w2, acc[r][2]);
    }
  }
  // Column j of the panel is kept where j < width: all of them but in N's last panel.
  const __m256i first = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  // (Loops over registers unrolled: GCC otherwise spills the accumulators every step.)
#pragma GCC unroll 3
  for (int j = 0; j < 3; ++j) {
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(width - 8 * j)),
                                            first);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) _mm256_maskstore_ps(y + r * n + n0 + 8 * j, keep, acc[r][j]);
  }
}

void panel(const float* x, const float* w, float* y, int64_t m, int64_t k, int64_t n,
           int64_t p) {
  const float* block = w + p * k * kPanel;
  const int64_t n0 = p * kPanel, width = std::min(kPanel, n - n0);
  int64_t r = 0;
  for (; r + kRows <= m; r += kRows) panel_rows<kRows>(x + r * k, block, y + r * n, k, n, n0, width);
  switch (m - r) {
    case 3: panel_rows<3>(x + r * k, block, y + r * n, k, n, n0, width); break;
    case 2: panel_rows<2>(x + r * k, block, y + r * n, k, n, n0, width); break;
    case 1: panel_rows<1>(x + r * k, block, y + r * n, k, n, n0, width); break;
  }
}

constexpr int kMaxWeights = 4;  // weights per call (q, k, v; gate, up)

// The panels of all weights, in order, split into chunks that the caller and the pool's
// threads claim in turn: one call for several weights of one input costs one fork-join
// (at decode, ~10 us of a 25-100 us matmul). The caller waits only for chunks another
// thread has claimed (running), never for a task still queued: two calls on a two-thread
// pool cannot wait on each other.
struct Job {
  const float* x;
  int64_t m, k, weights;
  const float* w[kMaxWeights];
  float* y[kMaxWeights];
  int64_t n[kMaxWeights];
  int64_t first[kMaxWeights + 1];  // weight i holds global panels [first[i], first[i + 1])
  int64_t chunk, chunks;
  std::atomic<int64_t> next{0}, done{0};

  void work() {
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      int64_t i = 0;
      for (int64_t g = c * chunk, end = std::min(first[weights], g + chunk); g < end; ++g) {
        while (g >= first[i + 1]) ++i;
        panel(x, w[i], y[i], m, k, n[i], g - first[i]);
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// x [M, K] and weights [ceil(N_i / 24), K, 24] -> y_i [M, N_i].
ffi::Error PackedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws,
                        ffi::RemainingRets ys) {
  if (ws.size() != ys.size() || ws.size() < 1 || ws.size() > kMaxWeights)
    return ffi::Error::InvalidArgument("packed_matmul: 1 to 4 weights, one result each");
  auto job = std::make_shared<Job>();
  job->x = x.typed_data();
  job->weights = static_cast<int64_t>(ws.size());
  job->first[0] = 0;
  for (int64_t i = 0; i < job->weights; ++i) {
    auto w = ws.get<ffi::BufferR3<ffi::F32>>(i);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !y.has_value())
      return ffi::Error::InvalidArgument("packed_matmul: weights and results are float32");
    const auto w_dims = w->dimensions();
    const int64_t k = w_dims[1], n = (*y)->dimensions().back();
    if (i == 0) job->k = k;
    if (w_dims[2] != kPanel || k != job->k || x.dimensions().back() != k ||
        (n + kPanel - 1) / kPanel != w_dims[0])
      return ffi::Error::InvalidArgument("packed_matmul: operand shapes do not match");
    job->w[i] = w->typed_data();
    job->y[i] = (*y)->typed_data();
    job->n[i] = n;
    job->first[i + 1] = job->first[i] + w_dims[0];
  }
  job->m = x.element_count() / job->k;
  const int64_t panels = job->first[job->weights];
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // A few chunks per thread even out a thread that starts late.
  job->chunk = std::max<int64_t>(1, panels / (8 * threads));
  job->chunks = (panels + job->chunk - 1) / job->chunk;
  for (int64_t t = 1; t < std::min(threads, job->chunks); ++t)
    pool.Schedule([job] { job->work(); });
  job->work();
  // Yield rather than spin: with more threads than cores (parallel test processes) the
  // thread we wait for may need this core.
  while (job->done.load(std::memory_order_acquire) < job->chunks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TltPackedMatmul, PackedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

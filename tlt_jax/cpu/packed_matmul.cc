// y_i[M, N_i] = x[M, K] @ w_i for float32 weights packed as [ceil(N / 24), K, 24] column panels
// (zero-padded), for the rollout's small-M matmuls on x86 CPUs with AVX2 and FMA (and an
// AVX-512 path where the CPU has it).
//
// Why: at 4-16 rows XLA's CPU dot (like OpenBLAS) runs 2-3x below the weights' streaming
// rate, while one contiguous panel per 24 output columns streams at the GEMV rate and
// serves the rows from registers (more rows than the registers hold: MultiplyPanel). Each
// output element is one FMA chain over k in order, whatever M is, so a row gets the same
// bits alone (decode) or with others (SD verify).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 24;  // output columns per panel: 3 AVX registers

// One pass: R rows of x times `steps` rows (a block of k) of one panel.
struct Pass {
  const float* x;          // the rows' first k of the block; rows x_stride apart
  int64_t x_stride;
  const float* w;          // the panel's rows of the block, kPanel floats each
  int64_t steps;
  const float* partial;    // the sums over earlier blocks, rows of kPanel (nullptr: none)
  float* out;              // where the sums go, rows out_stride apart, `width` columns kept
  int64_t out_stride, width;
  const float* prefetch;   // step i prefetches prefetch + i * prefetch_stride, up to `last`
  int64_t prefetch_stride;
  const float* last;
};

const float* PrefetchAt(const Pass& p, int64_t i) {
  return std::min(p.prefetch + i * p.prefetch_stride, p.last);
}

// AVX2: a panel row is three 8-wide registers; 4 rows' 12 accumulators fill the 16.
struct Avx2 {
  static constexpr int kRows = 4;

  template <int R>
  static void Run(const Pass& p) {
    __m256 acc[R][3];
    // (Loops over registers unrolled: GCC otherwise spills the accumulators every step.)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
      for (int j = 0; j < 3; ++j)
        acc[r][j] = p.partial != nullptr ? _mm256_loadu_ps(p.partial + r * kPanel + 8 * j)
                                         : _mm256_setzero_ps();
    const float* w = p.w;
    for (int64_t i = 0; i < p.steps; ++i, w += kPanel) {
      const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8),
                   w2 = _mm256_loadu_ps(w + 16);
      _mm_prefetch(reinterpret_cast<const char*>(PrefetchAt(p, i)), _MM_HINT_T0);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 xi = _mm256_broadcast_ss(p.x + r * p.x_stride + i);
        acc[r][0] = _mm256_fmadd_ps(xi, w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(xi, w1, acc[r][1]);
        acc[r][2] = _mm256_fmadd_ps(xi, w2, acc[r][2]);
      }
    }
    // Column j of the panel is kept where j < width: all of them but in N's last panel.
    const __m256i first = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
#pragma GCC unroll 3
    for (int j = 0; j < 3; ++j) {
      const __m256i keep = _mm256_cmpgt_epi32(
          _mm256_set1_epi32(static_cast<int>(p.width - 8 * j)), first);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
        _mm256_maskstore_ps(p.out + r * p.out_stride + 8 * j, keep, acc[r][j]);
    }
  }
};

// AVX-512 where the CPU has it: a panel row is one 16-wide and one 8-wide register, two
// FMAs for its 24 columns instead of three, and the 32 registers hold 8 rows' accumulators.
// Each output element is the same FMA chain: the same bits as the AVX2 path.
struct Avx512 {
  static constexpr int kRows = 8;

  template <int R>
  __attribute__((target("avx512f,avx512vl"))) static void Run(const Pass& p) {
    const int64_t width = p.width;
    const __mmask16 keep_lo =
        width >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << width) - 1);
    const __mmask8 keep_hi =
        width <= 16 ? 0 : static_cast<__mmask8>((1u << (width - 16)) - 1);
    __m512 lo[R];
    __m256 hi[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      lo[r] = p.partial != nullptr ? _mm512_loadu_ps(p.partial + r * kPanel)
                                   : _mm512_setzero_ps();
      hi[r] = p.partial != nullptr ? _mm256_loadu_ps(p.partial + r * kPanel + 16)
                                   : _mm256_setzero_ps();
    }
    const float* w = p.w;
    for (int64_t i = 0; i < p.steps; ++i, w += kPanel) {
      const __m512 w0 = _mm512_loadu_ps(w);
      const __m256 w1 = _mm256_loadu_ps(w + 16);
      _mm_prefetch(reinterpret_cast<const char*>(PrefetchAt(p, i)), _MM_HINT_T0);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 xi = _mm512_set1_ps(p.x[r * p.x_stride + i]);
        lo[r] = _mm512_fmadd_ps(xi, w0, lo[r]);
        hi[r] = _mm256_fmadd_ps(_mm512_castps512_ps256(xi), w1, hi[r]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      _mm512_mask_storeu_ps(p.out + r * p.out_stride, keep_lo, lo[r]);
      _mm256_mask_storeu_ps(p.out + r * p.out_stride + 16, keep_hi, hi[r]);
    }
  }
};

// Runs a pass of `rows` (1 to Path::kRows) rows.
template <class Path, int R = Path::kRows>
void RunPass(int64_t rows, const Pass& p) {
  if constexpr (R > 1)
    if (rows < R) return RunPass<Path, R - 1>(rows, p);
  Path::template Run<R>(p);
}

// A lone pass prefetches its panel this many floats (4 KB) ahead: with the hardware's
// prefetch alone, the FMAs waited on memory (SmolLM2's layers from memory, 2 cores: at 8
// rows the AVX-512 path ran 1.02x the AVX2 path without it, 1.31x with it, 3-12 KB ahead
// alike; the AVX2 path at 4 rows 1.14x faster with it).
constexpr int64_t kAhead = 1024;
// Above one pass's rows, the panel is taken kBlock rows of k at a time (6 KB, L1-resident),
// every pass over a block before the next, the passes together prefetching the block
// kBlocksAhead ahead; up to kGroupRows rows share a pass over memory.
constexpr int64_t kBlock = 64, kBlocksAhead = 2, kGroupRows = 64;

// y[0:m, n0:n0 + width] from x[0:m, :] and one panel [K, 24]. Up to Path::kRows rows, one
// pass streams the panel. Above that, a pass per kRows rows over the whole panel would read
// it from memory once and then from cache while the memory bus idles (at 16-40 rows the
// weights' time and the FMAs' added up); taken a block at a time, the FMAs of all passes
// overlap the stream (SmolLM2's weight matmuls from memory, 2 cores: 1.12-1.20x at 12-40
// rows on the AVX-512 path, 1.31-1.43x at 8-40 on AVX2;
// benchmarks/results/packed_matmul_k_blocks_cpu.json). The sums between blocks stay in a scratch panel, not in y, whose
// boundary lines another thread's panels share; a float stored and reloaded is the same
// chain, so the bits do not depend on the blocking.
template <class Path>
void MultiplyPanel(const float* x, const float* panel, float* y, int64_t m, int64_t k,
                   int64_t n, int64_t width, const float* last) {
  if (m <= Path::kRows)
    return RunPass<Path>(m, Pass{x, k, panel, k, nullptr, y, n, width, panel + kAhead, kPanel,
                                 last});
  alignas(64) float partial[kGroupRows * kPanel];
  for (int64_t r0 = 0; r0 < m; r0 += kGroupRows) {
    const int64_t rows = std::min(kGroupRows, m - r0);
    const int64_t passes = (rows + Path::kRows - 1) / Path::kRows;
    const int64_t share = (kPanel + passes - 1) / passes;  // each pass's floats ahead a step
    for (int64_t k0 = 0; k0 < k; k0 += kBlock) {
      const int64_t steps = std::min(kBlock, k - k0);
      const bool first = k0 == 0, final = k0 + steps == k;
      const float* ahead = panel + (k0 + kBlocksAhead * kBlock) * kPanel;
      for (int64_t i = 0; i < passes; ++i) {
        const int64_t r = r0 + i * Path::kRows;
        float* sums = partial + i * Path::kRows * kPanel;
        RunPass<Path>(std::min<int64_t>(Path::kRows, m - r),
                      Pass{x + r * k + k0, k, panel + k0 * kPanel, steps,
                           first ? nullptr : sums, final ? y + r * n : sums,
                           final ? n : kPanel, final ? width : kPanel,
                           ahead + i * share * steps, share, last});
      }
    }
  }
}

// Whether this CPU takes the AVX-512 path; TLT_JAX_CPU_AVX512=0 keeps the AVX2 path (to
// test and time it against the other on one machine).
bool UseAvx512() {
  static const bool use = [] {
    __builtin_cpu_init();
    const char* setting = std::getenv("TLT_JAX_CPU_AVX512");
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           !(setting != nullptr && std::string(setting) == "0");
  }();
  return use;
}

// Panel p of w into y. next: whether this thread multiplies panel p + 1 next (prefetching
// into it pays; past it, the lines are another thread's).
void panel(const float* x, const float* w, float* y, int64_t m, int64_t k, int64_t n,
           int64_t p, bool next) {
  const float* block = w + p * k * kPanel;
  const int64_t n0 = p * kPanel, width = std::min(kPanel, n - n0);
  const float* last = block + (next ? 2 : 1) * k * kPanel - 16;
  if (UseAvx512()) return MultiplyPanel<Avx512>(x, block, y + n0, m, k, n, width, last);
  MultiplyPanel<Avx2>(x, block, y + n0, m, k, n, width, last);
}

constexpr int kMaxWeights = 4;  // weights per call (q, k, v; gate, up)

// x [M, K] and weights [ceil(N_i / 24), K, 24] -> y_i [M, N_i]. The panels of all weights,
// in order, are shared out among the threads: one call for several weights of one input
// costs one fork-join (at decode, ~10 us of a 25-100 us matmul).
ffi::Error PackedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws,
                        ffi::RemainingRets ys) {
  const int64_t count = static_cast<int64_t>(ws.size());
  if (count != static_cast<int64_t>(ys.size()) || count < 1 || count > kMaxWeights)
    return ffi::Error::InvalidArgument("packed_matmul: 1 to 4 weights, one result each");
  const float* w[kMaxWeights];
  float* y[kMaxWeights];
  int64_t n[kMaxWeights];
  int64_t first[kMaxWeights + 1] = {0};  // weight i: global panels [first[i], first[i + 1])
  const int64_t k = x.dimensions().back();
  for (int64_t i = 0; i < count; ++i) {
    auto wi = ws.get<ffi::BufferR3<ffi::F32>>(i);
    auto yi = ys.get<ffi::Buffer<ffi::F32>>(i);
    if (!wi.has_value() || !yi.has_value())
      return ffi::Error::InvalidArgument("packed_matmul: weights and results are float32");
    const auto w_dims = wi->dimensions();
    n[i] = (*yi)->dimensions().back();
    if (w_dims[2] != kPanel || w_dims[1] != k || (n[i] + kPanel - 1) / kPanel != w_dims[0])
      return ffi::Error::InvalidArgument("packed_matmul: operand shapes do not match");
    w[i] = wi->typed_data();
    y[i] = (*yi)->typed_data();
    first[i + 1] = first[i] + w_dims[0];
  }
  const float* xs = x.typed_data();
  const int64_t m = x.element_count() / k;
  tlt_cpu::ParallelFor(pool, first[count], 8, [&](int64_t begin, int64_t end) {
    int64_t i = 0;
    for (int64_t g = begin; g < end; ++g) {
      while (g >= first[i + 1]) ++i;
      // next: whether this thread's next panel is the following one of the same weight.
      panel(xs, w[i], y[i], m, k, n[i], g - first[i], g + 1 < std::min(end, first[i + 1]));
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TltPackedMatmul, PackedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

// y_i[M, N_i] = x[M, K] @ w_i for float32 weights packed as [ceil(N / 24), K, 24] column panels
// (zero-padded), for the rollout's small-M matmuls on x86 CPUs with AVX2 and FMA (and an
// AVX-512 path where the CPU has it).
//
// Why: at 4-16 rows XLA's CPU dot (like OpenBLAS) runs 2-3x below the weights' streaming
// rate, while one contiguous panel per 24 output columns streams at the GEMV rate and
// serves every row from registers. Each output element is one FMA chain over k in order,
// whatever M is, so a row gets the same bits alone (decode) or with others (SD verify).
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

// The same with AVX-512 where the CPU has it: a panel row is one 16-wide and one 8-wide
// register, two FMAs for its 24 columns instead of three, and the 32 registers hold the
// accumulators of 8 rows, so a panel is read from cache half as often. Each output element
// is the same FMA chain: the same bits as the AVX2 path.
constexpr int64_t kRows512 = 8;
// A panel's first pass prefetches it this many floats (4 KB) ahead: with the hardware's
// prefetch alone, 8 rows' FMAs waited on memory (SmolLM2's layers from memory, 2 cores:
// 1.02x the AVX2 path at 8 rows without it, 1.31x with it; 3-12 KB ahead alike).
constexpr int64_t kAhead = 1024;

template <int R>
__attribute__((target("avx512f,avx512vl"))) void panel_rows_512(
    const float* x, const float* panel, float* y, int64_t k, int64_t n, int64_t n0,
    int64_t width, const float* prefetch) {
  __m512 lo[R];
  __m256 hi[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    lo[r] = _mm512_setzero_ps();
    hi[r] = _mm256_setzero_ps();
  }
  const float* w = panel;
  for (int64_t i = 0; i < k; ++i, w += kPanel) {
    const __m512 w0 = _mm512_loadu_ps(w);
    const __m256 w1 = _mm256_loadu_ps(w + 16);
    _mm_prefetch(reinterpret_cast<const char*>(prefetch != nullptr ? prefetch + 16 * i
                                                                   : w + kAhead),
                 _MM_HINT_T0);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xi = _mm512_set1_ps(x[r * k + i]);
      lo[r] = _mm512_fmadd_ps(xi, w0, lo[r]);
      hi[r] = _mm256_fmadd_ps(_mm512_castps512_ps256(xi), w1, hi[r]);
    }
  }
  const __mmask16 keep_lo = width >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << width) - 1);
  const __mmask8 keep_hi = width <= 16 ? 0 : static_cast<__mmask8>((1u << (width - 16)) - 1);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(y + r * n + n0, keep_lo, lo[r]);
    _mm256_mask_storeu_ps(y + r * n + n0 + 16, keep_hi, hi[r]);
  }
}

// next: the panel this thread multiplies after this one (nullptr: none). A pass after the
// first reads this panel from cache and leaves the memory bus idle, so it prefetches a
// line of the next panel every k step (two passes cover it). With both prefetches, all of
// SmolLM2's weight matmuls from memory on 2 cores ran 1.13x faster than the AVX2 path at 4
// rows and 1.29-1.39x at 8 to 80 (a batch-16 verify), as fast at one row
// (benchmarks/packed_matmul_paths.py).
__attribute__((target("avx512f,avx512vl"))) void panel_512(
    const float* x, const float* block, float* y, int64_t m, int64_t k, int64_t n,
    int64_t n0, int64_t width, const float* next) {
  // Pass 0 prefetches its own panel ahead (nullptr), passes 1 and 2 a part of the next.
  int64_t r = 0, pass = 0;
  const auto prefetch = [&] {
    return next == nullptr || pass == 0 || pass > 2 ? nullptr : next + 16 * k * (pass - 1);
  };
  for (; r + kRows512 <= m; r += kRows512, ++pass)
    panel_rows_512<kRows512>(x + r * k, block, y + r * n, k, n, n0, width, prefetch());
  const float* xr = x + r * k;
  float* yr = y + r * n;
  switch (m - r) {
    case 7: panel_rows_512<7>(xr, block, yr, k, n, n0, width, prefetch()); break;
    case 6: panel_rows_512<6>(xr, block, yr, k, n, n0, width, prefetch()); break;
    case 5: panel_rows_512<5>(xr, block, yr, k, n, n0, width, prefetch()); break;
    case 4: panel_rows_512<4>(xr, block, yr, k, n, n0, width, prefetch()); break;
    case 3: panel_rows_512<3>(xr, block, yr, k, n, n0, width, prefetch()); break;
    case 2: panel_rows_512<2>(xr, block, yr, k, n, n0, width, prefetch()); break;
    case 1: panel_rows_512<1>(xr, block, yr, k, n, n0, width, prefetch()); break;
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

void panel(const float* x, const float* w, float* y, int64_t m, int64_t k, int64_t n,
           int64_t p, bool next) {
  const float* block = w + p * k * kPanel;
  const int64_t n0 = p * kPanel, width = std::min(kPanel, n - n0);
  if (UseAvx512())
    return panel_512(x, block, y, m, k, n, n0, width, next ? block + k * kPanel : nullptr);
  int64_t r = 0;
  for (; r + kRows <= m; r += kRows) panel_rows<kRows>(x + r * k, block, y + r * n, k, n, n0, width);
  switch (m - r) {
    case 3: panel_rows<3>(x + r * k, block, y + r * n, k, n, n0, width); break;
    case 2: panel_rows<2>(x + r * k, block, y + r * n, k, n, n0, width); break;
    case 1: panel_rows<1>(x + r * k, block, y + r * n, k, n, n0, width); break;
  }
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

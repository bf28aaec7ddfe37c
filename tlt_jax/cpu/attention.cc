// Attention of T new tokens (a decode step: 1; SD verification: a draft chain or tree) against
// each row's KV cache plus themselves, float32, on x86 CPUs with AVX2 and FMA: what
// tlt_jax.models.attention.attend computes, with its arguments and layout.
//
// Why: per kv head a decode step is a [S, D] x [D, G] product (G = 3 query heads), which
// XLA's CPU dot runs at ~8 GB/s, plus a handful of small softmax ops; here one call per
// layer scores, normalizes and sums in one pass per (row, kv head), reading only the cache
// slots some query sees, straight from the cache.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "avx_math.h"
#include "ffi_shapes.h"
#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using tlt_cpu::Dims;
using tlt_cpu::Exp;
using tlt_cpu::Sum;

constexpr int64_t kLanes = 8;
constexpr int64_t kRowBlock = 8;  // query rows (tokens x heads of one kv head) per work item
constexpr float kUnseen = -std::numeric_limits<float>::infinity();

struct Attention {
  // q, out [B, T, H, D]; cache_k, cache_v [B, KH, S, D]; k, v [B, T, KH, D];
  // cache_mask [B, T, S]; new_mask [B, T, T].
  const float *q, *cache_k, *cache_v, *k, *v;
  const bool *cache_mask, *new_mask;
  float* out;
  int64_t b, t, h, kh, s, d;

  int64_t groups() const { return h / kh; }
  int64_t keys() const { return s + t; }  // the cache's slots, then the new tokens
  const float* key(int64_t row, int64_t j, int64_t l) const {
    return l < s ? cache_k + ((row * kh + j) * s + l) * d : k + ((row * t + l - s) * kh + j) * d;
  }
  const float* value(int64_t row, int64_t j, int64_t l) const {
    return l < s ? cache_v + ((row * kh + j) * s + l) * d : v + ((row * t + l - s) * kh + j) * d;
  }
  bool sees(int64_t row, int64_t token, int64_t l) const {
    return l < s ? cache_mask[(row * t + token) * s + l] : new_mask[(row * t + token) * t + l - s];
  }

  // Query rows [first, first + count) of batch row `row`, kv head j; query row i is token
  // i / G of head j * G + i % G.
  void Rows(int64_t row, int64_t j, int64_t first, int64_t count) const {
    const int64_t g = groups(), n = keys(), chunks = d / kLanes;
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
    const float* qs[kRowBlock];
    float* outs[kRowBlock];
    int64_t tokens[kRowBlock];
    for (int64_t i = 0; i < count; ++i) {
      tokens[i] = (first + i) / g;
      const int64_t offset = ((row * t + tokens[i]) * h + j * g + (first + i) % g) * d;
      qs[i] = q + offset;
      outs[i] = out + offset;
    }
    // Scores, kUnseen where a query does not see the key; keys no query sees are skipped.
    std::vector<float> scores(kRowBlock * n, kUnseen);
    std::vector<int64_t> seen;
    seen.reserve(n);
    float top[kRowBlock];
    std::fill(top, top + kRowBlock, kUnseen);
    for (int64_t l = 0; l < n; ++l) {
      bool any = false;
      for (int64_t i = 0; i < count; ++i) any |= sees(row, tokens[i], l);
      if (!any) continue;
      seen.push_back(l);
      const float* kl = key(row, j, l);
      for (int64_t i = 0; i < count; ++i) {
        if (!sees(row, tokens[i], l)) continue;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t c = 0; c < chunks; ++c)
          acc = _mm256_fmadd_ps(_mm256_loadu_ps(kl + c * kLanes),
                                _mm256_loadu_ps(qs[i] + c * kLanes), acc);
        const float score = Sum(acc) * scale;
        scores[i * n + l] = score;
        top[i] = std::max(top[i], score);
      }
    }
    // Weights e^(score - max) over the seen keys (0 where unseen), then their sum; each
    // row's run is padded to whole vectors with unseen keys.
    const int64_t m = static_cast<int64_t>(seen.size());
    std::vector<float> weights(kRowBlock * (m + kLanes), kUnseen);
    float total[kRowBlock];
    for (int64_t i = 0; i < count; ++i) {
      float* w = weights.data() + i * (m + kLanes);
      for (int64_t a = 0; a < m; ++a) w[a] = scores[i * n + seen[a]];
      __m256 sum = _mm256_setzero_ps();
      const __m256 peak = _mm256_set1_ps(top[i]), unseen = _mm256_set1_ps(kUnseen);
      for (int64_t a = 0; a < m; a += kLanes) {
        const __m256 x = _mm256_loadu_ps(w + a);
        const __m256 seen_mask = _mm256_cmp_ps(x, unseen, _CMP_NEQ_OQ);
        const __m256 e = _mm256_and_ps(Exp(_mm256_sub_ps(x, peak)), seen_mask);
        _mm256_storeu_ps(w + a, e);
        sum = _mm256_add_ps(sum, e);
      }
      total[i] = Sum(sum);
    }
    // out = sum of weight x value over the seen keys / the weights' sum.
    std::vector<__m256> acc(kRowBlock * chunks, _mm256_setzero_ps());
    for (int64_t a = 0; a < m; ++a) {
      const float* vl = value(row, j, seen[a]);
      for (int64_t i = 0; i < count; ++i) {
        const float wi = weights[i * (m + kLanes) + a];
        if (wi == 0.0f) continue;
        const __m256 wv = _mm256_set1_ps(wi);
        for (int64_t c = 0; c < chunks; ++c)
          acc[i * chunks + c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(vl + c * kLanes),
                                                acc[i * chunks + c]);
      }
    }
    for (int64_t i = 0; i < count; ++i) {
      if (top[i] == kUnseen) {   // sees nothing: like the reference, every value averaged
        std::vector<__m256> mean(chunks, _mm256_setzero_ps());
        for (int64_t l = 0; l < n; ++l)
          for (int64_t c = 0; c < chunks; ++c)
            mean[c] = _mm256_add_ps(mean[c], _mm256_loadu_ps(value(row, j, l) + c * kLanes));
        const __m256 inv = _mm256_set1_ps(1.0f / static_cast<float>(n));
        for (int64_t c = 0; c < chunks; ++c)
          _mm256_storeu_ps(outs[i] + c * kLanes, _mm256_mul_ps(mean[c], inv));
        continue;
      }
      const __m256 inv = _mm256_set1_ps(1.0f / total[i]);
      for (int64_t c = 0; c < chunks; ++c)
        _mm256_storeu_ps(outs[i] + c * kLanes, _mm256_mul_ps(acc[i * chunks + c], inv));
    }
  }
};

ffi::Error Attend(ffi::ThreadPool pool, ffi::BufferR4<ffi::F32> q,
                  ffi::BufferR4<ffi::F32> cache_k, ffi::BufferR4<ffi::F32> cache_v,
                  ffi::BufferR3<ffi::PRED> cache_mask, ffi::BufferR4<ffi::F32> k,
                  ffi::BufferR4<ffi::F32> v, ffi::BufferR3<ffi::PRED> new_mask,
                  ffi::ResultBufferR4<ffi::F32> out) {
  const auto qd = q.dimensions(), cd = cache_k.dimensions();
  Attention a{q.typed_data(), cache_k.typed_data(), cache_v.typed_data(), k.typed_data(),
              v.typed_data(), cache_mask.typed_data(), new_mask.typed_data(),
              out->typed_data(), qd[0], qd[1], qd[2], cd[1], cd[2], qd[3]};
  if (a.d % kLanes != 0 || a.kh == 0 || a.h % a.kh != 0 ||
      !Dims(cache_k.dimensions(), {a.b, a.kh, a.s, a.d}) ||
      !Dims(cache_v.dimensions(), {a.b, a.kh, a.s, a.d}) ||
      !Dims(k.dimensions(), {a.b, a.t, a.kh, a.d}) ||
      !Dims(v.dimensions(), {a.b, a.t, a.kh, a.d}) ||
      !Dims(cache_mask.dimensions(), {a.b, a.t, a.s}) ||
      !Dims(new_mask.dimensions(), {a.b, a.t, a.t}))
    return ffi::Error::InvalidArgument("cpu attention: operand shapes do not match");
  const int64_t blocks = (a.t * a.groups() + kRowBlock - 1) / kRowBlock;
  tlt_cpu::ParallelFor(pool, a.b * a.kh * blocks, 2, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t block = item % blocks, j = (item / blocks) % a.kh, row = item / blocks / a.kh;
      const int64_t first = block * kRowBlock;
      a.Rows(row, j, first, std::min(kRowBlock, a.t * a.groups() - first));
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TltAttention, Attend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR4<ffi::F32>>()
                                  .Arg<ffi::BufferR4<ffi::F32>>()
                                  .Arg<ffi::BufferR4<ffi::F32>>()
                                  .Arg<ffi::BufferR3<ffi::PRED>>()
                                  .Arg<ffi::BufferR4<ffi::F32>>()
                                  .Arg<ffi::BufferR4<ffi::F32>>()
                                  .Arg<ffi::BufferR3<ffi::PRED>>()
                                  .Ret<ffi::BufferR4<ffi::F32>>());

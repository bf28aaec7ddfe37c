// The trainer's LM-head softmax on x86 CPUs with AVX2 and FMA, forward and backward: for
// each row of logits [K, V], z = logits * inv_temperature, the log-prob of one token under
// log_softmax(z) and the entropy of softmax(z); what tlt_jax.rl.logprobs computes in jnp.
//
// Why: a SmolLM2 micro-batch scores ~512 slots against 49152 tokens. XLA ran the max, the
// exp and the entropy's sum as separate passes over [K, V] (its reduction alone took about
// as long as the head's backward matmul) and kept the full log-prob table for the backward.
// Here the forward reads each row twice (max, then exp and both sums, from cache) and
// keeps only the log-sum-exp; the backward forms d/dlogits in one pass.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

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

float RowMax(const float* x, int64_t v) {
  __m256 m = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + kLanes <= v; j += kLanes) m = _mm256_max_ps(m, _mm256_loadu_ps(x + j));
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, m);
  float out = *std::max_element(lanes, lanes + kLanes);
  for (; j < v; ++j) out = std::max(out, x[j]);
  return out;
}

// One row: (log-prob of `token`, entropy, log-sum-exp) of z = x * s.
void ForwardRow(const float* x, int64_t v, float s, int32_t token, float* logp, float* entropy,
                float* lse) {
  // With u = z - max z: S = sum e^u, A = sum u e^u; lse = max z + log S and the entropy
  // -sum p log p = log S - A / S.
  const float shift = RowMax(x, v) * s;
  const __m256 scale = _mm256_set1_ps(s), offset = _mm256_set1_ps(-shift);
  __m256 total = _mm256_setzero_ps(), weighted = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + kLanes <= v; j += kLanes) {
    const __m256 u = _mm256_fmadd_ps(_mm256_loadu_ps(x + j), scale, offset);
    const __m256 e = Exp(u);
    total = _mm256_add_ps(total, e);
    weighted = _mm256_fmadd_ps(u, e, weighted);
  }
  float sum = Sum(total), sum_weighted = Sum(weighted);
  for (; j < v; ++j) {
    const float u = x[j] * s - shift, e = std::exp(u);
    sum += e;
    sum_weighted += u * e;
  }
  *lse = shift + std::log(sum);
  *entropy = std::log(sum) - sum_weighted / sum;
  *logp = x[std::clamp<int64_t>(token, 0, v - 1)] * s - *lse;
}

// One row of d/dlogits = s * (d_logp (onehot - p) - d_entropy p (log p + entropy)).
void BackwardRow(const float* x, int64_t v, float s, int32_t token, float lse, float entropy,
                 float d_logp, float d_entropy, float* dx) {
  const __m256 scale = _mm256_set1_ps(s), offset = _mm256_set1_ps(-lse),
               plus_entropy = _mm256_set1_ps(entropy),
               minus_d_logp = _mm256_set1_ps(-d_logp * s),
               minus_d_entropy = _mm256_set1_ps(-d_entropy * s);
  int64_t j = 0;
  for (; j + kLanes <= v; j += kLanes) {
    const __m256 logp = _mm256_fmadd_ps(_mm256_loadu_ps(x + j), scale, offset);
    const __m256 p = Exp(logp);
    // p * (-d_logp s - d_entropy s (log p + entropy))
    const __m256 factor = _mm256_fmadd_ps(minus_d_entropy,
                                          _mm256_add_ps(logp, plus_entropy), minus_d_logp);
    _mm256_storeu_ps(dx + j, _mm256_mul_ps(p, factor));
  }
  for (; j < v; ++j) {
    const float logp = x[j] * s - lse;
    dx[j] = std::exp(logp) * (-d_logp * s - d_entropy * s * (logp + entropy));
  }
  dx[std::clamp<int64_t>(token, 0, v - 1)] += d_logp * s;
}

ffi::Error Check(ffi::Span<const int64_t> logits, ffi::Span<const int64_t> tokens) {
  if (logits.size() != 2 || logits[1] < 1 || !Dims(tokens, {logits[0]}))
    return ffi::Error::InvalidArgument("token_logprobs: logits [K, V>0] and tokens [K]");
  return ffi::Error::Success();
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::BufferR2<ffi::F32> logits,
                   ffi::BufferR1<ffi::S32> tokens, float inv_temperature,
                   ffi::ResultBufferR1<ffi::F32> logp, ffi::ResultBufferR1<ffi::F32> entropy,
                   ffi::ResultBufferR1<ffi::F32> lse) {
  if (auto error = Check(logits.dimensions(), tokens.dimensions()); error.failure())
    return error;
  const int64_t k = logits.dimensions()[0], v = logits.dimensions()[1];
  const float* x = logits.typed_data();
  const int32_t* t = tokens.typed_data();
  float *lp = logp->typed_data(), *h = entropy->typed_data(), *l = lse->typed_data();
  tlt_cpu::ParallelFor(pool, k, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      ForwardRow(x + r * v, v, inv_temperature, t[r], lp + r, h + r, l + r);
  });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::BufferR2<ffi::F32> logits,
                    ffi::BufferR1<ffi::S32> tokens, ffi::BufferR1<ffi::F32> lse,
                    ffi::BufferR1<ffi::F32> entropy, ffi::BufferR1<ffi::F32> d_logp,
                    ffi::BufferR1<ffi::F32> d_entropy, float inv_temperature,
                    ffi::ResultBufferR2<ffi::F32> d_logits) {
  if (auto error = Check(logits.dimensions(), tokens.dimensions()); error.failure())
    return error;
  const int64_t k = logits.dimensions()[0], v = logits.dimensions()[1];
  for (auto dims : {lse.dimensions(), entropy.dimensions(), d_logp.dimensions(),
                    d_entropy.dimensions()})
    if (!Dims(dims, {k}))
      return ffi::Error::InvalidArgument("token_logprobs backward: per-row operands [K]");
  const float* x = logits.typed_data();
  float* dx = d_logits->typed_data();
  tlt_cpu::ParallelFor(pool, k, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      BackwardRow(x + r * v, v, inv_temperature, tokens.typed_data()[r], lse.typed_data()[r],
                  entropy.typed_data()[r], d_logp.typed_data()[r], d_entropy.typed_data()[r],
                  dx + r * v);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TltTokenLogprobsForward, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR2<ffi::F32>>()
                                  .Arg<ffi::BufferR1<ffi::S32>>()
                                  .Attr<float>("inv_temperature")
                                  .Ret<ffi::BufferR1<ffi::F32>>()
                                  .Ret<ffi::BufferR1<ffi::F32>>()
                                  .Ret<ffi::BufferR1<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(TltTokenLogprobsBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR2<ffi::F32>>()
                                  .Arg<ffi::BufferR1<ffi::S32>>()
                                  .Arg<ffi::BufferR1<ffi::F32>>()
                                  .Arg<ffi::BufferR1<ffi::F32>>()
                                  .Arg<ffi::BufferR1<ffi::F32>>()
                                  .Arg<ffi::BufferR1<ffi::F32>>()
                                  .Attr<float>("inv_temperature")
                                  .Ret<ffi::BufferR2<ffi::F32>>());

// Attention of T tokens among themselves (no KV cache) under a [T, T] mask, float32, on x86
// CPUs with AVX2 and FMA, forward and backward: the training forward of packed rows, what
// tlt_jax.models.attention.attend computes with an empty cache.
//
// Why: a packed training row holds several samples, each seeing only its own earlier tokens
// (a block-causal mask). XLA scores every [T, T] pair and runs the softmax over all of them;
// here each query scores only the keys between the first and the last it sees (~a quarter of
// the pairs for two samples per row), and the backward recomputes the probabilities from the
// forward's log-sum-exp instead of keeping [T, T] buffers.
//
// Per (batch row, kv head) the keys and values are copied into [T, D] rows and [D, T]
// columns, so every inner loop streams contiguous memory: scores are key columns x a query
// (8 keys per vector), weighted sums are probability x key rows.
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
constexpr int64_t kKeyBlock = 2 * kLanes;  // keys scored per loop step
constexpr int kMaxHeads = 4;               // query heads sharing each key load
constexpr float kHidden = -std::numeric_limits<float>::infinity();

// out[g][i] = vec[g] . cols[:, lo + i] for i < n (and up to the next kKeyBlock; `cols` is
// [d, stride] with stride >= lo + n + kKeyBlock, zero past the keys).
template <int G>
void Scores(const float* const* vec, const float* cols, int64_t stride, int64_t d, int64_t lo,
            int64_t n, float* const* out) {
  for (int64_t i = 0; i < n; i += kKeyBlock) {
    __m256 acc[G][2];
    for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
    const float* col = cols + lo + i;
    for (int64_t c = 0; c < d; ++c, col += stride) {
      const __m256 k0 = _mm256_loadu_ps(col), k1 = _mm256_loadu_ps(col + kLanes);
      for (int g = 0; g < G; ++g) {
        const __m256 x = _mm256_broadcast_ss(vec[g] + c);
        acc[g][0] = _mm256_fmadd_ps(x, k0, acc[g][0]);
        acc[g][1] = _mm256_fmadd_ps(x, k1, acc[g][1]);
      }
    }
    for (int g = 0; g < G; ++g) {
      _mm256_storeu_ps(out[g] + i, acc[g][0]);
      _mm256_storeu_ps(out[g] + i + kLanes, acc[g][1]);
    }
  }
}

// out[g] = sum over i < n of w[g][i] * rows[lo + i] (rows [., d], d a multiple of 16).
template <int G>
void WeightedSum(const float* const* w, const float* rows, int64_t d, int64_t lo, int64_t n,
                 float* const* out) {
  for (int64_t c = 0; c < d; c += 2 * kLanes) {
    __m256 acc[G][2];
    for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
    const float* row = rows + lo * d + c;
    for (int64_t i = 0; i < n; ++i, row += d) {
      const __m256 r0 = _mm256_loadu_ps(row), r1 = _mm256_loadu_ps(row + kLanes);
      for (int g = 0; g < G; ++g) {
        const __m256 x = _mm256_broadcast_ss(w[g] + i);
        acc[g][0] = _mm256_fmadd_ps(x, r0, acc[g][0]);
        acc[g][1] = _mm256_fmadd_ps(x, r1, acc[g][1]);
      }
    }
    for (int g = 0; g < G; ++g) {
      _mm256_storeu_ps(out[g] + c, acc[g][0]);
      _mm256_storeu_ps(out[g] + c + kLanes, acc[g][1]);
    }
  }
}

// rows[lo + i] += sum over g of w[g][i] * vec[g], for i < n.
template <int G>
void AddOuter(const float* const* w, const float* const* vec, float* rows, int64_t d,
              int64_t lo, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float* row = rows + (lo + i) * d;
    __m256 x[G];
    for (int g = 0; g < G; ++g) x[g] = _mm256_broadcast_ss(w[g] + i);
    for (int64_t c = 0; c < d; c += kLanes) {
      __m256 r = _mm256_loadu_ps(row + c);
      for (int g = 0; g < G; ++g) r = _mm256_fmadd_ps(x[g], _mm256_loadu_ps(vec[g] + c), r);
      _mm256_storeu_ps(row + c, r);
    }
  }
}

// Runs F<G>(args...) for the group size G in 1..kMaxHeads.
template <template <int> class F, typename... Args>
void ForHeads(int g, Args&&... args) {
  switch (g) {
    case 1: F<1>::Run(args...); break;
    case 2: F<2>::Run(args...); break;
    case 3: F<3>::Run(args...); break;
    default: F<4>::Run(args...); break;
  }
}
template <int G> struct ScoresOp { template <typename... A> static void Run(A... a) { Scores<G>(a...); } };
template <int G> struct WeightedSumOp { template <typename... A> static void Run(A... a) { WeightedSum<G>(a...); } };
template <int G> struct AddOuterOp { template <typename... A> static void Run(A... a) { AddOuter<G>(a...); } };

struct SelfAttention {
  // q, out, dout, dq [B, T, H, D]; k, v, dk, dv [B, T, KH, D]; mask [B, T, T]; lse [B, T, H].
  const float *q, *k, *v;
  const bool* mask;
  int64_t b, t, h, kh, d;

  int64_t groups() const { return h / kh; }
  int64_t stride() const { return t + kKeyBlock; }  // columns of a [D, T] copy
  int64_t head(int64_t row, int64_t token, int64_t hd) const {
    return ((row * t + token) * h + hd) * d;
  }
  const bool* sees(int64_t row, int64_t token) const { return mask + (row * t + token) * t; }

  // The first and last key `token` sees; lo > hi when it sees none.
  void Range(int64_t row, int64_t token, int64_t* lo, int64_t* hi) const {
    const bool* m = sees(row, token);
    *lo = 0;
    while (*lo < t && !m[*lo]) ++*lo;
    *hi = t - 1;
    while (*hi >= *lo && !m[*hi]) --*hi;
  }

  // Kv head j of batch row `row`: its keys or values as rows [T, D] and/or columns
  // [D, stride] (either may be null).
  void Copy(const float* x, int64_t row, int64_t j, float* rows, float* cols) const {
    const int64_t s = stride();
    if (cols) std::fill(cols, cols + d * s, 0.0f);
    for (int64_t l = 0; l < t; ++l) {
      const float* src = x + ((row * t + l) * kh + j) * d;
      if (rows) std::copy(src, src + d, rows + l * d);
      if (cols)
        for (int64_t c = 0; c < d; ++c) cols[c * s + l] = src[c];
    }
  }

  // Scores [G][n] of heads `heads` of `token` against keys lo.., scaled, into probabilities
  // e^(score - max) masked to the keys seen (0 elsewhere, up to the next kKeyBlock); returns
  // in `peak` and `total` each head's max and sum, or with `lse` given, normalizes by it.
  void Probabilities(int64_t row, int64_t token, int64_t lo, int64_t n, int g,
                     const float* const* qs, const float* key_cols, float* const* p,
                     const float* lse, float* peak, float* total) const {
    ForHeads<ScoresOp>(g, qs, key_cols, stride(), d, lo, n, p);
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
    const bool* m = sees(row, token) + lo;
    const int64_t padded = (n + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
    for (int hd = 0; hd < g; ++hd) {
      float* s = p[hd];
      float top = kHidden;
      for (int64_t i = 0; i < padded; ++i) {
        s[i] = i < n && m[i] ? s[i] * scale : kHidden;
        top = std::max(top, s[i]);
      }
      const __m256 shift = _mm256_set1_ps(lse ? lse[hd] : top);
      const __m256 hidden = _mm256_set1_ps(kHidden);
      __m256 sum = _mm256_setzero_ps();
      for (int64_t i = 0; i < padded; i += kLanes) {
        const __m256 x = _mm256_loadu_ps(s + i);
        const __m256 e = _mm256_and_ps(Exp(_mm256_sub_ps(x, shift)),
                                       _mm256_cmp_ps(x, hidden, _CMP_NEQ_OQ));
        _mm256_storeu_ps(s + i, e);
        sum = _mm256_add_ps(sum, e);
      }
      if (peak) peak[hd] = top;
      if (total) total[hd] = Sum(sum);
    }
  }

  void Forward(int64_t row, int64_t j, float* out, float* lse) const {
    const int64_t g_all = groups(), s = stride();
    std::vector<float> key_cols(d * s), value_rows(t * d);
    Copy(k, row, j, nullptr, key_cols.data());
    Copy(v, row, j, value_rows.data(), nullptr);
    std::vector<float> buf(kMaxHeads * s);
    for (int64_t token = 0; token < t; ++token) {
      int64_t lo, hi;
      Range(row, token, &lo, &hi);
      for (int64_t g0 = 0; g0 < g_all; g0 += kMaxHeads) {
        const int g = static_cast<int>(std::min<int64_t>(kMaxHeads, g_all - g0));
        const float* qs[kMaxHeads];
        float *p[kMaxHeads], *outs[kMaxHeads];
        for (int hd = 0; hd < g; ++hd) {
          qs[hd] = q + head(row, token, j * g_all + g0 + hd);
          outs[hd] = out + head(row, token, j * g_all + g0 + hd);
          p[hd] = buf.data() + hd * s;
        }
        float* lses = lse + (row * t + token) * h + j * g_all + g0;
        if (lo > hi) {  // sees nothing: like the reference, every value averaged
          for (int hd = 0; hd < g; ++hd) {
            std::fill(p[hd], p[hd] + t, 1.0f / static_cast<float>(t));
            lses[hd] = 0.0f;
          }
          ForHeads<WeightedSumOp>(g, p, value_rows.data(), d, int64_t{0}, t, outs);
          continue;
        }
        const int64_t n = hi - lo + 1;
        float peak[kMaxHeads], total[kMaxHeads];
        Probabilities(row, token, lo, n, g, qs, key_cols.data(), p, nullptr, peak, total);
        for (int hd = 0; hd < g; ++hd) {
          const float inv = 1.0f / total[hd];
          for (int64_t i = 0; i < n; ++i) p[hd][i] *= inv;
          lses[hd] = peak[hd] + std::log(total[hd]);
        }
        ForHeads<WeightedSumOp>(g, p, value_rows.data(), d, lo, n, outs);
      }
    }
  }

  // dq for every head of kv head j, dk and dv of kv head j, from dout and the forward's
  // out and lse: dp = dout . v, ds = p (dp - dout . out), dq = scale ds k, dk = scale ds^T q,
  // dv = p^T dout.
  void Backward(int64_t row, int64_t j, const float* out, const float* lse, const float* dout,
                float* dq, float* dk, float* dv) const {
    const int64_t g_all = groups(), s = stride();
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
    std::vector<float> key_rows(t * d), key_cols(d * s), value_rows(t * d), value_cols(d * s);
    Copy(k, row, j, key_rows.data(), key_cols.data());
    Copy(v, row, j, value_rows.data(), value_cols.data());
    std::vector<float> dk_rows(t * d, 0.0f), dv_rows(t * d, 0.0f);
    std::vector<float> buf(2 * kMaxHeads * s);
    for (int64_t token = 0; token < t; ++token) {
      int64_t lo, hi;
      Range(row, token, &lo, &hi);
      for (int64_t g0 = 0; g0 < g_all; g0 += kMaxHeads) {
        const int g = static_cast<int>(std::min<int64_t>(kMaxHeads, g_all - g0));
        const float *qs[kMaxHeads], *douts[kMaxHeads];
        float *p[kMaxHeads], *ds[kMaxHeads], *dqs[kMaxHeads];
        for (int hd = 0; hd < g; ++hd) {
          const int64_t at = head(row, token, j * g_all + g0 + hd);
          qs[hd] = q + at;
          douts[hd] = dout + at;
          dqs[hd] = dq + at;
          p[hd] = buf.data() + hd * s;
          ds[hd] = buf.data() + (kMaxHeads + hd) * s;
        }
        if (lo > hi) {  // the average of every value: no gradient to q or k
          for (int hd = 0; hd < g; ++hd) {
            std::fill(p[hd], p[hd] + t, 1.0f / static_cast<float>(t));
            std::fill(dqs[hd], dqs[hd] + d, 0.0f);
          }
          ForHeads<AddOuterOp>(g, p, douts, dv_rows.data(), d, int64_t{0}, t);
          continue;
        }
        const int64_t n = hi - lo + 1;
        Probabilities(row, token, lo, n, g, qs, key_cols.data(), p,
                      lse + (row * t + token) * h + j * g_all + g0, nullptr, nullptr);
        ForHeads<ScoresOp>(g, douts, value_cols.data(), s, d, lo, n, ds);  // dp
        for (int hd = 0; hd < g; ++hd) {
          const float* o = out + head(row, token, j * g_all + g0 + hd);
          __m256 acc = _mm256_setzero_ps();
          for (int64_t c = 0; c < d; c += kLanes)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(douts[hd] + c), _mm256_loadu_ps(o + c), acc);
          const float delta = Sum(acc);
          for (int64_t i = 0; i < n; ++i) ds[hd][i] = scale * p[hd][i] * (ds[hd][i] - delta);
        }
        ForHeads<WeightedSumOp>(g, ds, key_rows.data(), d, lo, n, dqs);
        ForHeads<AddOuterOp>(g, p, douts, dv_rows.data(), d, lo, n);
        ForHeads<AddOuterOp>(g, ds, qs, dk_rows.data(), d, lo, n);
      }
    }
    for (int64_t l = 0; l < t; ++l) {
      const int64_t at = ((row * t + l) * kh + j) * d;
      std::copy(dk_rows.data() + l * d, dk_rows.data() + (l + 1) * d, dk + at);
      std::copy(dv_rows.data() + l * d, dv_rows.data() + (l + 1) * d, dv + at);
    }
  }
};

ffi::Error Check(const SelfAttention& a, ffi::Span<const int64_t> k_dims,
                 ffi::Span<const int64_t> v_dims, ffi::Span<const int64_t> mask_dims) {
  if (a.d % (2 * kLanes) != 0 || a.kh == 0 || a.h % a.kh != 0 ||
      !Dims(k_dims, {a.b, a.t, a.kh, a.d}) || !Dims(v_dims, {a.b, a.t, a.kh, a.d}) ||
      !Dims(mask_dims, {a.b, a.t, a.t}))
    return ffi::Error::InvalidArgument("cpu self-attention: operand shapes do not match");
  return ffi::Error::Success();
}

// One work item per (batch row, kv head): it owns that kv head's dk and dv.
void ForEachKvHead(ffi::ThreadPool& pool, const SelfAttention& a,
                   const std::function<void(int64_t, int64_t)>& body) {
  const int64_t items = a.b * a.kh;
  tlt_cpu::ParallelFor(pool, items, items, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) body(item / a.kh, item % a.kh);
  });
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::BufferR4<ffi::F32> q, ffi::BufferR4<ffi::F32> k,
                   ffi::BufferR4<ffi::F32> v, ffi::BufferR3<ffi::PRED> mask,
                   ffi::ResultBufferR4<ffi::F32> out, ffi::ResultBufferR3<ffi::F32> lse) {
  const auto qd = q.dimensions();
  const SelfAttention a{q.typed_data(), k.typed_data(), v.typed_data(), mask.typed_data(),
                        qd[0], qd[1], qd[2], k.dimensions()[2], qd[3]};
  if (auto error = Check(a, k.dimensions(), v.dimensions(), mask.dimensions()); error.failure())
    return error;
  float *o = out->typed_data(), *l = lse->typed_data();
  ForEachKvHead(pool, a, [&](int64_t row, int64_t j) { a.Forward(row, j, o, l); });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::BufferR4<ffi::F32> q, ffi::BufferR4<ffi::F32> k,
                    ffi::BufferR4<ffi::F32> v, ffi::BufferR3<ffi::PRED> mask,
                    ffi::BufferR4<ffi::F32> out, ffi::BufferR3<ffi::F32> lse,
                    ffi::BufferR4<ffi::F32> dout, ffi::ResultBufferR4<ffi::F32> dq,
                    ffi::ResultBufferR4<ffi::F32> dk, ffi::ResultBufferR4<ffi::F32> dv) {
  const auto qd = q.dimensions();
  const SelfAttention a{q.typed_data(), k.typed_data(), v.typed_data(), mask.typed_data(),
                        qd[0], qd[1], qd[2], k.dimensions()[2], qd[3]};
  if (auto error = Check(a, k.dimensions(), v.dimensions(), mask.dimensions()); error.failure())
    return error;
  ForEachKvHead(pool, a, [&](int64_t row, int64_t j) {
    a.Backward(row, j, out.typed_data(), lse.typed_data(), dout.typed_data(),
               dq->typed_data(), dk->typed_data(), dv->typed_data());
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TltSelfAttentionForward, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR4<ffi::F32>>()
                                  .Arg<ffi::BufferR4<ffi::F32>>()
                                  .Arg<ffi::BufferR4<ffi::F32>>()
                                  .Arg<ffi::BufferR3<ffi::PRED>>()
                                  .Ret<ffi::BufferR4<ffi::F32>>()
                                  .Ret<ffi::BufferR3<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(TltSelfAttentionBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR4<ffi::F32>>()
                                  .Arg<ffi::BufferR4<ffi::F32>>()
                                  .Arg<ffi::BufferR4<ffi::F32>>()
                                  .Arg<ffi::BufferR3<ffi::PRED>>()
                                  .Arg<ffi::BufferR4<ffi::F32>>()
                                  .Arg<ffi::BufferR3<ffi::F32>>()
                                  .Arg<ffi::BufferR4<ffi::F32>>()
                                  .Ret<ffi::BufferR4<ffi::F32>>()
                                  .Ret<ffi::BufferR4<ffi::F32>>()
                                  .Ret<ffi::BufferR4<ffi::F32>>());

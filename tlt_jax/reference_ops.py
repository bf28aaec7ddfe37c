"""The plain-jnp reference of every op behind the kernel seam (`tlt_jax.ops`): what the
models compute wherever no kernel runs, what every kernel is tested against, and what the
attention kernels differentiate through.

Attention: q [B, T, H, D]; cache keys/values [B, K, S, D] (heads before slots, the cache's
layout); new keys/values [B, T, K, D]; cache_mask [B, T, S] and new_mask [B, T, T] bool ->
[B, T, H, D] in q.dtype. GQA: H = K * G. One softmax runs over [cache scores, new scores],
so the cache is never copied or concatenated. A query that sees nothing averages every
value (finite MASKED), which the kernels reproduce.

Token log-probs: per row of logits [K, V], the log-prob of one token and the entropy under
log_softmax(logits / temperature), the policy the rollout reports
(`tlt_jax.rollout.sampling.policy_logprobs`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

MASKED = float(np.finfo(np.float32).min)


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [..., in] @ w [in, out]: a weight matmul."""
  return x @ w


def logits(hidden: jax.Array, head: jax.Array) -> jax.Array:
  """hidden [..., E] @ head [E, V] -> float32 logits."""
  return jnp.einsum("...e,ev->...v", hidden, head, preferred_element_type=jnp.float32)


def block_causal_mask(segment_ids):
  """Token i sees token j iff j <= i in the same segment (packed rows); plain operators, so
  it works on numpy arrays and jax tracers alike."""
  index = np.arange(segment_ids.shape[-1])
  causal = index[:, None] >= index[None, :]
  return (segment_ids[..., :, None] == segment_ids[..., None, :]) & causal


def attend(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, cache_mask: jax.Array,
           k: jax.Array, v: jax.Array, new_mask: jax.Array) -> jax.Array:
  """New tokens against a read-only KV cache plus themselves (module doc)."""
  b, t, h, d = q.shape
  kh = k.shape[2]
  qg = q.reshape(b, t, kh, h // kh, d)
  if t == 1 and k.shape[1] == 1:
    return _attend_one_token(qg[:, 0], cache_k, cache_v, cache_mask[:, 0], k[:, 0], v[:, 0],
                             new_mask[:, 0, 0]).reshape(b, 1, h, d)
  cache_scores = jnp.einsum("btkgd,bksd->bkgts", qg, cache_k.astype(q.dtype),
                            preferred_element_type=jnp.float32)
  scores = jnp.concatenate([
      cache_scores,
      jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(q.dtype), preferred_element_type=jnp.float32),
  ], axis=-1) * (d ** -0.5)
  mask = jnp.concatenate([cache_mask, new_mask], axis=-1)
  scores = jnp.where(mask[:, None, None], scores, MASKED)
  probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
  s = cache_k.shape[2]
  attn = (jnp.einsum("bkgts,bksd->btkgd", probs[..., :s], cache_v.astype(q.dtype))
          + jnp.einsum("bkgts,bskd->btkgd", probs[..., s:], v.astype(q.dtype)))
  return attn.reshape(b, t, h, d)


def _attend_one_token(qg, cache_k, cache_v, cache_mask, k, v, sees_itself):
  """Decode: qg [B, K, G, D], one new key/value [B, K, D] per row. Scores are laid out
  slots-major ([B, K, S, G]): on XLA's CPU backend these dots ran faster than the general
  path's at many rows, and no slower at few."""
  d = qg.shape[-1]
  cache_scores = jnp.einsum("bksd,bkgd->bksg", cache_k.astype(qg.dtype), qg,
                            preferred_element_type=jnp.float32)
  own_score = jnp.einsum("bkd,bkgd->bkg", k.astype(qg.dtype), qg,
                         preferred_element_type=jnp.float32)[:, :, None]
  scores = jnp.concatenate([cache_scores, own_score], axis=2) * (d ** -0.5)
  mask = jnp.concatenate([cache_mask, sees_itself[:, None]], axis=-1)       # [B, S + 1]
  scores = jnp.where(mask[:, None, :, None], scores, MASKED)
  probs = jax.nn.softmax(scores, axis=2).astype(qg.dtype)
  s = cache_k.shape[2]
  return (jnp.einsum("bksg,bksd->bkgd", probs[:, :, :s], cache_v.astype(qg.dtype))
          + probs[:, :, s, :, None] * v[:, :, None].astype(qg.dtype))


def self_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """T tokens among themselves, no cache: `attend` with an empty one. q [B, T, H, D], k/v
  [B, T, K, D], mask [B, T, T] bool (which keys each query sees)."""
  b, t, _, d = q.shape
  empty = jnp.zeros((b, k.shape[2], 0, d), q.dtype)
  return attend(q, empty, empty, jnp.zeros((b, t, 0), bool), k, v, mask)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def token_logprobs(logits: jax.Array, tokens: jax.Array, temperature: float
                   ) -> tuple[jax.Array, jax.Array]:
  """(log-prob of `tokens` [K], entropy [K]) under log_softmax(logits [K, V] / temperature).

  Its gradient keeps one [K, V] residual (the log-probs) and forms d/dlogits in one pass;
  autodiff through log-softmax, exp and the gather kept several [K, V] buffers, the
  largest part of a training micro-batch's memory after the layers' activations."""
  return _token_logprobs_fwd(logits, tokens, temperature)[0]


def _token_logprobs_fwd(logits, tokens, temperature):
  logp_all = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
  logp = jnp.take_along_axis(logp_all, tokens[:, None], axis=-1)[:, 0]
  entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
  # The empty array carries the logits' dtype to the backward pass.
  return (logp, entropy), (logp_all, tokens, entropy, jnp.zeros((0,), logits.dtype))


def _token_logprobs_bwd(temperature, residuals, cotangents):
  # With z = logits / temperature and p = softmax(z): d logp[t] / dz = onehot(t) - p and
  # d entropy / dz = -p * (log p + entropy).
  logp_all, tokens, entropy, like = residuals
  d_logp, d_entropy = cotangents
  p = jnp.exp(logp_all)
  onehot = jnp.arange(logp_all.shape[-1]) == tokens[:, None]
  d_z = (d_logp[:, None] * (onehot - p)
         - d_entropy[:, None] * p * (logp_all + entropy[:, None]))
  return (d_z / temperature).astype(like.dtype), None


token_logprobs.defvjp(_token_logprobs_fwd, _token_logprobs_bwd)

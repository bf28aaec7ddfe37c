"""The attention of every model here, in jnp: new tokens against a read-only KV cache plus
themselves. The Pallas/Triton kernels are checked against it and differentiate through it.

q [B, T, H, D]; cache keys/values [B, K, S, D] (heads before slots, the cache's layout);
new keys/values [B, T, K, D]; cache_mask [B, T, S] and new_mask [B, T, T] bool -> [B, T, H, D]
in q.dtype. GQA: H = K * G. One softmax runs over [cache scores, new scores], so the cache
is never copied or concatenated. A query that sees nothing averages every value (finite
MASKED), which the kernels reproduce.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MASKED = float(np.finfo(np.float32).min)


def attend(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, cache_mask: jax.Array,
           k: jax.Array, v: jax.Array, new_mask: jax.Array) -> jax.Array:
  b, t, h, d = q.shape
  kh = k.shape[2]
  qg = q.reshape(b, t, kh, h // kh, d)
  if t == 1:
    # Decode: a multiply-and-reduce fuses into one pass over the cache, where a dot would
    # lower to tiny per-(row, head) matrix products plus a copy of the cache slice.
    cache_scores = jnp.sum(qg[:, 0, :, :, None, :].astype(jnp.float32)
                           * cache_k[:, :, None].astype(jnp.float32), axis=-1)[:, :, :, None]
  else:
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
  if t == 1:
    from_cache = jnp.sum(probs[:, :, :, 0, :s, None] * cache_v[:, :, None].astype(q.dtype),
                         axis=-2)[:, None]                                 # [B, 1, K, G, D]
  else:
    from_cache = jnp.einsum("bkgts,bksd->btkgd", probs[..., :s], cache_v.astype(q.dtype))
  attn = from_cache + jnp.einsum("bkgts,bskd->btkgd", probs[..., s:], v.astype(q.dtype))
  return attn.reshape(b, t, h, d)

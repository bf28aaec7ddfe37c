"""Attention of a few new tokens against the KV cache on x86 CPUs (attention.cc), beside its
jnp reference `tlt_jax.reference_ops.attend`: the same arguments, layout and result.

A decode step (1 token) or an SD verification (a draft chain or tree) attends per layer
with one kernel call instead of XLA's small dots and softmax ops, reading only the cache
slots some query sees. Prefill (many tokens) stays on the reference, whose dots are blocked.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from tlt_jax.cpu import kernels

_TARGET = "tlt_attention"
LANES = 8               # attention.cc's vectors: head_dim must be a multiple
MAX_NEW_TOKENS = 64     # dispatch: above it (prefill) the reference's blocked dots win


def supports(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, k: jax.Array,
             v: jax.Array) -> bool:
  """Whether the kernel takes these operands: float32, head_dim a multiple of LANES."""
  return (all(x.dtype == jnp.float32 for x in (q, cache_k, cache_v, k, v))
          and q.shape[-1] % LANES == 0)


def cpu_attention(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, cache_mask: jax.Array,
                  k: jax.Array, v: jax.Array, new_mask: jax.Array) -> jax.Array:
  """`attend` by the kernel: q [B, T, H, D]; cache_k/v [B, K, S, D]; k/v [B, T, K, D];
  cache_mask [B, T, S] and new_mask [B, T, T] bool -> [B, T, H, D] float32."""
  if not supports(q, cache_k, cache_v, k, v):
    raise ValueError(f"cpu attention takes float32 operands and head_dim a multiple of "
                     f"{LANES}; got q {q.dtype}{q.shape}, cache {cache_k.dtype}{cache_k.shape}")
  kernels.register(_TARGET, "TltAttention")
  return jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
      q, cache_k, cache_v, cache_mask.astype(jnp.bool_), k, v, new_mask.astype(jnp.bool_))

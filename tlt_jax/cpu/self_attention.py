"""Attention of T tokens among themselves (no KV cache) on x86 CPUs, forward and backward
(self_attention.cc), beside its jnp reference: `tlt_jax.reference_ops.attend` with an
empty cache.

The trainer's packed rows hold several samples each, under a block-causal mask. XLA's
attention scores all T x T pairs, keeps [T, T] buffers for the backward pass, and took
about a quarter of a SmolLM2 training micro-batch (4 x 256 slots); the kernel scores each
query only against the keys between the first and last it sees, and its backward pass
recomputes the probabilities from the forward's log-sum-exp.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from tlt_jax.cpu import kernels

_FORWARD, _BACKWARD = "tlt_self_attention_forward", "tlt_self_attention_backward"
HEAD_DIM_MULTIPLE = 16   # self_attention.cc's vector pairs
RESIDUALS = "cpu_self_attention_residuals"


def supports(q: jax.Array, k: jax.Array, v: jax.Array) -> bool:
  """Whether the kernel takes these operands: float32, head_dim a multiple of 16."""
  return (all(x.dtype == jnp.float32 for x in (q, k, v))
          and q.shape[-1] % HEAD_DIM_MULTIPLE == 0)


@jax.custom_vjp
def self_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """q [B, T, H, D], k/v [B, T, K, D] float32, mask [B, T, T] bool (which keys each query
  sees) -> [B, T, H, D]: `attend` with an empty cache."""
  return _forward(q, k, v, mask)[0]


def _forward(q, k, v, mask):
  if not supports(q, k, v):
    raise ValueError(f"cpu self-attention takes float32 operands and head_dim a multiple of "
                     f"{HEAD_DIM_MULTIPLE}; got q {q.dtype}{q.shape}, k {k.dtype}{k.shape}")
  kernels.register(_FORWARD, "TltSelfAttentionForward")
  b, t, h, _ = q.shape
  return jax.ffi.ffi_call(_FORWARD, (jax.ShapeDtypeStruct(q.shape, jnp.float32),
                                     jax.ShapeDtypeStruct((b, t, h), jnp.float32)))(
      q, k, v, mask.astype(jnp.bool_))


def _vjp_forward(q, k, v, mask):
  # Named so a checkpoint policy can keep them (`RESIDUALS`) rather than rerun the forward
  # in the backward pass.
  out, lse = (checkpoint_name(x, RESIDUALS) for x in _forward(q, k, v, mask))
  return out, (q, k, v, mask, out, lse)


def _vjp_backward(residuals, dout):
  q, k, v, mask, out, lse = residuals
  kernels.register(_BACKWARD, "TltSelfAttentionBackward")
  dq, dk, dv = jax.ffi.ffi_call(_BACKWARD, (jax.ShapeDtypeStruct(q.shape, jnp.float32),
                                            jax.ShapeDtypeStruct(k.shape, jnp.float32),
                                            jax.ShapeDtypeStruct(v.shape, jnp.float32)))(
      q, k, v, mask.astype(jnp.bool_), out, lse, dout.astype(jnp.float32))
  return dq, dk, dv, None


self_attention.defvjp(_vjp_forward, _vjp_backward)

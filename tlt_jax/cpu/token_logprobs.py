"""The trainer's LM-head softmax on x86 CPUs, forward and backward (token_logprobs.cc),
beside its jnp reference `tlt_jax.reference_ops.token_logprobs`: per row of logits
[K, V], the log-prob of one token and the entropy under the temperature-scaled softmax.

XLA ran the max, exp and entropy sum as separate passes over [K, V] and kept the whole
log-prob table for the backward; the kernel reads each row twice, keeps only the
log-sum-exp, and forms d/dlogits in one pass.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.cpu import kernels

_FORWARD, _BACKWARD = "tlt_token_logprobs_forward", "tlt_token_logprobs_backward"


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def token_logprobs(logits: jax.Array, tokens: jax.Array, temperature: float
                   ) -> tuple[jax.Array, jax.Array]:
  """(log-prob of tokens [K], entropy [K]) under log_softmax(logits [K, V] / temperature),
  float32 logits. A token outside [0, V) reads the nearest end of the row."""
  return _forward(logits, tokens, temperature)[:2]


def _forward(logits, tokens, temperature):
  if logits.dtype != jnp.float32 or logits.ndim != 2:
    raise ValueError(f"cpu token_logprobs takes float32 logits [K, V]; got "
                     f"{logits.dtype}{logits.shape}")
  kernels.register(_FORWARD, "TltTokenLogprobsForward")
  row = jax.ShapeDtypeStruct(logits.shape[:1], jnp.float32)
  return jax.ffi.ffi_call(_FORWARD, (row, row, row))(
      logits, tokens.astype(jnp.int32), inv_temperature=np.float32(1.0 / temperature))


def _vjp_forward(logits, tokens, temperature):
  logp, entropy, lse = _forward(logits, tokens, temperature)
  return (logp, entropy), (logits, tokens, lse, entropy)


def _vjp_backward(temperature, residuals, cotangents):
  logits, tokens, lse, entropy = residuals
  d_logp, d_entropy = cotangents
  kernels.register(_BACKWARD, "TltTokenLogprobsBackward")
  d_logits = jax.ffi.ffi_call(_BACKWARD, jax.ShapeDtypeStruct(logits.shape, jnp.float32))(
      logits, tokens.astype(jnp.int32), lse, entropy, d_logp.astype(jnp.float32),
      d_entropy.astype(jnp.float32), inv_temperature=np.float32(1.0 / temperature))
  return d_logits, None


token_logprobs.defvjp(_vjp_forward, _vjp_backward)

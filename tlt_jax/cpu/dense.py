"""`x @ w` for the CPU backend with a backward pass laid out for XLA's CPU dots (not a C++
kernel: XLA's own ops, arranged differently).

On XLA's CPU backend, autodiff's backward of `x [..., in] @ w` ran a SmolLM2 training
micro-batch slower than the one here (paired A/B when it was written), which flattens x and
the cotangent to [N, in] and [N, out] so the weight gradient is one plain product over N.
The input gradient contracts the weight's last dimension in place rather than copying the
weight transposed first. The seam (`tlt_jax.ops.dense`) runs it on the CPU backend only.
"""
from __future__ import annotations

import jax


@jax.custom_vjp
def dense(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [..., in] @ w [in, out]; the same forward as `x @ w`."""
  return x @ w


def _dense_fwd(x, w):
  return x @ w, (x, w)


def _dense_bwd(residuals, g):
  x, w = residuals
  dx = jax.lax.dot_general(g, w, (((g.ndim - 1,), (1,)), ((), ()))).astype(x.dtype)
  flat_x, flat_g = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
  dw = jax.lax.dot_general(flat_x, flat_g, (((0,), (0,)), ((), ()))).astype(w.dtype)
  return dx, dw


dense.defvjp(_dense_fwd, _dense_bwd)

"""`x @ w` for the model's weight matrices, with a backward pass laid out for the CPU.

Autodiff turns `x @ w` into a backward `g @ w.T` that XLA's CPU backend emits as a dot
contracting the weight's last dimension, which its dot library runs at about half the
speed of a plain one (measured on SmolLM2's layer shapes: the layers' fwd+bwd went from
~70 to ~97 GFLOP/s against ~110 for a lone matmul). Here the backward transposes the
weight into a copy of its own first (kept by an optimization barrier, or the simplifier
folds it straight back), so both backward dots are plain. Other backends get autodiff's
own backward: their dot libraries take transposed operands at full speed.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax

from tlt_jax.cpu.packed_matmul import PackedWeight, packed_matmul, packed_matmuls


@jax.custom_vjp
def _dense_cpu(x: jax.Array, w: jax.Array) -> jax.Array:
  return x @ w


def _dense_fwd(x, w):
  return x @ w, (x, w)


def _dense_bwd(residuals, g):
  x, w = residuals
  w_t = jax.lax.optimization_barrier(w.T)
  dx = (g @ w_t).astype(x.dtype)
  flat_x, flat_g = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
  dw = jax.lax.dot_general(flat_x, flat_g, (((0,), (0,)), ((), ()))).astype(w.dtype)
  return dx, dw


_dense_cpu.defvjp(_dense_fwd, _dense_bwd)


def dense(x: jax.Array, w: jax.Array | PackedWeight) -> jax.Array:
  """x [..., in] @ w [in, out]; packed weights (the rollout's CPU layout) by their kernel."""
  if isinstance(w, PackedWeight):
    return packed_matmul(x, w)
  if jax.default_backend() == "cpu":
    return _dense_cpu(x, w)
  return x @ w


def dense_shared_input(x: jax.Array, weights: Sequence[jax.Array | PackedWeight]
                       ) -> tuple[jax.Array, ...]:
  """`dense(x, w)` for each weight; packed weights in one kernel call (one fork-join)."""
  if all(isinstance(w, PackedWeight) for w in weights):
    return packed_matmuls(x, weights)
  return tuple(dense(x, w) for w in weights)

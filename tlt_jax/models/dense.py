"""`x @ w` for the model's weight matrices, with a backward pass laid out for the CPU.

On XLA's CPU backend, autodiff's backward of `x [..., in] @ w` ran a SmolLM2 training
micro-batch 1.28x slower than the one here (jax 0.10.2, paired A/B), which flattens x and
the cotangent to [N, in] and [N, out] so the weight gradient is one plain product over N.
The input gradient contracts the weight's last dimension in place: copying the weight
transposed first (what an older XLA's dot library needed to run it at full speed) now cost
~2% of a micro-batch. Other backends get autodiff's own backward.
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
  dx = jax.lax.dot_general(g, w, (((g.ndim - 1,), (1,)), ((), ()))).astype(x.dtype)
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

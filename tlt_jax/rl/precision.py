"""Mixed precision for RL: bfloat16 compute over float32 master weights.

On an accelerator the rollout and the update run in bfloat16 (`--dtype=bfloat16`): half the
weight and KV-cache bytes, and the matmul units' native type. What an update changes stays
float32: the policy's master weights, the gradients accumulated into them and AdamW's
moments (`PolicyState`). An AdamW step moves a weight by about the learning rate (1e-6 in
RL), far below bfloat16's spacing at that weight (2^-8 of its magnitude: 1e-4 at 0.02), so
applied to bfloat16 weights most of it would round away. Each forward casts the master
weights to the compute dtype (`compute_params`, inside the jitted program, so the gradient
flows back through the cast to the float32 weights); the rollout and the reference model
hold a compute-dtype copy. The model keeps float32 where precision matters whatever the
weights' dtype: RMS norms, attention softmax, logits, log-probs and the loss (`transformer`, `ops`, `rl.losses`).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def compute_params(params: Any, dtype) -> Any:
  """Every floating leaf of `params` cast to `dtype` (None: unchanged); integer leaves (a
  packed layout's indices) as they are."""
  if dtype is None:
    return params
  dtype = jnp.dtype(dtype)
  cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
  return jax.tree.map(cast, params)

"""Rotary position embeddings (HF rotate_half layout) with Llama-3 and linear scaling."""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from tlt_jax.models.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
  """Per-pair inverse frequencies [head_dim // 2], computed once on the host in float64."""
  inv_freq = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
  if rope.rope_type == "linear":
    inv_freq = inv_freq / rope.factor
  elif rope.rope_type == "llama3":
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    old_ctx = rope.original_max_position_embeddings
    low_wavelen = old_ctx / rope.low_freq_factor
    high_wavelen = old_ctx / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
    inv_freq = np.where(wavelen > low_wavelen, inv_freq / rope.factor,
                        np.where(wavelen < high_wavelen, inv_freq, blended))
  return inv_freq.astype(np.float32)


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: np.ndarray) -> jnp.ndarray:
  """Rotates x [..., T, heads, head_dim] by positions [..., T]; math in float32."""
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., T, D/2]
  cos = jnp.cos(angles)[..., None, :]
  sin = jnp.sin(angles)[..., None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)

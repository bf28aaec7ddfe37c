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


def rope_tables(positions: jnp.ndarray, inv_freq: np.ndarray
                ) -> tuple[jnp.ndarray, jnp.ndarray]:
  """(cos, sin) [..., T, 1, head_dim // 2] of positions [..., T], float32.

  Computed once per forward and shared by every layer and head: inside a layer, XLA's CPU
  fusions evaluated the cosine and sine again for each head of each layer (on a SmolLM2
  training micro-batch that made RoPE cost as much as a small matmul)."""
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  return jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]


def apply_rope(x: jnp.ndarray, tables: tuple[jnp.ndarray, jnp.ndarray]) -> jnp.ndarray:
  """Rotates x [..., T, heads, head_dim] by `rope_tables`; math in float32."""
  cos, sin = tables
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)

"""KV cache whose rows advance independently.

Speculative decoding commits a different number of tokens per row each step, so the cache
keeps one committed length per row instead of one shared position. `forward` writes the
K/V of new tokens at `lengths[b] + i` without advancing; the caller commits with
`advance`, which is how a rejected draft suffix is discarded for free.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from tlt_jax.models.config import ModelConfig

# Logical axes of the cache tensors, for sharding rules.
# Heads before positions: attention contracts head_dim batched over (batch, kv head), so
# this layout feeds the dots without transposing the whole cache at every layer.
CACHE_AXES = ("layers", "batch", "act_kv_heads", "length", "head_dim")


@flax.struct.dataclass
class KVCache:
  k: jax.Array        # [layers, batch, kv_heads, max_len, head_dim]
  v: jax.Array
  lengths: jax.Array  # [batch] int32: committed tokens per row

  @property
  def max_len(self) -> int:
    return self.k.shape[3]

  @property
  def batch_size(self) -> int:
    return self.k.shape[1]

  def advance(self, num_tokens: jax.Array) -> "KVCache":
    return self.replace(lengths=self.lengths + num_tokens.astype(jnp.int32))

  def write(self, slots: jax.Array, new_k: jax.Array, new_v: jax.Array) -> "KVCache":
    """Writes new K/V [L, B, T, K, D] at slots [B, T] (out-of-range slots are dropped);
    lengths are unchanged."""
    rows = jnp.arange(slots.shape[0])[:, None]
    # Index arrays split by a slice put their dims first: updates are [B, T, L, K, D].
    put = lambda buf, new: buf.at[:, rows, :, slots].set(new.transpose(1, 2, 0, 3, 4),
                                                          mode="drop")
    return self.replace(k=put(self.k, new_k), v=put(self.v, new_v))

  def write_after_committed(self, new_k: jax.Array, new_v: jax.Array) -> "KVCache":
    """Writes new K/V [L, B, T, K, D] at each row's `lengths + arange(T)`."""
    slots = self.lengths[:, None] + jnp.arange(new_k.shape[2])[None, :]
    return self.write(slots, new_k, new_v)

  def window(self, length: int) -> "KVCache":
    """The first `length` slots of every row: attention over a short context then costs
    what the context needs, not what the longest possible row needs."""
    return self.replace(k=self.k[:, :, :, :length], v=self.v[:, :, :, :length])

  def put_window(self, window: "KVCache") -> "KVCache":
    """Writes a `window(...)` back (in place when this cache is donated)."""
    origin = (0,) * self.k.ndim
    return KVCache(k=jax.lax.dynamic_update_slice(self.k, window.k, origin),
                   v=jax.lax.dynamic_update_slice(self.v, window.v, origin),
                   lengths=window.lengths)


def init_cache(config: ModelConfig, batch_size: int, max_len: int, dtype=jnp.float32,
               sharding=None) -> KVCache:
  shape = (config.num_layers, batch_size, config.num_kv_heads, max_len, config.head_dim)
  # Two separate buffers: the cache is donated, and one buffer cannot be donated twice.
  return KVCache(k=jnp.zeros(shape, dtype, device=sharding),
                 v=jnp.zeros(shape, dtype, device=sharding),
                 lengths=jnp.zeros((batch_size,), jnp.int32))

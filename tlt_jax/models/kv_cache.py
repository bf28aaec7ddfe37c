"""KV cache whose rows advance independently.

Speculative decoding commits a different number of tokens per row each step, so the cache
keeps one committed length per row instead of one shared position. `forward` writes the
K/V of new tokens at `lengths[b] + i` without advancing; the caller commits with
`advance`, which is how a rejected draft suffix is discarded for free.

Each of k and v is either one buffer for every layer [L, B, K, S, D] or a tuple of one
buffer per layer, each [1, B, K, S, D] (see `rollout.weights.rollout_layout`): a decode step
that reads a layer's slice of a stacked buffer gets a copy of it on XLA's CPU backend,
while a layer's own buffer is read in place. Every method serves both forms.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from tlt_jax.models.config import ModelConfig
from tlt_jax.sharding.rules import MeshRules, constrain

# Logical axes of the cache tensors, for sharding rules.
# Heads before positions: attention contracts head_dim batched over (batch, kv head), so
# this layout feeds the dots without transposing the whole cache at every layer.
CACHE_AXES = ("layers", "batch", "act_kv_heads", "length", "head_dim")


Buffers = jax.Array | tuple[jax.Array, ...]


def _map_buffers(fn, buffers: Buffers, *stacked: jax.Array) -> Buffers:
  """fn(buffer [l, ...], *arrays [l, ...]) over one stacked buffer, or over each layer's
  buffer with its layer of each of `stacked` ([L, ...] arrays)."""
  if isinstance(buffers, tuple):
    return tuple(fn(buf, *(a[i:i + 1] for a in stacked)) for i, buf in enumerate(buffers))
  return fn(buffers, *stacked)


def layer_buffer(buffers: Buffers, layer: int) -> jax.Array:
  """Layer `layer`'s [B, K, S, D]."""
  return buffers[layer][0] if isinstance(buffers, tuple) else buffers[layer]


@flax.struct.dataclass
class KVCache:
  k: Buffers          # [layers, batch, kv_heads, max_len, head_dim], or per layer [1, ...]
  v: Buffers
  lengths: jax.Array  # [batch] int32: committed tokens per row

  @property
  def per_layer(self) -> bool:
    return isinstance(self.k, tuple)

  @property
  def max_len(self) -> int:
    return jax.tree.leaves(self.k)[0].shape[3]

  @property
  def batch_size(self) -> int:
    return jax.tree.leaves(self.k)[0].shape[1]

  @property
  def dtype(self):
    return jax.tree.leaves(self.k)[0].dtype

  def map(self, fn, new_k: jax.Array | None = None, new_v: jax.Array | None = None
          ) -> "KVCache":
    """fn(buffer [l, B, K, S, D], *new [l, ...]) on every K and V buffer, with the matching
    layers of new_k/new_v [L, ...] when given; lengths are unchanged."""
    if new_k is None:
      return self.replace(k=_map_buffers(fn, self.k), v=_map_buffers(fn, self.v))
    return self.replace(k=_map_buffers(fn, self.k, new_k), v=_map_buffers(fn, self.v, new_v))

  def advance(self, num_tokens: jax.Array) -> "KVCache":
    return self.replace(lengths=self.lengths + num_tokens.astype(jnp.int32))

  def write(self, slots: jax.Array, new_k: jax.Array, new_v: jax.Array) -> "KVCache":
    """Writes new K/V [L, B, T, K, D] at slots [B, T] (out-of-range slots are dropped);
    lengths are unchanged."""
    rows = jnp.arange(slots.shape[0])[:, None]
    # Index arrays split by a slice put their dims first: updates are [B, T, L, K, D].
    return self.map(lambda buf, new: buf.at[:, rows, :, slots].set(
        new.transpose(1, 2, 0, 3, 4), mode="drop"), new_k, new_v)

  def write_after_committed(self, new_k: jax.Array, new_v: jax.Array,
                            after: jax.Array | None = None) -> "KVCache":
    """Writes new K/V [L, B, T, K, D] at each row's `lengths + arange(T)`.

    after: an output of the step that read this cache ([B, ...]); the write is ordered
    after it. XLA orders a cache read and a later in-place write of the same per-layer
    buffer by data dependence alone (an optimization barrier does not do it), and
    otherwise copies the buffer, whole, twice per step: at batch 8 on SmolLM2 a quarter of
    a decode step."""
    slots = self.lengths[:, None] + jnp.arange(new_k.shape[2])[None, :]
    if after is not None:
      # Adds zero, computed from `after` (XLA cannot fold it away).
      flag = jnp.isnan(after.reshape(after.shape[0], -1)[:, :1]).astype(slots.dtype)
      slots = slots + jnp.minimum(flag, 0)
    return self.write(slots, new_k, new_v)

  def without_slots(self, rows: int) -> "KVCache":
    """`rows` rows with no slots, for a prefill: its tokens attend among themselves alone
    instead of scoring every empty (masked) slot as well."""
    return self.map(lambda buf: buf[:, :rows, :, :0]).replace(
        lengths=jnp.zeros((rows,), jnp.int32))

  def write_prefix(self, new_k: jax.Array, new_v: jax.Array, row_start: jax.Array | int = 0,
                   sources: jax.Array | None = None, slot_start: int = 0) -> "KVCache":
    """Writes a prefill's new K/V [L, U, T, K, D] at slots slot_start..+T-1 of rows
    row_start..: row row_start + i gets new row sources[i] (default i). Lengths are
    unchanged."""
    take = (lambda new: new) if sources is None else (lambda new: new[:, sources])
    put = lambda buf, new: jax.lax.dynamic_update_slice(
        buf, take(new).transpose(0, 1, 3, 2, 4).astype(buf.dtype),
        (0, row_start, 0, slot_start, 0))
    return self.map(put, new_k, new_v)

  def write_rows(self, new_k: jax.Array, new_v: jax.Array, rows: jax.Array,
                 sources: jax.Array) -> "KVCache":
    """Writes a prefill's new K/V [L, U, T, K, D] at slots 0..T-1 of the batch rows `rows`
    [G], row rows[i] getting new row sources[i]; rows past the batch are dropped (they pad
    `rows` to a fixed size). Lengths are unchanged. Unlike `write_prefix`, the rows need
    not be adjacent: continuous admission refills whichever rows have finished."""
    put = lambda buf, new: buf.at[:, rows, :, :new.shape[2]].set(
        new[:, sources].transpose(0, 1, 3, 2, 4).astype(buf.dtype), mode="drop")
    return self.map(put, new_k, new_v)

  def laid_out(self, rules: MeshRules | None) -> "KVCache":
    """The buffers laid out by CACHE_AXES, as `init_cache` places them (see
    `decode.lay_out`)."""
    return self.map(lambda buf: constrain(buf, CACHE_AXES, rules)).replace(
        lengths=constrain(self.lengths, ("batch",), rules))

  def empty_like(self, rows: int, slots: int) -> "KVCache":
    """An empty cache of `rows` rows and `slots` slots, in this one's form and dtype."""
    zeros = lambda buf: jnp.zeros(buf.shape[:1] + (rows,) + buf.shape[2:3] + (slots,)
                                  + buf.shape[4:], buf.dtype)
    return self.map(zeros).replace(lengths=jnp.zeros((rows,), jnp.int32))

  def window(self, length: int) -> "KVCache":
    """The first `length` slots of every row: attention over a short context then costs
    what the context needs, not what the longest possible row needs."""
    return self.map(lambda buf: buf[:, :, :, :length])

  def put_window(self, window: "KVCache") -> "KVCache":
    """Writes a `window(...)` back (in place when this cache is donated)."""
    put = lambda buf, part: jax.lax.dynamic_update_slice(buf, part, (0,) * buf.ndim)
    return KVCache(k=jax.tree.map(put, self.k, window.k), v=jax.tree.map(put, self.v, window.v),
                   lengths=window.lengths)


def init_cache(config: ModelConfig, batch_size: int, max_len: int, dtype=jnp.float32,
               rules: MeshRules | None = None, per_layer: bool = False) -> KVCache:
  """An empty cache, laid out by CACHE_AXES on the rules' mesh; per_layer gives each layer
  its own buffers (see the module doc)."""
  shape = (1 if per_layer else config.num_layers, batch_size, config.num_kv_heads, max_len,
           config.head_dim)
  sharding = None if rules is None else rules.sharding(CACHE_AXES, shape)
  zeros = lambda: jnp.zeros(shape, dtype, device=sharding)
  # Separate buffers: the cache is donated, and one buffer cannot be donated twice.
  buffers = (lambda: tuple(zeros() for _ in range(config.num_layers))) if per_layer else zeros
  return KVCache(k=buffers(), v=buffers(), lengths=jnp.zeros((batch_size,), jnp.int32))

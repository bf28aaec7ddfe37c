"""Tree-verify attention: T new tokens (a draft tree, a decode step, a prefill) against
each row's KV cache plus themselves.

The kernels compute `tlt_jax.reference_ops.attend` with its arguments (the seam,
`tlt_jax.ops.attention`, differentiates them through it): q [B, T, H, D]; the cache's
keys/values [B, K, S, D] in the cache's own layout, read in place; the new keys/values
[B, T, K, D] as a block of their own (GQA, H = K * G); cache_mask [B, T, S] and new_mask
[B, T, T] bool -> [B, T, H, D] in q.dtype. Handing a kernel one key set instead meant
copying each layer's whole cache into it at every step.

The Pallas kernel runs one program per (batch row, kv head, block of query rows). Its query
rows are the T new tokens x G heads sharing that kv head, flattened so one matmul serves the
whole group and each key block is read once; the cache's keys, then the new ones, are
streamed in blocks through one online softmax in float32. Shapes are padded to powers of
two (>= 16) where Triton needs them.

`tlt_jax.ops.attention` chooses among the reference, these kernels and the C++ CPU kernel.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from tlt_jax.reference_ops import MASKED

MIN_TRITON_DIM = 16  # tl.dot needs every matmul dimension >= 16


def pow2_at_least(n: int) -> int:
  """Smallest power of two >= n and >= 16: Triton tensors are powers of two, dots >= 16."""
  return max(MIN_TRITON_DIM, pl.next_power_of_2(n))


def query_row_blocks(num_rows: int, block_m: int) -> tuple[int, int]:
  """(rows per program, padded row count) for T x G query rows."""
  block_m = min(block_m, pow2_at_least(num_rows))
  return block_m, pl.cdiv(num_rows, block_m) * block_m


def _pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
  """Zero/False-pads one axis up to `size`; a no-op (no copy) when already that size."""
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


def group_query_rows(q: jax.Array, num_kv_heads: int, rows: int, dim: int) -> jax.Array:
  """[B, T, H, D] -> [B, K, rows, dim]: row t * G + g is query t of grouped head g."""
  b, t, h, d = q.shape
  groups = h // num_kv_heads
  qg = q.reshape(b, t, num_kv_heads, groups, d).transpose(0, 2, 1, 3, 4)
  return _pad_axis(_pad_axis(qg.reshape(b, num_kv_heads, t * groups, d), 2, rows), 3, dim)


def ungroup_query_rows(out: jax.Array, t: int, h: int, d: int) -> jax.Array:
  """Inverse of `group_query_rows`, dropping the padding."""
  b, kh = out.shape[:2]
  out = out[:, :, :t * (h // kh), :d].reshape(b, kh, t, h // kh, d)
  return out.transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)


def group_mask_rows(mask: jax.Array, groups: int, rows: int, seq: int) -> jax.Array:
  """[B, T, S] bool -> [B, rows, seq] int8 matching `group_query_rows`; padding is hidden.

  int8 because bool refs are not portable across Pallas backends; the copy is small next
  to the KV cache the kernel streams.
  """
  expanded = jnp.repeat(mask, groups, axis=1).astype(jnp.int8)
  return _pad_axis(_pad_axis(expanded, 1, rows), 2, seq)


def _key_blocks(num_keys: int, block_s: int) -> tuple[int, int]:
  """(keys per loop step, padded key count) for `num_keys` keys: at least one block, so an
  empty cache still has a (fully padded) ref."""
  block_s = min(block_s, pow2_at_least(num_keys))
  return block_s, max(1, pl.cdiv(num_keys, block_s)) * block_s


def _kernel(q_ref, cache_k_ref, cache_v_ref, cache_mask_ref, k_ref, v_ref, new_mask_ref, o_ref,
            *, cache_len: int, new_len: int, cache_block: int, new_block: int, scale: float):
  """One (batch row, kv head, query-row block): online softmax over the cache's key blocks,
  then the new keys' blocks, float32."""
  q = q_ref[...]
  rows = q.shape[0]
  # Float32 dots in IEEE float32, as the Triton kernel's: Triton's default for a float32 dot
  # is TF32 (~1e-3 relative; benchmarks/results/gpu_check_h200.json).
  precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

  def fold(carry, keys_ref, values_ref, mask_ref, length, block_s):
    """Adds keys/values [padded length, dim] to the softmax state, block_s keys per step."""
    padded = keys_ref.shape[0] != length

    def body(i, carry):
      acc, row_max, row_sum = carry
      start = pl.multiple_of(i * block_s, block_s)
      keys = keys_ref[pl.ds(start, block_s), :]
      values = values_ref[pl.ds(start, block_s), :]
      visible = mask_ref[:, pl.ds(start, block_s)] != 0
      scores = jax.lax.dot_general(q, keys, (((1,), (1,)), ((), ())), precision=precision,
                                   preferred_element_type=jnp.float32) * scale
      # Hidden keys get the reference's finite MASKED (a query that sees nothing averages
      # all S + T keys, as the reference does); padding keys get -inf so they never count.
      scores = jnp.where(visible, scores, MASKED)
      if padded:
        real = (start + jnp.arange(block_s)) < length
        scores = jnp.where(real[None, :], scores, -jnp.inf)
      new_max = jnp.maximum(row_max, jnp.max(scores, axis=1))
      correction = jnp.exp(row_max - new_max)
      probs = jnp.exp(scores - new_max[:, None])
      row_sum = correction * row_sum + jnp.sum(probs, axis=1)
      acc = correction[:, None] * acc + jnp.dot(probs.astype(values.dtype), values,
                                                 precision=precision,
                                                 preferred_element_type=jnp.float32)
      return acc, new_max, row_sum

    return jax.lax.fori_loop(0, keys_ref.shape[0] // block_s, body, carry)

  carry = (jnp.zeros(q.shape, jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
           jnp.zeros((rows,), jnp.float32))
  if cache_len:   # an empty cache's one block is all padding: its max would stay -inf
    carry = fold(carry, cache_k_ref, cache_v_ref, cache_mask_ref, cache_len, cache_block)
  acc, _, row_sum = fold(carry, k_ref, v_ref, new_mask_ref, new_len, new_block)
  o_ref[...] = (acc / row_sum[:, None]).astype(o_ref.dtype)


# Each compiling platform's Pallas backend, by its compiler params: Triton for cuda/rocm (jax
# 0.10's default, Mosaic GPU, cannot lower this kernel's dots), Mosaic for tpu with the
# grid's three axes independent.
_TRITON_PARAMS = plgpu.CompilerParams(num_warps=4, num_stages=2)
_COMPILER_PARAMS = {"cuda": _TRITON_PARAMS, "rocm": _TRITON_PARAMS,
                    "tpu": pltpu.CompilerParams(dimension_semantics=("parallel",) * 3)}


@functools.partial(jax.jit, static_argnames=("block_s", "block_m", "interpret"))
def tree_attention_pallas(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array,
                          cache_mask: jax.Array, k: jax.Array, v: jax.Array,
                          new_mask: jax.Array, *, block_s: int = 128, block_m: int = 64,
                          interpret: bool | None = None) -> jax.Array:
  """Pallas tree attention (module doc). interpret: True runs it (slowly) as jnp, for
  testing on CPU; False compiles it (Triton on cuda/rocm, Mosaic on tpu); None (default)
  compiles it on those platforms and interprets it elsewhere, per the platform the program
  is lowered for (`lax.platform_dependent`), not the process's default backend.

  block_s keys are scored per loop step, block_m query rows (T x G, padded) per program;
  both are powers of two >= 16. The cache is only copied when S is not a multiple of its
  key block or D not a power of two; bucketed cache lengths and usual head dims avoid it.
  The new tokens' keys/values are regrouped [B, K, T, D] (a copy of the new tokens only),
  so every block's last two dims are whole array dims, as Mosaic (TPU) requires.
  """
  b, t, h, d = q.shape
  kh, s = cache_k.shape[1], cache_k.shape[2]
  groups = h // kh
  for name, size in (("block_s", block_s), ("block_m", block_m)):
    if size < MIN_TRITON_DIM or size != pl.next_power_of_2(size):
      raise ValueError(f"{name} must be a power of two >= {MIN_TRITON_DIM}, got {size}")
  dim = pow2_at_least(d)
  block_m, rows = query_row_blocks(t * groups, block_m)
  cache_block, cache_seq = _key_blocks(s, block_s)
  new_block, new_seq = _key_blocks(t, block_s)

  pad_cache = lambda x: _pad_axis(_pad_axis(x.astype(q.dtype), 2, cache_seq), 3, dim)
  pad_new = lambda x: _pad_axis(_pad_axis(x.astype(q.dtype).transpose(0, 2, 1, 3), 2,
                                          new_seq), 3, dim)
  squeezed = pl.squeezed
  row_block = pl.BlockSpec((squeezed, squeezed, block_m, dim), lambda i, j, r: (i, j, r, 0))
  kv_block = lambda seq: pl.BlockSpec((squeezed, squeezed, seq, dim),
                                      lambda i, j, r: (i, j, 0, 0))
  mask_block = lambda seq: pl.BlockSpec((squeezed, block_m, seq), lambda i, j, r: (i, r, 0))
  qg = group_query_rows(q, kh, rows, dim)
  operands = (qg, pad_cache(cache_k), pad_cache(cache_v),
              group_mask_rows(cache_mask, groups, rows, cache_seq), pad_new(k), pad_new(v),
              group_mask_rows(new_mask, groups, rows, new_seq))

  def call(*operands, compiler_params=None, interpret=False):
    return pl.pallas_call(
        functools.partial(_kernel, cache_len=s, new_len=t, cache_block=cache_block,
                          new_block=new_block, scale=d ** -0.5),
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        grid=(b, kh, rows // block_m),
        in_specs=[row_block, kv_block(cache_seq), kv_block(cache_seq),
                  mask_block(cache_seq), kv_block(new_seq), kv_block(new_seq),
                  mask_block(new_seq)],
        out_specs=row_block,
        compiler_params=compiler_params,
        interpret=interpret,
        name="tree_attention",
    )(*operands)

  if interpret:
    out = call(*operands, interpret=True)
  else:
    # One traced kernel per backend (cuda and rocm share theirs).
    variants = {id(params): functools.partial(call, compiler_params=params)
                for params in _COMPILER_PARAMS.values()}
    compiled = {p: variants[id(params)] for p, params in _COMPILER_PARAMS.items()}
    out = jax.lax.platform_dependent(
        *operands, **compiled,
        default=None if interpret is False else functools.partial(call, interpret=True))
  return ungroup_query_rows(out, t, h, d)

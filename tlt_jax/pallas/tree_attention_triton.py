"""Tree-verify attention as a hand-written Triton kernel called through jax-triton (GPU).

Same contract as the Pallas kernel (`tree_attention`'s module doc). It walks the cache's
keys, then the new tokens' keys, as one key sequence, but reads each from its own buffer in
place with masked loads (the block that spans both loads from both), so S and D are never
padded and the cache is never copied; only the small query and masks are regrouped, exactly
as for Pallas. triton and jax-triton are imported on first use so the package imports
without the `triton` extra.
"""
from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp

from tlt_jax.pallas.tree_attention import (group_mask_rows, group_query_rows,
                                           pow2_at_least, query_row_blocks,
                                           ungroup_query_rows)
from tlt_jax.reference_ops import MASKED

tl = None  # triton.language, bound by `_load` (Triton resolves kernel names as globals)


def _kernel(q_ptr, cache_k_ptr, cache_v_ptr, cache_mask_ptr, k_ptr, v_ptr, new_mask_ptr,
            out_ptr, cache_len: tl.constexpr, new_len: tl.constexpr,
            num_kv_heads: tl.constexpr, head_dim: tl.constexpr, rows: tl.constexpr,
            scale: tl.constexpr, masked: tl.constexpr, dot_precision: tl.constexpr,
            block_m: tl.constexpr, block_s: tl.constexpr, block_d: tl.constexpr):
  """One (batch row x kv head, block of query rows): online softmax over key blocks of the
  cache [B, K, S, D], then of the new keys [B, T, K, D]."""
  row_head = tl.program_id(0).to(tl.int64)
  batch = row_head // num_kv_heads
  kv_head = row_head % num_kv_heads
  offs_m = tl.program_id(1) * block_m + tl.arange(0, block_m)
  offs_s = tl.arange(0, block_s)
  offs_d = tl.arange(0, block_d)
  d_ok = offs_d < head_dim
  row_offsets = (row_head * rows + offs_m[:, None]) * block_d + offs_d[None, :]
  q = tl.load(q_ptr + row_offsets)
  cache_base = row_head * cache_len * head_dim
  new_base = batch * new_len * num_kv_heads * head_dim + kv_head * head_dim
  row_max = tl.full([block_m], float("-inf"), tl.float32)
  row_sum = tl.zeros([block_m], tl.float32)
  acc = tl.zeros([block_m, block_d], tl.float32)
  for start in range(0, cache_len + new_len, block_s):
    pos = start + offs_s
    in_cache = pos < cache_len
    new_pos = tl.maximum(pos - cache_len, 0)
    is_new = (pos >= cache_len) & (new_pos < new_len)
    cache_ok = in_cache[:, None] & d_ok[None, :]
    new_ok = is_new[:, None] & d_ok[None, :]
    cache_offsets = cache_base + pos[:, None] * head_dim + offs_d[None, :]
    new_offsets = new_base + new_pos[:, None] * (num_kv_heads * head_dim) + offs_d[None, :]
    keys = (tl.load(cache_k_ptr + cache_offsets, mask=cache_ok, other=0.0)
            + tl.load(k_ptr + new_offsets, mask=new_ok, other=0.0))
    values = (tl.load(cache_v_ptr + cache_offsets, mask=cache_ok, other=0.0)
              + tl.load(v_ptr + new_offsets, mask=new_ok, other=0.0))
    visible = (tl.load(cache_mask_ptr + (batch * rows + offs_m[:, None]) * cache_len
                       + pos[None, :], mask=in_cache[None, :], other=0)
               + tl.load(new_mask_ptr + (batch * rows + offs_m[:, None]) * new_len
                         + new_pos[None, :], mask=is_new[None, :], other=0))
    scores = tl.dot(q, tl.trans(keys), input_precision=dot_precision) * scale
    scores = tl.where(visible != 0, scores, masked)
    scores = tl.where((in_cache | is_new)[None, :], scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, 1))
    correction = tl.exp(row_max - new_max)
    probs = tl.exp(scores - new_max[:, None])
    row_sum = correction * row_sum + tl.sum(probs, 1)
    acc = correction[:, None] * acc + tl.dot(probs.to(values.dtype), values,
                                             input_precision=dot_precision)
    row_max = new_max
  out = acc / row_sum[:, None]
  tl.store(out_ptr + row_offsets, out.to(out_ptr.dtype.element_ty))


@functools.cache
def _load():
  """(jax_triton, jitted kernel, name of triton_call's output-shape keyword)."""
  global tl
  try:
    import jax_triton
    import triton
    import triton.language
  except ImportError as err:
    raise ImportError(
        "tree_attention_triton needs triton and jax-triton on a CUDA machine: install the "
        "`triton` extra (pip install -e '.[cuda12,triton]')") from err
  tl = triton.language
  # jax-triton renamed out_shape= to out_type= (the old name still works, with a warning).
  params = inspect.signature(jax_triton.triton_call).parameters
  out_keyword = "out_type" if "out_type" in params else "out_shape"
  return jax_triton, triton.jit(_kernel), out_keyword


def tree_attention_triton(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array,
                          cache_mask: jax.Array, k: jax.Array, v: jax.Array,
                          new_mask: jax.Array, *, block_s: int = 64, block_m: int = 64
                          ) -> jax.Array:
  """q [B, T, H, D], cache_k/v [B, K, S, D], cache_mask [B, T, S], k/v [B, T, K, D],
  new_mask [B, T, T] -> [B, T, H, D] in q.dtype."""
  jax_triton, kernel, out_keyword = _load()
  b, t, h, d = q.shape
  kh, s = cache_k.shape[1], cache_k.shape[2]
  groups = h // kh
  dim = pow2_at_least(d)
  block_s = min(block_s, pow2_at_least(s + t))
  block_m, rows = query_row_blocks(t * groups, block_m)
  qg = group_query_rows(q, kh, rows, dim)
  out = jax_triton.triton_call(
      qg, cache_k.astype(q.dtype), cache_v.astype(q.dtype),
      group_mask_rows(cache_mask, groups, rows, s), k.astype(q.dtype), v.astype(q.dtype),
      group_mask_rows(new_mask, groups, rows, t),
      kernel=kernel, grid=(b * kh, rows // block_m), num_warps=4, num_stages=2,
      cache_len=s, new_len=t, num_kv_heads=kh, head_dim=d, rows=rows, scale=d ** -0.5,
      masked=MASKED, dot_precision="ieee" if q.dtype == jnp.float32 else "tf32",
      block_m=block_m, block_s=block_s, block_d=dim,
      **{out_keyword: jax.ShapeDtypeStruct(qg.shape, q.dtype)})
  return ungroup_query_rows(out, t, h, d)

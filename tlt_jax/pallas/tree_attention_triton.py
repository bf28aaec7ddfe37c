"""Tree-verify attention as a hand-written Triton kernel called through jax-triton (GPU).

Same contract as `tree_attention_reference`. Unlike the Pallas kernel it reads its keys and
values in place with masked loads, so S and D are never padded (no copy for padding); only
the small query and mask are regrouped, exactly as for Pallas. triton and jax-triton are imported on
first use so the package imports without the `triton` extra.
"""
from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp

from tlt_jax.models.attention import MASKED
from tlt_jax.pallas.tree_attention import (group_mask_rows, group_query_rows,
                                           pow2_at_least, query_row_blocks,
                                           ungroup_query_rows)

tl = None  # triton.language, bound by `_load` (Triton resolves kernel names as globals)


def _kernel(q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr,
            seq_len: tl.constexpr, num_kv_heads: tl.constexpr, head_dim: tl.constexpr,
            rows: tl.constexpr, scale: tl.constexpr, masked: tl.constexpr,
            dot_precision: tl.constexpr, block_m: tl.constexpr, block_s: tl.constexpr,
            block_d: tl.constexpr):
  """One (batch row x kv head, block of query rows): online softmax over key blocks."""
  row_head = tl.program_id(0).to(tl.int64)
  batch = row_head // num_kv_heads
  kv_head = row_head % num_kv_heads
  offs_m = tl.program_id(1) * block_m + tl.arange(0, block_m)
  offs_s = tl.arange(0, block_s)
  offs_d = tl.arange(0, block_d)
  d_ok = offs_d < head_dim
  row_offsets = (row_head * rows + offs_m[:, None]) * block_d + offs_d[None, :]
  q = tl.load(q_ptr + row_offsets)
  kv_base = batch * seq_len * num_kv_heads * head_dim + kv_head * head_dim
  mask_base = batch * rows * seq_len
  row_max = tl.full([block_m], float("-inf"), tl.float32)
  row_sum = tl.zeros([block_m], tl.float32)
  acc = tl.zeros([block_m, block_d], tl.float32)
  for start in range(0, seq_len, block_s):
    pos = start + offs_s
    s_ok = pos < seq_len
    kv_offsets = kv_base + pos[:, None] * (num_kv_heads * head_dim) + offs_d[None, :]
    kv_ok = s_ok[:, None] & d_ok[None, :]
    keys = tl.load(k_ptr + kv_offsets, mask=kv_ok, other=0.0)
    values = tl.load(v_ptr + kv_offsets, mask=kv_ok, other=0.0)
    visible = tl.load(mask_ptr + mask_base + offs_m[:, None] * seq_len + pos[None, :],
                      mask=s_ok[None, :], other=0)
    scores = tl.dot(q, tl.trans(keys), input_precision=dot_precision) * scale
    scores = tl.where(visible != 0, scores, masked)
    scores = tl.where(s_ok[None, :], scores, float("-inf"))
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


def tree_attention_triton(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *,
                          block_s: int = 64, block_m: int = 64) -> jax.Array:
  """q [B, T, H, D], k/v [B, S, K, D], mask [B, T, S] bool -> [B, T, H, D] in q.dtype."""
  jax_triton, kernel, out_keyword = _load()
  b, t, h, d = q.shape
  s, kh = k.shape[1], k.shape[2]
  groups = h // kh
  dim = pow2_at_least(d)
  block_s = min(block_s, pow2_at_least(s))
  block_m, rows = query_row_blocks(t * groups, block_m)
  qg = group_query_rows(q, kh, rows, dim)
  out = jax_triton.triton_call(
      qg, k.astype(q.dtype), v.astype(q.dtype), group_mask_rows(mask, groups, rows, s),
      kernel=kernel, grid=(b * kh, rows // block_m), num_warps=4, num_stages=2,
      seq_len=s, num_kv_heads=kh, head_dim=d, rows=rows, scale=d ** -0.5, masked=MASKED,
      dot_precision="ieee" if q.dtype == jnp.float32 else "tf32",
      block_m=block_m, block_s=block_s, block_d=dim,
      **{out_keyword: jax.ShapeDtypeStruct(qg.shape, q.dtype)})
  return ungroup_query_rows(out, t, h, d)

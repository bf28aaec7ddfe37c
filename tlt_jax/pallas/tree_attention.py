"""Tree-verify attention: T new tokens (a draft tree) against each row's KV cache.

The kernels compute `tlt_jax.models.attention.attend` over one key set (cache and new
keys together), and differentiate through it: q [B, T, H, D], keys/values [B, S, K, D] (GQA, H = K * G), mask [B, T, S] bool
(the row's committed prefix plus the query's tree ancestors) -> [B, T, H, D] in q.dtype.

The Pallas kernel runs one program per (batch row, kv head, block of query rows). Its query rows
are the T tree tokens x G heads sharing that kv head, flattened so one matmul serves the
whole group and each key block is read once; keys are streamed in blocks with an online
softmax in float32. Shapes are padded to powers of two (>= 16) where Triton needs them.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tlt_jax.models.attention import MASKED, attend

IMPLS = ("auto", "reference", "pallas", "triton")
MIN_TRITON_DIM = 16  # tl.dot needs every matmul dimension >= 16


def tree_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array,
                             mask: jax.Array) -> jax.Array:
  """The models' own attention (`attend`) over this one key set: the kernels' oracle."""
  b, _, kh, d = k.shape
  no_cache = jnp.zeros((b, kh, 0, d), k.dtype)
  return attend(q, no_cache, no_cache, mask[..., :0], k, v, mask)


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


def _kernel(q_ref, k_ref, v_ref, mask_ref, o_ref, *, seq_len: int, block_s: int,
            scale: float):
  """One (batch row, kv head, query-row block): online softmax over key blocks, float32."""
  q = q_ref[...]
  rows = q.shape[0]
  num_blocks = k_ref.shape[0] // block_s
  padded = k_ref.shape[0] != seq_len

  def body(i, carry):
    acc, row_max, row_sum = carry
    start = pl.multiple_of(i * block_s, block_s)
    keys = k_ref[pl.ds(start, block_s), :]
    values = v_ref[pl.ds(start, block_s), :]
    visible = mask_ref[:, pl.ds(start, block_s)] != 0
    scores = jax.lax.dot_general(q, keys, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32) * scale
    # Hidden keys get the reference's finite MASKED (a query that sees nothing averages all
    # S keys, as the reference does); padding keys past S get -inf so they never count.
    scores = jnp.where(visible, scores, MASKED)
    if padded:
      real = (start + jnp.arange(block_s)) < seq_len
      scores = jnp.where(real[None, :], scores, -jnp.inf)
    new_max = jnp.maximum(row_max, jnp.max(scores, axis=1))
    correction = jnp.exp(row_max - new_max)
    probs = jnp.exp(scores - new_max[:, None])
    row_sum = correction * row_sum + jnp.sum(probs, axis=1)
    acc = correction[:, None] * acc + jnp.dot(probs.astype(values.dtype), values,
                                               preferred_element_type=jnp.float32)
    return acc, new_max, row_sum

  init = (jnp.zeros(q.shape, jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
          jnp.zeros((rows,), jnp.float32))
  acc, _, row_sum = jax.lax.fori_loop(0, num_blocks, body, init)
  o_ref[...] = (acc / row_sum[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_s", "block_m", "interpret"))
def tree_attention_pallas(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *,
                          block_s: int = 128, block_m: int = 64,
                          interpret: bool = False) -> jax.Array:
  """Pallas tree attention; `interpret=True` runs it (slowly) on CPU for testing.

  block_s keys are scored per loop step, block_m query rows (T x G, padded) per program;
  both are powers of two >= 16. The cache is only copied when S is not a multiple of the
  key block or D not a power of two; bucketed cache lengths and usual head dims avoid it.
  """
  b, t, h, d = q.shape
  s, kh = k.shape[1], k.shape[2]
  groups = h // kh
  for name, size in (("block_s", block_s), ("block_m", block_m)):
    if size < MIN_TRITON_DIM or size != pl.next_power_of_2(size):
      raise ValueError(f"{name} must be a power of two >= {MIN_TRITON_DIM}, got {size}")
  dim = pow2_at_least(d)
  block_s = min(block_s, pow2_at_least(s))
  block_m, rows = query_row_blocks(t * groups, block_m)
  seq = pl.cdiv(s, block_s) * block_s

  qg = group_query_rows(q, kh, rows, dim)
  keys = _pad_axis(_pad_axis(k.astype(q.dtype), 1, seq), 3, dim)
  values = _pad_axis(_pad_axis(v.astype(q.dtype), 1, seq), 3, dim)
  visible = group_mask_rows(mask, groups, rows, seq)

  squeezed = pl.squeezed
  row_block = pl.BlockSpec((squeezed, squeezed, block_m, dim), lambda i, j, r: (i, j, r, 0))
  kv_block = pl.BlockSpec((squeezed, seq, squeezed, dim), lambda i, j, r: (i, 0, j, 0))
  mask_block = pl.BlockSpec((squeezed, block_m, seq), lambda i, j, r: (i, r, 0))
  out = pl.pallas_call(
      functools.partial(_kernel, seq_len=s, block_s=block_s, scale=d ** -0.5),
      out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
      grid=(b, kh, rows // block_m),
      in_specs=[row_block, kv_block, kv_block, mask_block],
      out_specs=row_block,
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret,
      name="tree_attention",
  )(qg, keys, values, visible)
  return ungroup_query_rows(out, t, h, d)


def resolve_impl(impl: str, backend: str | None = None) -> str:
  """'auto' -> the compiled kernel on GPU, the jnp reference elsewhere."""
  if impl not in IMPLS:
    raise ValueError(f"tree attention impl must be one of {', '.join(IMPLS)}; got {impl!r}")
  if impl != "auto":
    return impl
  return "pallas" if (backend or jax.default_backend()) == "gpu" else "reference"


def tree_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *,
                   impl: str = "auto", interpret: bool | None = None) -> jax.Array:
  """Dispatches to an implementation; interpret=None interprets Pallas off-GPU only."""
  chosen = resolve_impl(impl)
  if chosen == "reference":
    return tree_attention_reference(q, k, v, mask)
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  return _kernel_with_reference_vjp(q, k, v, mask, chosen, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _kernel_with_reference_vjp(q, k, v, mask, impl: str, interpret: bool) -> jax.Array:
  """A kernel forward; its backward is the reference's (`pallas_call` has no transpose
  rule, so a loss through the kernel, such as the drafter's, could not be differentiated)."""
  if impl == "triton":
    from tlt_jax.pallas.tree_attention_triton import tree_attention_triton
    return tree_attention_triton(q, k, v, mask)
  return tree_attention_pallas(q, k, v, mask, interpret=interpret)


def _kernel_fwd(q, k, v, mask, impl, interpret):
  return _kernel_with_reference_vjp(q, k, v, mask, impl, interpret), (q, k, v, mask)


def _reference_bwd(impl, interpret, residuals, grad):
  del impl, interpret
  q, k, v, mask = residuals
  _, pullback = jax.vjp(lambda q, k, v: tree_attention_reference(q, k, v, mask), q, k, v)
  return (*pullback(grad), None)


_kernel_with_reference_vjp.defvjp(_kernel_fwd, _reference_bwd)

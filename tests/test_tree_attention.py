"""Tree-verify attention kernels against the transformer's jnp attention.

On CPU the Pallas kernel runs in interpret mode (the same kernel body, executed by XLA), so
shapes stay small; it is also lowered for CUDA here to catch Triton-only shape rules. The
compiled Pallas and Triton kernels are compared on a GPU only.
"""
from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.pallas.tree_attention import (resolve_impl, tree_attention, tree_attention_pallas,
                                           tree_attention_reference)

FP32_TOL = 1e-5


def _inputs(seed, batch, t, heads, kv_heads, dim, seq, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((batch, t, heads, dim))
  k = rng.standard_normal((batch, seq, kv_heads, dim))
  v = rng.standard_normal((batch, seq, kv_heads, dim))
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v)), rng


def _random_mask(rng, batch, t, seq):
  """Half the keys visible at random, and at least one per query."""
  mask = rng.random((batch, t, seq)) < 0.5
  mask[np.arange(batch)[:, None], np.arange(t)[None, :], rng.integers(0, seq, (batch, t))] = True
  return jnp.asarray(mask)


def _tree_mask(rng, batch, t, seq):
  """Verify-pass mask: each row's committed prefix (random length), then the T tree
  tokens written right after it, each seeing itself and its ancestors."""
  parents = [-1] + [int(rng.integers(0, i)) for i in range(1, t)]
  ancestors = np.eye(t, dtype=bool)
  for node, parent in enumerate(parents):
    if parent >= 0:
      ancestors[node] |= ancestors[parent]
  mask = np.zeros((batch, t, seq), bool)
  for row, length in enumerate(rng.integers(1, seq - t + 1, batch)):
    mask[row, :, :length] = True
    mask[row, :, length:length + t] = ancestors
  return jnp.asarray(mask)


def _max_diff(a, b):
  return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


# (batch, T, H, K, D, S, block_s, block_m): T in {1, 5, 16}, GQA groups 1 and 3, S never a
# multiple of block_s, one D that is not a power of two, one case split into row blocks.
RANDOM_CASES = [
    (2, 1, 4, 4, 16, 37, 16, 64),
    (2, 5, 6, 2, 16, 50, 16, 64),
    (1, 16, 6, 2, 32, 70, 32, 16),
    (2, 5, 4, 4, 24, 40, 16, 64),
]


@pytest.mark.parametrize("case", RANDOM_CASES, ids=lambda c: "b{}t{}h{}k{}d{}s{}".format(*c))
def test_pallas_matches_reference_on_random_masks(case):
  batch, t, heads, kv_heads, dim, seq, block_s, block_m = case
  (q, k, v), rng = _inputs(sum(case), batch, t, heads, kv_heads, dim, seq)
  mask = _random_mask(rng, batch, t, seq)
  out = tree_attention_pallas(q, k, v, mask, block_s=block_s, block_m=block_m, interpret=True)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert _max_diff(out, tree_attention_reference(q, k, v, mask)) <= FP32_TOL


@pytest.mark.parametrize("case", [(3, 5, 4, 4, 64, 48, 32), (2, 16, 6, 2, 64, 90, 32)],
                         ids=["t5-g1", "t16-g3"])
def test_pallas_matches_reference_on_tree_masks(case):
  batch, t, heads, kv_heads, dim, seq, block_s = case
  (q, k, v), rng = _inputs(sum(case), batch, t, heads, kv_heads, dim, seq)
  mask = _tree_mask(rng, batch, t, seq)
  out = tree_attention_pallas(q, k, v, mask, block_s=block_s, interpret=True)
  assert _max_diff(out, tree_attention_reference(q, k, v, mask)) <= FP32_TOL


def test_pallas_query_that_sees_nothing_matches_reference():
  """The reference's finite mask value averages all S keys; padding keys must not count."""
  (q, k, v), rng = _inputs(7, 2, 5, 6, 2, 16, 40)
  mask = np.array(_random_mask(rng, 2, 5, 40))
  mask[1, 3] = False
  mask = jnp.asarray(mask)
  out = tree_attention_pallas(q, k, v, mask, block_s=16, interpret=True)
  assert _max_diff(out, tree_attention_reference(q, k, v, mask)) <= FP32_TOL


def test_pallas_bfloat16_close_to_reference():
  (q, k, v), rng = _inputs(11, 2, 5, 6, 2, 32, 50, dtype=jnp.bfloat16)
  mask = _tree_mask(rng, 2, 5, 50)
  out = tree_attention_pallas(q, k, v, mask, block_s=16, interpret=True)
  assert out.dtype == jnp.bfloat16
  assert _max_diff(out, tree_attention_reference(q, k, v, mask)) <= 3e-2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_pallas_lowers_for_cuda(dtype):
  """Lowering to Triton IR needs no GPU, and enforces its power-of-two and dot rules."""
  q = jax.ShapeDtypeStruct((2, 5, 6, 64), dtype)
  kv = jax.ShapeDtypeStruct((2, 50, 2, 64), dtype)
  mask = jax.ShapeDtypeStruct((2, 5, 50), jnp.bool_)
  lowered = jax.jit(tree_attention_pallas).trace(q, kv, kv, mask).lower(
      lowering_platforms=("cuda",))
  assert "triton" in lowered.as_text()


def test_resolve_impl():
  assert resolve_impl("auto", "cpu") == "reference"
  assert resolve_impl("auto", "gpu") == "pallas"
  assert resolve_impl("triton", "cpu") == "triton"
  with pytest.raises(ValueError, match="auto, reference, pallas, triton"):
    resolve_impl("flash")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU default")
def test_dispatcher_uses_reference_on_cpu_and_interprets_pallas():
  (q, k, v), rng = _inputs(3, 2, 5, 6, 2, 16, 40)
  mask = _tree_mask(rng, 2, 5, 40)
  reference = tree_attention_reference(q, k, v, mask)
  np.testing.assert_array_equal(tree_attention(q, k, v, mask), reference)
  assert _max_diff(tree_attention(q, k, v, mask, impl="pallas"), reference) <= FP32_TOL
  with pytest.raises(ValueError, match="impl must be one of"):
    tree_attention(q, k, v, mask, impl="flash")


@pytest.mark.skipif(importlib.util.find_spec("jax_triton") is not None,
                    reason="jax-triton is installed")
def test_triton_without_jax_triton_names_the_extra():
  (q, k, v), rng = _inputs(5, 1, 1, 2, 2, 16, 16)
  with pytest.raises(ImportError, match="`triton` extra"):
    tree_attention(q, k, v, _random_mask(rng, 1, 1, 16), impl="triton")


def _gpu_with_jax_triton() -> bool:
  return jax.default_backend() == "gpu" and importlib.util.find_spec("jax_triton") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_with_jax_triton(), reason="needs a CUDA GPU and jax-triton")
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 3e-2)],
                         ids=["f32", "bf16"])
@pytest.mark.parametrize("case", [(4, 16, 12, 4, 64, 300), (2, 1, 8, 8, 128, 1000),
                                  (8, 5, 14, 2, 64, 4096)], ids=["t16-g3", "t1-g1", "t5-g7"])
def test_compiled_kernels_match_reference_on_gpu(case, dtype, tol):
  from tlt_jax.pallas.tree_attention_triton import tree_attention_triton
  batch, t, heads, kv_heads, dim, seq = case
  (q, k, v), rng = _inputs(sum(case), batch, t, heads, kv_heads, dim, seq, dtype)
  mask = _tree_mask(rng, batch, t, seq)
  with jax.default_matmul_precision("highest"):
    reference = jax.jit(tree_attention_reference)(q, k, v, mask)
  pallas = tree_attention_pallas(q, k, v, mask, interpret=False)
  triton = jax.jit(tree_attention_triton)(q, k, v, mask)
  assert _max_diff(pallas, reference) <= tol
  assert _max_diff(triton, reference) <= tol

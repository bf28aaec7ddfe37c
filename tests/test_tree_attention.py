"""Tree-verify attention kernels against the models' attention (`attend`), with the cache
read in place and the new tokens' keys as a block of their own.

On CPU the Pallas kernel runs in interpret mode (the same kernel body, executed by XLA), so
shapes stay small; it is also lowered for CUDA here to catch Triton-only shape rules. The
compiled Pallas and Triton kernels are compared on a GPU only. The C++ CPU kernel
(`tlt_jax.cpu.attention`) runs here wherever it builds.
"""
from __future__ import annotations

import importlib.util
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax import ops
from tlt_jax.cpu import attention as cpu_attention
from tlt_jax.cpu import kernels as cpu_kernels
from tlt_jax.cpu import self_attention as cpu_self_attention
from tlt_jax.models import transformer
from tlt_jax.models.config import ModelConfig
from tlt_jax.data.packing import block_causal_mask
from tlt_jax.models.kv_cache import init_cache
from tlt_jax.pallas.tree_attention import tree_attention_pallas
from tlt_jax.reference_ops import attend
from tlt_jax.rollout.weights import rollout_layout

FP32_TOL = 1e-5


def _inputs(seed, batch, t, heads, kv_heads, dim, seq, dtype=jnp.float32):
  """q [B, T, H, D], cache keys/values [B, K, S, D], new keys/values [B, T, K, D]."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  return (normal(batch, t, heads, dim), normal(batch, kv_heads, seq, dim),
          normal(batch, kv_heads, seq, dim), normal(batch, t, kv_heads, dim),
          normal(batch, t, kv_heads, dim)), rng


def _random_masks(rng, batch, t, seq):
  """(cache_mask, new_mask): half the keys visible at random, at least one per query."""
  mask = rng.random((batch, t, seq + t)) < 0.5
  seen = rng.integers(0, seq + t, (batch, t))
  mask[np.arange(batch)[:, None], np.arange(t)[None, :], seen] = True
  return jnp.asarray(mask[..., :seq]), jnp.asarray(mask[..., seq:])


def _tree_masks(rng, batch, t, seq):
  """Verify-pass masks: each row's committed prefix of the cache (random length), and a
  random tree over the new tokens, each seeing itself and its ancestors."""
  parents = [-1] + [int(rng.integers(0, i)) for i in range(1, t)]
  ancestors = np.eye(t, dtype=bool)
  for node, parent in enumerate(parents):
    if parent >= 0:
      ancestors[node] |= ancestors[parent]
  cache_mask = np.zeros((batch, t, seq), bool)
  for row, length in enumerate(rng.integers(1, seq + 1, batch)):
    cache_mask[row, :, :length] = True
  return jnp.asarray(cache_mask), jnp.asarray(np.broadcast_to(ancestors, (batch, t, t)))


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
  inputs, rng = _inputs(sum(case), batch, t, heads, kv_heads, dim, seq)
  q, cache_k, cache_v, k, v = inputs
  cache_mask, new_mask = _random_masks(rng, batch, t, seq)
  out = tree_attention_pallas(q, cache_k, cache_v, cache_mask, k, v, new_mask,
                              block_s=block_s, block_m=block_m, interpret=True)
  assert out.shape == q.shape and out.dtype == q.dtype
  want = attend(q, cache_k, cache_v, cache_mask, k, v, new_mask)
  assert _max_diff(out, want) <= FP32_TOL


@pytest.mark.parametrize("case", [(3, 5, 4, 4, 64, 48, 32), (2, 16, 6, 2, 64, 90, 32),
                                  (2, 40, 6, 2, 32, 64, 16)],
                         ids=["t5-g1", "t16-g3", "t40-g3"])
def test_pallas_matches_reference_on_tree_masks(case):
  """The last case streams the new keys in several blocks (T > block_s)."""
  batch, t, heads, kv_heads, dim, seq, block_s = case
  inputs, rng = _inputs(sum(case), batch, t, heads, kv_heads, dim, seq)
  q, cache_k, cache_v, k, v = inputs
  cache_mask, new_mask = _tree_masks(rng, batch, t, seq)
  out = tree_attention_pallas(q, cache_k, cache_v, cache_mask, k, v, new_mask,
                              block_s=block_s, interpret=True)
  assert _max_diff(out, attend(q, cache_k, cache_v, cache_mask, k, v, new_mask)) <= FP32_TOL


def test_pallas_prefill_against_an_empty_cache_matches_reference():
  """A prefill attends among its own tokens alone (a zero-slot cache), causally."""
  inputs, _ = _inputs(5, 2, 37, 6, 2, 16, 0)
  q, cache_k, cache_v, k, v = inputs
  cache_mask = jnp.zeros((2, 37, 0), bool)
  new_mask = transformer.causal_mask(2, 37)
  out = tree_attention_pallas(q, cache_k, cache_v, cache_mask, k, v, new_mask, block_s=16,
                              interpret=True)
  assert _max_diff(out, attend(q, cache_k, cache_v, cache_mask, k, v, new_mask)) <= FP32_TOL


def test_pallas_query_that_sees_nothing_matches_reference():
  """The reference's finite mask value averages all S + T keys; padding keys must not
  count."""
  inputs, rng = _inputs(7, 2, 5, 6, 2, 16, 40)
  q, cache_k, cache_v, k, v = inputs
  cache_mask, new_mask = (np.array(m) for m in _random_masks(rng, 2, 5, 40))
  cache_mask[1, 3] = new_mask[1, 3] = False
  cache_mask, new_mask = jnp.asarray(cache_mask), jnp.asarray(new_mask)
  out = tree_attention_pallas(q, cache_k, cache_v, cache_mask, k, v, new_mask, block_s=16,
                              interpret=True)
  assert _max_diff(out, attend(q, cache_k, cache_v, cache_mask, k, v, new_mask)) <= FP32_TOL


def test_pallas_bfloat16_close_to_reference():
  inputs, rng = _inputs(11, 2, 5, 6, 2, 32, 50, dtype=jnp.bfloat16)
  q, cache_k, cache_v, k, v = inputs
  cache_mask, new_mask = _tree_masks(rng, 2, 5, 50)
  out = tree_attention_pallas(q, cache_k, cache_v, cache_mask, k, v, new_mask, block_s=16,
                              interpret=True)
  assert out.dtype == jnp.bfloat16
  assert _max_diff(out, attend(q, cache_k, cache_v, cache_mask, k, v, new_mask)) <= 3e-2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_pallas_lowers_for_cuda(dtype):
  """Lowering to Triton IR needs no GPU, and enforces its power-of-two and dot rules. With
  no GPU present, jax 0.11 lowers for one it is told of (an abstract device in the mesh)."""
  q = jax.ShapeDtypeStruct((2, 5, 6, 64), dtype)
  cache_kv = jax.ShapeDtypeStruct((2, 2, 50, 64), dtype)
  new_kv = jax.ShapeDtypeStruct((2, 5, 2, 64), dtype)
  cache_mask = jax.ShapeDtypeStruct((2, 5, 50), jnp.bool_)
  new_mask = jax.ShapeDtypeStruct((2, 5, 5), jnp.bool_)
  h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                abstract_device=h100)):
    lowered = jax.jit(tree_attention_pallas).trace(
        q, cache_kv, cache_kv, cache_mask, new_kv, new_kv, new_mask).lower(
            lowering_platforms=("cuda",))
  assert "triton" in lowered.as_text()


def _equations(jaxpr):
  """Every equation of a jaxpr that holds no jaxpr of its own, through jit, scan, ...; a
  kernel's (pallas_call's) body, which works on blocks, is not entered."""
  for eqn in jaxpr.eqns:
    subs = [getattr(sub, "jaxpr", sub)
            for param in eqn.params.values() if eqn.primitive.name != "pallas_call"
            for sub in (param if isinstance(param, (tuple, list)) else (param,))]
    subs = [sub for sub in subs if hasattr(sub, "eqns")]
    if not subs:
      yield eqn
    for sub in subs:
      yield from _equations(sub)


@pytest.mark.parametrize("new_tokens", [1, 5], ids=["decode", "verify"])
def test_kernel_path_reads_the_cache_in_place(new_tokens):
  """A decode step and a tree verify through the Pallas kernel: outside the kernel nothing
  but a view of a layer's cache (squeeze) and the cache write (scatter) yields an array as
  large as a layer's cache (no copy, transpose or concatenation with the new keys), and the
  kernel computes what the jnp path does."""
  config = ModelConfig(model_type="qwen3", vocab_size=67, hidden_size=64, intermediate_size=96,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True,
                       max_position_embeddings=512)
  batch, cache_len = 2, 256
  params = rollout_layout(transformer.init_params(config, jax.random.key(0)))
  cache = init_cache(config, batch, cache_len, per_layer=True)
  prompt = jnp.asarray(np.random.RandomState(0).randint(0, config.vocab_size, (batch, 9)))
  _, cache = transformer.forward(params, config, prompt,
                                 jnp.broadcast_to(jnp.arange(9), (batch, 9)), cache)
  cache = cache.advance(jnp.array([9, 6]))
  tokens = prompt[:, :new_tokens]
  positions = cache.lengths[:, None] + jnp.arange(new_tokens)
  step = lambda impl: transformer.forward_new_kv(params, config, tokens, positions, cache,
                                                 attention_impl=impl)[0]
  layer_cache = batch * config.num_kv_heads * cache_len * config.head_dim
  jaxpr = jax.make_jaxpr(lambda: transformer.forward(
      params, config, tokens, positions, cache, attention_impl="pallas"))().jaxpr
  names = {eqn.primitive.name for eqn in _equations(jaxpr)}
  assert "pallas_call" in names
  large = [(eqn.primitive.name, var.aval.shape) for eqn in _equations(jaxpr)
           for var in eqn.outvars if math.prod(var.aval.shape) >= layer_cache]
  assert all(name in ("squeeze", "scatter") for name, _ in large), large
  assert _max_diff(step("pallas"), step("reference")) <= FP32_TOL


def test_resolve_impl():
  # The CPU kernel needs its build and the CPU backend in this process (not so on a GPU).
  on_cpu = "cpu" if cpu_kernels.enabled(jnp.float32) else "reference"
  assert ops.resolve_attention("auto", "cpu") == on_cpu
  assert ops.resolve_attention("auto", "cpu", sharded=True) == "reference"
  assert ops.resolve_attention("auto", "gpu") == "pallas"
  assert ops.resolve_attention("triton", "cpu") == "triton"
  with pytest.raises(ValueError, match="auto, reference, pallas, triton, cpu"):
    ops.resolve_attention("flash")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU default")
def test_dispatcher_on_cpu_and_interpreted_pallas():
  """auto: the CPU kernel for a few new tokens where it builds, the reference for a prefill
  (more than MAX_NEW_TOKENS) and for bfloat16; cpu: the reference for a prefill."""
  inputs, rng = _inputs(3, 2, 5, 6, 2, 16, 40)
  q, cache_k, cache_v, k, v = inputs
  masks = _tree_masks(rng, 2, 5, 40)
  args = (q, cache_k, cache_v, masks[0], k, v, masks[1])
  reference = attend(*args)
  assert _max_diff(ops.attention(*args), reference) <= FP32_TOL
  assert _max_diff(ops.attention(*args, impl="pallas"), reference) <= FP32_TOL
  jaxpr = lambda *a: str(jax.make_jaxpr(ops.attention)(*a))
  if cpu_kernels.build_problem() is None:
    assert "tlt_attention" in jaxpr(*args)
  prefill, _ = _inputs(4, 1, cpu_attention.MAX_NEW_TOKENS + 1, 6, 2, 16, 0)
  t = cpu_attention.MAX_NEW_TOKENS + 1
  prefill_args = (*prefill[:3], jnp.zeros((1, t, 0), bool), *prefill[3:],
                  transformer.causal_mask(1, t))
  assert "tlt_attention" not in jaxpr(*prefill_args)
  assert "tlt_attention" not in str(jax.make_jaxpr(
      lambda *a: ops.attention(*a, impl="cpu"))(*prefill_args))
  bf16 = [x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x for x in args]
  assert "tlt_attention" not in jaxpr(*bf16)
  with pytest.raises(ValueError, match="impl must be one of"):
    ops.attention(*args, impl="flash")


@pytest.mark.skipif(importlib.util.find_spec("jax_triton") is not None,
                    reason="jax-triton is installed")
def test_triton_without_jax_triton_names_the_extra():
  inputs, rng = _inputs(5, 1, 1, 2, 2, 16, 16)
  q, cache_k, cache_v, k, v = inputs
  cache_mask, new_mask = _random_masks(rng, 1, 1, 16)
  with pytest.raises(ImportError, match="`triton` extra"):
    ops.attention(q, cache_k, cache_v, cache_mask, k, v, new_mask, impl="triton")


def _gpu_with_jax_triton() -> bool:
  return jax.default_backend() == "gpu" and importlib.util.find_spec("jax_triton") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_with_jax_triton(), reason="needs a CUDA GPU and jax-triton")
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 3e-2)],
                         ids=["f32", "bf16"])
@pytest.mark.parametrize("case", [(4, 16, 12, 4, 64, 300), (2, 1, 8, 8, 128, 1000),
                                  (8, 5, 14, 2, 64, 4096), (2, 100, 6, 2, 64, 0)],
                         ids=["t16-g3", "t1-g1", "t5-g7", "prefill-t100"])
def test_compiled_kernels_match_reference_on_gpu(case, dtype, tol):
  from tlt_jax.pallas.tree_attention_triton import tree_attention_triton
  batch, t, heads, kv_heads, dim, seq = case
  inputs, rng = _inputs(sum(case), batch, t, heads, kv_heads, dim, seq, dtype)
  masks = _tree_masks(rng, batch, t, seq) if seq else (
      jnp.zeros((batch, t, 0), bool), transformer.causal_mask(batch, t))
  q, cache_k, cache_v, k, v = inputs
  args = (q, cache_k, cache_v, masks[0], k, v, masks[1])
  with jax.default_matmul_precision("highest"):
    reference = jax.jit(attend)(*args)
  pallas = tree_attention_pallas(*args, interpret=False)
  triton = jax.jit(tree_attention_triton)(*args)
  assert _max_diff(pallas, reference) <= tol
  assert _max_diff(triton, reference) <= tol


needs_cpu_kernels = pytest.mark.skipif(
    cpu_kernels.build_problem() is not None,
    reason=f"CPU kernels unavailable: {cpu_kernels.build_problem()}")


def _cpu(*args):
  return jax.jit(cpu_attention.cpu_attention)(*args)


@needs_cpu_kernels
@pytest.mark.parametrize("case", [(2, 1, 9, 3, 64, 37), (3, 5, 4, 4, 16, 50),
                                  (1, 16, 6, 2, 128, 70), (2, 3, 24, 2, 8, 9)],
                         ids=["decode-g3", "t5-g1", "t16-d128", "g12-blocks"])
@pytest.mark.parametrize("masks", ["random", "tree"])
def test_cpu_kernel_matches_reference(case, masks):
  """Decode (T = 1, GQA 3 as SmolLM2) and verify shapes; the last case splits a kv head's
  T x G = 36 query rows into blocks."""
  batch, t, heads, kv_heads, dim, seq = case
  inputs, rng = _inputs(sum(case), batch, t, heads, kv_heads, dim, seq)
  q, cache_k, cache_v, k, v = inputs
  make = _random_masks if masks == "random" else _tree_masks
  cache_mask, new_mask = make(rng, batch, t, seq)
  out = _cpu(q, cache_k, cache_v, cache_mask, k, v, new_mask)
  assert out.shape == q.shape and out.dtype == jnp.float32
  assert _max_diff(out, attend(q, cache_k, cache_v, cache_mask, k, v, new_mask)) <= FP32_TOL


@needs_cpu_kernels
def test_cpu_kernel_edge_cases_match_reference():
  """A query that sees nothing averages all S + T values (the reference's finite mask);
  a zero-slot cache; scores far apart (weights that underflow to 0 in the reference)."""
  inputs, rng = _inputs(7, 2, 5, 6, 2, 16, 40)
  q, cache_k, cache_v, k, v = inputs
  cache_mask, new_mask = (np.array(m) for m in _random_masks(rng, 2, 5, 40))
  cache_mask[1, 3] = new_mask[1, 3] = False
  args = (q * 30, cache_k, cache_v, jnp.asarray(cache_mask), k, v, jnp.asarray(new_mask))
  assert _max_diff(_cpu(*args), attend(*args)) <= FP32_TOL
  empty = (q, cache_k[:, :, :0], cache_v[:, :, :0], jnp.zeros((2, 5, 0), bool), k, v,
           transformer.causal_mask(2, 5))
  assert _max_diff(_cpu(*empty), attend(*empty)) <= FP32_TOL


@needs_cpu_kernels
def test_cpu_kernel_rejects_what_it_does_not_take_and_differentiates_by_the_reference():
  inputs, rng = _inputs(9, 1, 2, 4, 2, 12, 8)
  q, cache_k, cache_v, k, v = inputs
  cache_mask, new_mask = _tree_masks(rng, 1, 2, 8)
  with pytest.raises(ValueError, match="head_dim a multiple of 8"):
    cpu_attention.cpu_attention(q, cache_k, cache_v, cache_mask, k, v, new_mask)
  inputs, rng = _inputs(9, 1, 2, 4, 2, 16, 8)
  q, cache_k, cache_v, k, v = inputs
  loss = lambda impl: lambda q, k: jnp.sum(jnp.sin(ops.attention(
      q, cache_k, cache_v, cache_mask, k, v, new_mask, impl=impl)))
  got = jax.grad(loss("cpu"), argnums=(0, 1))(q, k)
  want = jax.grad(loss("reference"), argnums=(0, 1))(q, k)
  for g, w in zip(got, want):
    assert _max_diff(g, w) <= FP32_TOL


def _self_attention_reference(q, k, v, mask):
  b, t, _, d = q.shape
  empty = jnp.zeros((b, k.shape[2], 0, d), q.dtype)
  return attend(q, empty, empty, jnp.zeros((b, t, 0), bool), k, v, mask)


def _packed_segments(rng, batch, t):
  """Segment ids of packed rows: samples of random lengths, padding (0) at the end."""
  segments = np.zeros((batch, t), np.int32)
  for row in range(batch):
    start, sample = 0, 1
    while start < t - 8:
      length = int(rng.integers(4, t // 2))
      segments[row, start:start + length] = sample
      start, sample = start + length, sample + 1
  return segments


@needs_cpu_kernels
@pytest.mark.parametrize("case", [(2, 96, 9, 3, 64), (1, 80, 4, 4, 16), (2, 70, 14, 2, 32)],
                         ids=["g3-d64", "g1-d16", "g7-d32"])
def test_cpu_self_attention_and_its_gradients_match_reference(case):
  """The trainer's attention (no cache, T > MAX_NEW_TOKENS): block-causal masks of packed
  rows, plus a query that sees nothing (every value averaged) and a key outside its own
  segment's range; GQA groups 1, 3 and 7 (two passes of at most four heads)."""
  batch, t, heads, kv_heads, dim = case
  inputs, rng = _inputs(sum(case), batch, t, heads, kv_heads, dim, 0)
  q, _, _, k, v = inputs
  mask = np.array(block_causal_mask(_packed_segments(rng, batch, t)))
  mask[0, 5] = False
  mask[-1, t - 1, 0] = True
  mask = jnp.asarray(mask)
  got = jax.jit(cpu_self_attention.self_attention)(q, k, v, mask)
  assert _max_diff(got, _self_attention_reference(q, k, v, mask)) <= FP32_TOL
  cotangent = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  loss = lambda fn: lambda q, k, v: jnp.sum(fn(q, k, v, mask) * cotangent)
  got = jax.jit(jax.grad(loss(cpu_self_attention.self_attention), argnums=(0, 1, 2)))(q, k, v)
  want = jax.grad(loss(_self_attention_reference), argnums=(0, 1, 2))(q, k, v)
  for g, w in zip(got, want):
    assert _max_diff(g, w) <= 1e-4 * max(1.0, float(jnp.max(jnp.abs(w))))


@needs_cpu_kernels
def test_cpu_self_attention_dispatch_and_what_it_rejects():
  """ops.attention sends cacheless rows over MAX_NEW_TOKENS to the kernel on CPU, rows
  with a cache (a prefill) and head dims it does not take to the reference."""
  t = cpu_attention.MAX_NEW_TOKENS + 8
  inputs, rng = _inputs(3, 1, t, 4, 2, 16, 0)
  q, cache_k, cache_v, k, v = inputs
  mask = transformer.causal_mask(1, t)
  cache_mask = jnp.zeros((1, t, 0), bool)
  traced = lambda *args: str(jax.make_jaxpr(
      lambda *a: ops.attention(*a, impl="cpu"))(*args))
  assert "tlt_self_attention_forward" in traced(q, cache_k, cache_v, cache_mask, k, v, mask)
  with_cache = _inputs(3, 1, t, 4, 2, 16, 4)[0]
  assert "tlt_self_attention" not in traced(*with_cache[:3], jnp.ones((1, t, 4), bool),
                                            *with_cache[3:], mask)
  odd = _inputs(3, 1, t, 4, 2, 24, 0)[0]
  assert "tlt_self_attention" not in traced(*odd[:3], cache_mask, *odd[3:], mask)
  with pytest.raises(ValueError, match="head_dim a multiple of 16"):
    cpu_self_attention.self_attention(odd[0], odd[3], odd[4], mask)

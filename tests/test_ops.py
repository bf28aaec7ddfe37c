"""The kernel seam (`tlt_jax.ops`): every registered implementation of every op computes
what the op's plain-jnp reference computes, on random inputs, wherever it runs here (the
C++ CPU kernels where they build, Pallas interpreted off-GPU, Triton on a GPU only); and the
seam's choice follows the backend."""
from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax import ops, reference_ops
from tlt_jax.cpu import kernels as cpu_kernels

TOL = 1e-5


def _runs_here(op: str, name: str) -> bool:
  """Whether an implementation runs on this machine (dense's `cpu` is XLA's own dot)."""
  if name == "triton":
    return jax.default_backend() == "gpu" and importlib.util.find_spec("jax_triton") is not None
  if name == "packed" or (name == "cpu" and op != "dense"):
    return jax.default_backend() == "cpu" and cpu_kernels.build_problem() is None
  return True


def _cases():
  return [(op, name) for op, table in ops.IMPLEMENTATIONS.items() for name in table
          if name != "reference"]


def _normal(rng, *shape):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _inputs(op: str, name: str, rng):
  """(arguments for the implementation, arguments for the reference)."""
  if op in ("dense", "logits"):
    x, w = _normal(rng, 3, 5, 40), _normal(rng, 40, 30)
    return ((x, ops.pack(w)) if name == "packed" else (x, w)), (x, w)
  if op == "attention":
    b, t, h, kh, d, s = 2, 5, 6, 2, 16, 24
    q, k, v = _normal(rng, b, t, h, d), _normal(rng, b, t, kh, d), _normal(rng, b, t, kh, d)
    cache_k, cache_v = _normal(rng, b, kh, s, d), _normal(rng, b, kh, s, d)
    cache_mask = jnp.asarray(rng.random((b, t, s)) < 0.6)
    new_mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    args = (q, cache_k, cache_v, cache_mask, k, v, new_mask)
    return args, args
  if op == "self_attention":
    b, t, h, kh, d = 2, 80, 4, 2, 16
    q, k, v = _normal(rng, b, t, h, d), _normal(rng, b, t, kh, d), _normal(rng, b, t, kh, d)
    segments = np.repeat(np.arange(1, 5), t // 4)[None].repeat(b, 0)
    args = (q, k, v, jnp.asarray(reference_ops.block_causal_mask(segments)))
    return args, args
  if op == "token_logprobs":
    args = (_normal(rng, 7, 50) * 3, jnp.asarray(rng.integers(0, 50, 7)), 0.7)
    return args, args
  raise AssertionError(f"no inputs for op {op!r}: add them with its implementations")


@pytest.mark.parametrize("op,name", _cases())
def test_every_implementation_matches_its_reference(op, name):
  if not _runs_here(op, name):
    pytest.skip(f"{op}/{name} does not run on this machine")
  rng = np.random.default_rng(sum(map(ord, op + name)))
  args, reference_args = _inputs(op, name, rng)
  implementation = ops.IMPLEMENTATIONS[op][name]
  if name == "pallas":
    implementation = lambda *a: ops.IMPLEMENTATIONS[op]["pallas"](
        *a, interpret=jax.default_backend() != "gpu")
  got = jax.jit(implementation)(*args) if op != "token_logprobs" else implementation(*args)
  want = ops.IMPLEMENTATIONS[op]["reference"](*reference_args)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.shape == w.shape
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               atol=TOL * max(1.0, float(jnp.max(jnp.abs(w)))), rtol=TOL)


def test_the_choice_follows_the_backend():
  on_cpu = "cpu" if cpu_kernels.enabled(jnp.float32) else "reference"
  assert ops.resolve_attention("auto", "cpu") == on_cpu
  assert ops.resolve_attention("auto", "cpu", sharded=True) == "reference"
  assert ops.resolve_attention("auto", "gpu") == "pallas"
  assert ops.resolve_attention("auto", "cuda") == "pallas"
  assert ops.resolve_attention("auto", "tpu") == "reference"
  assert ops.resolve_attention(ops.TRAINING_AUTO, "cpu") == on_cpu
  assert ops.resolve_attention(ops.TRAINING_AUTO, "cuda") == "reference"
  assert ops.resolve_attention(ops.TRAINING_AUTO, "cpu", sharded=True) == "reference"
  assert ops.packs_weights(jnp.bfloat16) is False
  w = jnp.ones((4, 3))
  assert ops.pack_like(w, w) is w
  assert isinstance(ops.pack_like(w, ops.pack(w)), ops.PackedWeight)

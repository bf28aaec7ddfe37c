"""Tree-verify attention timing: jnp reference vs the Pallas kernel (and Triton on GPU).

Each takes what the model hands it: the cache in its own layout, read in place, and the
new tokens' keys as a block of their own.

On GPU the kernels are compiled; on CPU Pallas runs in interpret mode, which checks
correctness but says nothing about kernel speed. Implementations are timed in turn, the order
reversed every other repeat (benchmarks/ab.py), so machine noise hits all alike; medians
are reported.

  .venv/bin/python benchmarks/tree_attention.py [--batch 8] [--cache-len 1024] [--output f.json]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import ab  # noqa: E402
from benchmarks.report import emit  # noqa: E402
import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.reference_ops import attend
from tlt_jax.pallas.tree_attention import tree_attention_pallas


def tree_inputs(args, dtype):
  """Random `attend` arguments of a verify step: q, a cache [B, K, S, D] with a committed
  prefix per row, and a random tree over the new tokens."""
  rng = np.random.default_rng(0)
  b, t, s, kh, d = args.batch, args.tokens, args.cache_len, args.kv_heads, args.head_dim
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  ancestors = np.eye(t, dtype=bool)
  for node in range(1, t):
    ancestors[node] |= ancestors[rng.integers(0, node)]
  cache_mask = np.zeros((b, t, s), bool)
  for row, length in enumerate(rng.integers(1, s + 1, b)):
    cache_mask[row, :, :length] = True
  return (normal(b, t, args.heads, d), normal(b, kh, s, d), normal(b, kh, s, d),
          jnp.asarray(cache_mask), normal(b, t, kh, d), normal(b, t, kh, d),
          jnp.asarray(np.broadcast_to(ancestors, (b, t, t))))


def seconds_per_call(fn, inputs, calls):
  start = time.perf_counter()
  for _ in range(calls):
    out = fn(*inputs)
  out.block_until_ready()
  return (time.perf_counter() - start) / calls


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--tokens", type=int, default=16, help="tree tokens verified (T)")
  parser.add_argument("--heads", type=int, default=9)
  parser.add_argument("--kv-heads", type=int, default=3)
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--cache-len", type=int, default=1024)
  parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--calls", type=int, default=20, help="calls averaged per sample")
  parser.add_argument("--output", help="also write the JSON here")
  args = parser.parse_args()

  on_gpu = jax.default_backend() == "gpu"
  impls = {"reference": jax.jit(attend),
           "pallas": jax.jit(lambda *x: tree_attention_pallas(*x, interpret=not on_gpu))}
  if on_gpu and importlib.util.find_spec("jax_triton") is not None:
    from tlt_jax.pallas.tree_attention_triton import tree_attention_triton
    impls["triton"] = jax.jit(tree_attention_triton)
  inputs = tree_inputs(args, jnp.dtype(args.dtype))
  outputs = {name: fn(*inputs).block_until_ready() for name, fn in impls.items()}  # compile
  rounds = ab.alternate({name: lambda _, fn=fn: seconds_per_call(fn, inputs, args.calls)
                         for name, fn in impls.items()}, args.repeats, warmup=0, mirror=True)
  samples = {name: ab.side(rounds, name) for name in impls}
  reference_ms = statistics.median(samples["reference"]) * 1e3
  result = {
      "backend": jax.default_backend(),
      "mode": "compiled" if on_gpu else "pallas interpret mode: a correctness path, not speed",
      "shape": {k: v for k, v in vars(args).items() if k not in ("repeats", "calls", "output")},
      "median_ms": {name: statistics.median(s) * 1e3 for name, s in samples.items()},
      "speedup_vs_reference": {name: reference_ms / (statistics.median(s) * 1e3)
                               for name, s in samples.items() if name != "reference"},
      "max_abs_diff_vs_reference": {
          name: float(jnp.max(jnp.abs(out.astype(jnp.float32)
                                      - outputs["reference"].astype(jnp.float32))))
          for name, out in outputs.items() if name != "reference"},
  }
  emit(result, args.output)


if __name__ == "__main__":
  main()

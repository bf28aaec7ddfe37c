"""Float32 weight matmuls for the rollout on x86 CPUs: each weight [K, N] packed once into
column panels [ceil(N / 24), K, 24], and a C++ kernel (packed_matmul.cc) called through
XLA's FFI, beside its jnp reference (`reference_matmul`).

Decode and SD verification multiply a few rows (the live batch, times the draft tokens)
by every weight. XLA's CPU dot runs those at 2-3x below the rate at which a lone row
streams the weights (SmolLM2's layer shapes, 4-16 rows, 2 cores); the panels stream
contiguously and serve up to four rows (eight on the AVX-512 path) from registers at once;
more rows take each panel a block of k at a time, every pass over the block from L1 while
the next streams in.
Only the rollout's layout packs (`rollout.weights.rollout_layout`); training and checkpoints
keep plain [K, N] weights.

The rollout packs where the seam says (`tlt_jax.ops.packs_weights`: where `kernels.enabled`,
TLT_JAX_CPU_KERNELS, says the CPU kernels run).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from tlt_jax.cpu import kernels

PANEL = 24  # output columns per panel (packed_matmul.cc's kPanel)
# Up to this many rows the kernel beats or matches XLA's dot (SmolLM2's layer shapes: 2.3x at
# 4 rows, 1.7x at 16, 1.0x at 256); above it (prefill) x no longer stays in cache across
# panels, and XLA's blocked GEMM runs on the unpacked weights.
MAX_KERNEL_ROWS = 256
MAX_WEIGHTS = 4  # weights per kernel call (packed_matmul.cc's kMaxWeights)
_TARGET = "tlt_packed_matmul"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
  """A weight [..., K, N] as panels [..., ceil(N / PANEL), K, PANEL], zero-padded."""
  panels: jax.Array
  out_features: int = dataclasses.field(metadata=dict(static=True))


def pack(w: jax.Array) -> PackedWeight:
  *lead, k, n = w.shape
  padded = jnp.pad(w, [(0, 0)] * (len(lead) + 1) + [(0, -n % PANEL)])
  panels = padded.reshape(*lead, k, -1, PANEL)
  return PackedWeight(jnp.moveaxis(panels, -2, -3), n)


def unpack(w: PackedWeight) -> jax.Array:
  panels = w.panels
  *lead, p, k, _ = panels.shape
  return jnp.moveaxis(panels, -3, -2).reshape(*lead, k, p * PANEL)[..., :w.out_features]


def reference_matmul(x: jax.Array, w: PackedWeight) -> jax.Array:
  return x @ unpack(w)


def packed_matmul(x: jax.Array, w: PackedWeight) -> jax.Array:
  """x [..., K] @ w -> [..., N] float32; the kernel for up to MAX_KERNEL_ROWS rows."""
  return packed_matmuls(x, (w,))[0]


def packed_matmuls(x: jax.Array, weights: Sequence[PackedWeight]) -> tuple[jax.Array, ...]:
  """x @ w for each of 1 to MAX_WEIGHTS weights that share the input (q, k, v; gate, up) in
  one kernel call, one fork-join of its threads for all of them."""
  if not 1 <= len(weights) <= MAX_WEIGHTS:
    raise ValueError(f"packed_matmuls takes 1 to {MAX_WEIGHTS} weights, got {len(weights)}")
  rows = math.prod(x.shape[:-1])
  if rows > MAX_KERNEL_ROWS or rows == 0:
    return tuple(reference_matmul(x, w) for w in weights)
  kernels.register(_TARGET, "TltPackedMatmul")
  outs = tuple(jax.ShapeDtypeStruct((rows, w.out_features), jnp.float32) for w in weights)
  ys = jax.ffi.ffi_call(_TARGET, outs)(x.reshape(rows, x.shape[-1]),
                                       *(w.panels for w in weights))
  return tuple(y.reshape(*x.shape[:-1], w.out_features) for y, w in zip(ys, weights))

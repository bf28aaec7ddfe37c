"""Float32 weight matmuls for the rollout on x86 CPUs: each weight [K, N] packed once into
column panels [ceil(N / 24), K, 24], and a C++ kernel (packed_matmul.cc) called through
XLA's FFI, beside its jnp reference (`reference_matmul`).

Decode and SD verification multiply a few rows (the live batch, times the draft tokens)
by every weight. XLA's CPU dot runs those at 2-3x below the rate at which a lone row
streams the weights (SmolLM2's layer shapes, 4-16 rows, 2 cores); the panels stream
contiguously and serve up to four rows from registers at once. Only the rollout's layout
packs (`transformer.unstack_layers`); training and checkpoints keep plain [K, N] weights.

TLT_JAX_CPU_MATMUL picks the path: `auto` (the kernel where it builds, else XLA's dot
with one warning saying why), `kernel` (an error where it does not build) or `xla`.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import math
import os
import subprocess
import tempfile
from collections.abc import Sequence

import jax
import jax.numpy as jnp

PANEL = 24  # output columns per panel (packed_matmul.cc's kPanel)
# Up to this many rows the kernel beats or matches XLA's dot (SmolLM2's layer shapes: 2.3x at
# 4 rows, 1.7x at 16, 1.0x at 256); above it (prefill) x no longer stays in cache across
# panels, and XLA's blocked GEMM runs on the unpacked weights.
MAX_KERNEL_ROWS = 256
MAX_WEIGHTS = 4  # weights per kernel call (packed_matmul.cc's kMaxWeights)
MODES = ("auto", "kernel", "xla")
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "packed_matmul.cc")
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
  _register()
  outs = tuple(jax.ShapeDtypeStruct((rows, w.out_features), jnp.float32) for w in weights)
  ys = jax.ffi.ffi_call(_TARGET, outs)(x.reshape(rows, x.shape[-1]),
                                       *(w.panels for w in weights))
  return tuple(y.reshape(*x.shape[:-1], w.out_features) for y, w in zip(ys, weights))


def use_kernel(dtype) -> bool:
  """Whether the rollout packs weights of this dtype: float32 on the CPU backend, with the
  kernel built (TLT_JAX_CPU_MATMUL)."""
  mode = os.environ.get("TLT_JAX_CPU_MATMUL", "auto")
  if mode not in MODES:
    raise ValueError(f"TLT_JAX_CPU_MATMUL={mode!r}: must be one of {', '.join(MODES)}")
  if mode == "xla" or jax.default_backend() != "cpu" or jnp.dtype(dtype) != jnp.float32:
    return False
  problem = _build_problem()
  if problem is None:
    return True
  if mode == "kernel":
    raise RuntimeError(f"TLT_JAX_CPU_MATMUL=kernel: {problem}")
  _warn_once(problem)
  return False


@functools.cache
def _warn_once(problem: str) -> None:
  logging.warning("tlt_jax: rollout matmuls use XLA's dot (TLT_JAX_CPU_MATMUL=xla to "
                  "silence): %s", problem)


@functools.cache
def _build_problem() -> str | None:
  """None once the kernel is built and loaded, else why it cannot be."""
  flags = _cpu_flags()
  if not {"avx2", "fma"} <= flags:
    return "the CPU lacks AVX2 or FMA (or /proc/cpuinfo is unreadable)"
  try:
    _library()
  except (OSError, subprocess.CalledProcessError) as e:
    lines = (getattr(e, "stderr", None) or str(e)).strip().splitlines()
    detail = next((line for line in lines if "error" in line), lines[-1] if lines else "")
    return f"building {_SOURCE} failed: {detail.strip()[:300]}"
  return None


def _cpu_flags() -> set[str]:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("flags"):
          return set(line.split(":", 1)[1].split())
  except OSError:   # not Linux: the kernel is not offered (use_kernel says why)
    return set()
  return set()


@functools.cache
def _library():
  """The kernel's shared library, compiled once per source and jaxlib into the cache dir
  (TLT_JAX_CACHE, default ~/.cache/tlt_jax); written under a temporary name, then renamed,
  so a concurrent or killed build never leaves a partial library behind."""
  import ctypes

  include = jax.ffi.include_dir()
  flags = ["-O3", "-mavx2", "-mfma", "-std=c++17", "-shared", "-fPIC", "-w"]
  with open(_SOURCE, "rb") as f:
    key = hashlib.sha256(f.read() + " ".join(flags + [jax.__version__]).encode())
  cache = os.environ.get("TLT_JAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache",
                                                        "tlt_jax"))
  path = os.path.join(cache, "cpu_kernels", f"packed_matmul_{key.hexdigest()[:16]}.so")
  if not os.path.exists(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
      subprocess.run([os.environ.get("CXX", "g++"), *flags, f"-I{include}", _SOURCE, "-o", tmp],
                     check=True, capture_output=True, text=True)
      os.replace(tmp, path)
    finally:
      if os.path.exists(tmp):
        os.remove(tmp)
  return ctypes.cdll.LoadLibrary(path)


@functools.cache
def _register() -> None:
  jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(_library().TltPackedMatmul),
                              platform="cpu")

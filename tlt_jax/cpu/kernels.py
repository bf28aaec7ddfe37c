"""The C++ kernels for x86 CPUs (AVX2, FMA; packed_matmul.cc also has an AVX-512 path it
takes where the CPU has one), called through XLA's FFI: every `*.cc` here is compiled with
g++ on first use into one shared library, cached per source and jaxlib.
Each kernel is one implementation of an op of the kernel seam (`tlt_jax.ops`), beside the
op's jnp reference (`tlt_jax.reference_ops`); the seam alone calls them.

TLT_JAX_CPU_KERNELS picks the path: `auto` (the kernels where they build, else XLA's own
ops with one warning saying why), `kernel` (an error where they do not build) or `xla`.
"""
from __future__ import annotations

import functools
import glob
import hashlib
import logging
import os
import subprocess
import tempfile

import jax
import jax.numpy as jnp

MODES = ("auto", "kernel", "xla")
ENV = "TLT_JAX_CPU_KERNELS"
_DIR = os.path.dirname(os.path.abspath(__file__))


def enabled(dtype) -> bool:
  """Whether these kernels run for this dtype in the programs this process lowers for the
  CPU: float32, with the library built (TLT_JAX_CPU_KERNELS), in a process whose default
  backend is the CPU (a GPU or TPU process lowers its CPU programs with the references and
  never builds the library). Which platform a program is for is the seam's choice
  (`tlt_jax.ops.by_platform`)."""
  mode = os.environ.get(ENV, "auto")
  if mode not in MODES:
    raise ValueError(f"{ENV}={mode!r}: must be one of {', '.join(MODES)}")
  if mode == "xla" or jax.default_backend() != "cpu" or jnp.dtype(dtype) != jnp.float32:
    return False
  problem = build_problem()
  if problem is None:
    return True
  if mode == "kernel":
    raise RuntimeError(f"{ENV}=kernel: {problem}")
  _warn_once(problem)
  return False


@functools.cache
def register(target: str, symbol: str) -> None:
  """Registers the library's handler `symbol` as the FFI target `target` (once)."""
  jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(_library(), symbol)),
                              platform="cpu")


@functools.cache
def _warn_once(problem: str) -> None:
  logging.warning("tlt_jax: XLA's own ops run, not the CPU kernels (%s=xla to "
                  "silence): %s", ENV, problem)


@functools.cache
def build_problem() -> str | None:
  """None once the library is built and loaded, else why it cannot be."""
  flags = cpu_flags()
  if not {"avx2", "fma"} <= flags:
    return "the CPU lacks AVX2 or FMA (or /proc/cpuinfo is unreadable)"
  try:
    _library()
  except (OSError, subprocess.CalledProcessError) as e:
    lines = (getattr(e, "stderr", None) or str(e)).strip().splitlines()
    detail = next((line for line in lines if "error" in line), lines[-1] if lines else "")
    return f"building the CPU kernels in {_DIR} failed: {detail.strip()[:300]}"
  return None


def cpu_flags() -> set[str]:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("flags"):
          return set(line.split(":", 1)[1].split())
  except OSError:   # not Linux: the kernels are not offered (`enabled` says why)
    return set()
  return set()


@functools.cache
def _library():
  """The shared library, compiled once per source and jaxlib into the cache dir
  (TLT_JAX_CACHE, default ~/.cache/tlt_jax); written under a temporary name, then renamed,
  so a concurrent or killed build never leaves a partial library behind."""
  import ctypes

  sources = sorted(glob.glob(os.path.join(_DIR, "*.cc")))
  headers = sorted(glob.glob(os.path.join(_DIR, "*.h")))
  flags = ["-O3", "-mavx2", "-mfma", "-std=c++17", "-shared", "-fPIC", "-w"]
  key = hashlib.sha256(" ".join(flags + [jax.__version__]).encode())
  for path in sources + headers:
    with open(path, "rb") as f:
      key.update(f.read())
  cache = os.environ.get("TLT_JAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache",
                                                        "tlt_jax"))
  path = os.path.join(cache, "cpu_kernels", f"tlt_cpu_kernels_{key.hexdigest()[:16]}.so")
  if not os.path.exists(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
      subprocess.run([os.environ.get("CXX", "g++"), *flags, f"-I{jax.ffi.include_dir()}",
                      f"-I{_DIR}", *sources, "-o", tmp], check=True, capture_output=True,
                     text=True)
      os.replace(tmp, path)
    finally:
      if os.path.exists(tmp):
        os.remove(tmp)
  return ctypes.cdll.LoadLibrary(path)

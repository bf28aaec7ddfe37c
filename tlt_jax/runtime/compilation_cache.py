"""JAX's persistent compilation cache for the process: each program is compiled once per
machine, and the next run of the same setting loads it instead of compiling it again.

XLA's executables are written to a directory keyed by the program (its StableHLO), the
compile options, the jax/jaxlib versions and the devices; a later process that builds the
same program reads it back. The thresholds keep every program: JAX's defaults skip those
that compile in under a second, which is most CPU programs of a small model, and a run
compiles hundreds of them. Only the entry points turn it on (`experiments/cli.py`,
`--compilation_cache_dir`), before anything is compiled; library code never does.

The directory holds code the process will run: as JAX warns, never share it with users
you do not trust.
"""
from __future__ import annotations

import os

import jax

from tlt_jax.files import user_cache_dir

ENV = "JAX_COMPILATION_CACHE_DIR"


def default_dir() -> str:
  """$JAX_COMPILATION_CACHE_DIR where set (JAX's own variable; empty: off), else
  $XDG_CACHE_HOME/tlt_jax/jax, else ~/.cache/tlt_jax/jax."""
  if ENV in os.environ:
    return os.environ[ENV]
  return user_cache_dir("jax")


def enable(path: str) -> None:
  """Compiled programs cached in `path` (created if missing), every program kept; an empty
  path turns the cache off. Call before the process compiles anything: JAX decides once,
  at its first compilation, whether a cache is used."""
  if not path:
    jax.config.update("jax_enable_compilation_cache", False)
    return
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  # -1: no minimum entry size, and JAX does not raise it for the filesystem.
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

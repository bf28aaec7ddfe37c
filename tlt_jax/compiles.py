"""Counts the XLA compilations of a set of jitted functions: the programs a job really built.

A jitted function's own dispatch cache (`_cache_size`) keeps one entry per call signature,
and arguments laid out alike but committed differently (a sharded rollout's inputs) add
entries that reuse an already compiled executable; counting backend compilations instead
counts only programs that were built.
"""
from __future__ import annotations

from typing import Callable

import jax

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
  """Compilations so far (process-wide) of the jitted `functions`, matched by name."""

  def __init__(self, functions: tuple[Callable, ...]):
    self._names = frozenset(f"jit({fn.__name__})" for fn in functions)
    self.count = 0
    jax.monitoring.register_event_duration_secs_listener(self._record)

  def _record(self, event: str, duration: float, fun_name: str | None = None, **kwargs):
    del duration, kwargs
    if event == _BACKEND_COMPILE and fun_name in self._names:
      self.count += 1

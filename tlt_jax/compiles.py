"""Counts the XLA compilations of a set of jitted functions: the programs a job really built,
and those it loaded from JAX's persistent compilation cache instead.

A jitted function's own dispatch cache (`_cache_size`) keeps one entry per call signature,
and arguments laid out alike but committed differently (a sharded rollout's inputs) add
entries that reuse an already compiled executable; counting backend compilations instead
counts only programs that were built. JAX reports a backend compilation (with the
function's name) once it has its executable, whether XLA built it or the persistent cache
(`tlt_jax.runtime.compilation_cache`) held it; a cache hit (no name) is reported just
before, in the same thread, so each counter remembers one per thread until the next
compilation claims it. A program built while the cache is on is also written to it (JAX's
"cache miss").
"""
from __future__ import annotations

import threading
from typing import Callable

import jax

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_CACHE_WRITE = "/jax/compilation_cache/cache_misses"


class CompileCounter:
  """Programs so far (process-wide) of the jitted `functions`, matched by name: `count`
  built by XLA, `loaded` from the persistent compilation cache, `written` to it."""

  def __init__(self, functions: tuple[Callable, ...]):
    self._names = frozenset(f"jit({fn.__name__})" for fn in functions)
    self.count = self.loaded = self.written = 0
    self._pending = threading.local()
    jax.monitoring.register_event_listener(self._cache_event)
    jax.monitoring.register_event_duration_secs_listener(self._record)

  def _cache_event(self, event: str, **kwargs):
    del kwargs
    if event in (_CACHE_HIT, _CACHE_WRITE):
      self._pending.event = event

  def _record(self, event: str, duration: float, fun_name: str | None = None, **kwargs):
    del duration, kwargs
    if event != _BACKEND_COMPILE:
      return
    pending, self._pending.event = getattr(self._pending, "event", None), None
    if fun_name not in self._names:
      return
    if pending == _CACHE_HIT:
      self.loaded += 1
      return
    self.count += 1
    self.written += pending == _CACHE_WRITE

  def totals(self) -> dict[str, int]:
    """{'programs': built, 'cache_hits': loaded, 'cache_misses': built and written}."""
    return {"programs": self.count, "cache_hits": self.loaded, "cache_misses": self.written}

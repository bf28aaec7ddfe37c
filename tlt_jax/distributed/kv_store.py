"""The coordination service's key-value store, behind one small class.

`jax.distributed.initialize` starts a coordination service (in process 0) and connects every
process to it; its client carries a key-value store with atomic increments and blocking
reads. JAX has no public wrapper for it, so this module is the one place that reaches into
`jax._src.distributed.global_state.client` (checked against jax 0.10.2: `key_value_set`,
`key_value_try_get`, `blocking_key_value_get`, `key_value_increment`, `key_value_delete`,
`wait_at_barrier`); a jax upgrade that moves it changes this file only.

The store is for control (a few bytes a key, ~ms a call), never for weights or rollouts:
those move by collectives (see `collectives`).
"""
from __future__ import annotations

import jax
from jax._src import distributed as _distributed


class KeyValueStore:
  """String keys and values shared by every process of the job. `timeout_s` bounds every
  blocking call: a dead peer surfaces as an error, never a hang."""

  def __init__(self, timeout_s: float = 300.0):
    self._client = _distributed.global_state.client
    if self._client is None:
      raise RuntimeError("the key-value store needs jax.distributed.initialize() first")
    self.timeout_ms = int(timeout_s * 1000)

  def set(self, key: str, value: str, overwrite: bool = True) -> None:
    self._client.key_value_set(key, value, allow_overwrite=overwrite)

  def try_get(self, key: str) -> str | None:
    """The value, or None when the key is not set (the client raises NOT_FOUND)."""
    try:
      return self._client.key_value_try_get(key)
    except jax.errors.JaxRuntimeError as e:
      if "NOT_FOUND" in str(e):
        return None
      raise

  def wait_get(self, key: str, timeout_s: float | None = None) -> str:
    """Blocks (without the GIL) until `key` is set; raises on timeout."""
    timeout_ms = self.timeout_ms if timeout_s is None else int(timeout_s * 1000)
    return self._client.blocking_key_value_get(key, timeout_ms)

  def increment(self, key: str, by: int = 1) -> int:
    """Atomically adds `by` to the integer at `key` (0 when unset); returns the new value."""
    return int(self._client.key_value_increment(key, by))

  def delete(self, key: str) -> None:
    """Deletes `key` and every key under `key/` (the store's directory semantics)."""
    self._client.key_value_delete(key)

  def barrier(self, name: str, timeout_s: float | None = None) -> None:
    """Every process waits here until all have arrived (each `name` used once)."""
    self._client.wait_at_barrier(name, self.timeout_ms if timeout_s is None
                                 else int(timeout_s * 1000))

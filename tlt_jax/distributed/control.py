"""The replicas' control plane for one RL step, on the coordination service's store.

Keys are scoped by step, so a step's keys never meet the next step's:

  tlt/step/<S>/replica/<R>   the replica's state: BUSY, IDLE, TRAINING or DONE
  tlt/step/<S>/finished      how many replicas have finished their rollout (atomic count)
  tlt/step/<S>/rollout_done  set once, by the replica whose increment made the count N

The replica that finishes last announces the end of the rollout: no coordinator process or
thread of its own. A replica that finished early and trains the drafter meanwhile learns of
the end through `RolloutDoneWatch`: a thread blocked in the store's blocking read (which does
not hold the GIL) sets a `threading.Event`, which the trainer checks between its steps; the
hot loop never polls the store.
"""
from __future__ import annotations

import enum
import threading
import time

import jax

from tlt_jax.distributed.kv_store import KeyValueStore

PREFIX = "tlt/step"


class ReplicaState(str, enum.Enum):
  BUSY = "BUSY"            # decoding its share of the step's rollout
  IDLE = "IDLE"            # its rows are done; the rollout is still running elsewhere
  TRAINING = "TRAINING"    # idle, and training the drafter until rollout-done
  DONE = "DONE"            # the step's rollout is over for every replica


def step_key(step: int, *parts: object) -> str:
  return "/".join([PREFIX, str(step), *map(str, parts)])


class ReplicaControl:
  """One replica's view of the control plane (`replica` of `num_replicas`)."""

  def __init__(self, store: KeyValueStore, num_replicas: int, replica: int):
    if not 0 <= replica < num_replicas:
      raise ValueError(f"replica {replica} of {num_replicas}")
    self.store, self.num_replicas, self.replica = store, num_replicas, replica

  def set_state(self, step: int, state: ReplicaState) -> None:
    self.store.set(step_key(step, "replica", self.replica), state.value)

  def state_of(self, step: int, replica: int) -> ReplicaState | None:
    value = self.store.try_get(step_key(step, "replica", replica))
    return None if value is None else ReplicaState(value)

  def finish_rollout(self, step: int) -> int:
    """Counts this replica's rollout of `step` as finished and returns the count; the
    replica that brings it to N publishes rollout-done. Call once per replica and step."""
    count = self.store.increment(step_key(step, "finished"))
    if count == self.num_replicas:
      self.store.set(step_key(step, "rollout_done"), "1")
    return count

  def rollout_done(self, step: int) -> bool:
    return self.store.try_get(step_key(step, "rollout_done")) is not None

  def watch_rollout_done(self, step: int) -> "RolloutDoneWatch":
    return RolloutDoneWatch(self.store, step)

  def clear(self, step: int) -> None:
    """Deletes the step's keys (every process is past it: call after a step-end collective)."""
    self.store.delete(step_key(step))


class RolloutDoneWatch:
  """A daemon thread blocked on `step`'s rollout-done key; `event` is set once it appears.

  The read is cut into slices of `slice_s` so that `stop` ends the thread promptly; a
  store error (the service gone) ends it too, leaving `event` unset and the error in
  `error` for the caller to report."""

  def __init__(self, store: KeyValueStore, step: int, slice_s: float = 1.0):
    self.event = threading.Event()
    self.done_at: float | None = None   # time.perf_counter() when the event was set
    self.error: Exception | None = None
    self._stop = threading.Event()
    self._key, self._store, self._slice_s = step_key(step, "rollout_done"), store, slice_s
    self._thread = threading.Thread(target=self._run, name=f"rollout-done-{step}", daemon=True)
    self._thread.start()

  def _run(self) -> None:
    while not self._stop.is_set():
      try:
        self._store.wait_get(self._key, timeout_s=self._slice_s)
      except jax.errors.JaxRuntimeError as e:  # the slice's timeout, or the store failing
        if "DEADLINE_EXCEEDED" in str(e):
          continue
        self.error = e
        return
      self.done_at = time.perf_counter()
      self.event.set()
      return

  def stop(self) -> None:
    self._stop.set()
    self._thread.join()

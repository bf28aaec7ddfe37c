"""The drafter's checkpoints during RL: its trainable params, optimizer state and online
buffer, written asynchronously and atomically.

Layout: DIR/step_00000012/ holds state.npz (the saved pytree's leaves by tree path: a
TrainState's params, optimizer state and step, or the RL spot trainer's candidate state and
deployed drafter), buffer.npz + buffer.json (the online buffer, when given) and
meta.json (the step, what was saved, and the caller's JSON: e.g. the deploy gate's figures
or the bandit). The target's embedding and head, which the drafter only borrows, are not
saved: the run checkpoint has the policy.

`save` copies the state to the host on the calling thread (the next train step donates its
device buffers) and snapshots the buffer (its stored windows are immutable, so that is
cheap); a writer thread then fills a temporary dir beside the final one and renames it into
place when every file is written (`tlt_jax.files.atomic_dir`). A save killed midway leaves
only a `.step_*.tmp-*` dir, which is never read and which the next `DrafterCheckpoints` on
that dir removes: the last committed step stays loadable. One save is in flight at a time:
`save` first waits for the one before, `wait` blocks until the save in flight is on disk
(raising its error as one line), and `close` (or leaving a `with` block) waits at exit.

Plain files from one thread, not orbax: no collective or barrier is involved, so a save
cannot hang a multi-process job; the caller saves from one process (process 0), whose
drafter equals every replica's after the step-boundary sync.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.drafter import buffer as buffer_lib
from tlt_jax.drafter.array_file import read_arrays, write_arrays
from tlt_jax.errors import UserInputError
from tlt_jax.files import atomic_dir, write_atomic

STATE_FILE = "state.npz"
META_FILE = "meta.json"
_STEP_DIR = re.compile(r"step_(\d{8})")
_TMP_DIR = re.compile(r"\.step_\d{8}\.tmp-")


class DrafterCheckpoints:
  """Keeps the last `keep` drafter checkpoints of `directory`."""

  def __init__(self, directory: str, keep: int = 2):
    if keep < 1:
      raise UserInputError(f"drafter checkpoints keep={keep}: must be >= 1")
    self.directory = os.path.abspath(directory)
    self.keep = keep
    try:
      os.makedirs(self.directory, exist_ok=True)
      for name in os.listdir(self.directory):   # saves killed midway
        if _TMP_DIR.match(name):
          shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
    except OSError as e:
      raise UserInputError(f"{self.directory}: cannot use as the drafter checkpoint dir "
                           f"({e.strerror or e})") from None
    self._writer: threading.Thread | None = None
    self._failure: tuple[int, BaseException] | None = None

  def steps(self) -> list[int]:
    """Committed steps, ascending."""
    return sorted(int(m.group(1)) for m in map(_STEP_DIR.fullmatch, os.listdir(self.directory))
                  if m)

  def latest_step(self) -> int | None:
    return (self.steps() or [None])[-1]

  def save(self, step: int, state: Any, buffer: buffer_lib.OnlineBuffer | None = None,
           meta: dict[str, Any] | None = None) -> None:
    """Starts saving `step` (after the save before it has finished); returns once the
    state is on the host."""
    self.wait()
    host_state = jax.tree.map(np.array, jax.device_get(state))   # copies, never views
    snapshot = buffer.snapshot() if buffer is not None else None
    info = {"step": step, "buffer": buffer is not None, "meta": meta or {}}
    json.dumps(info)   # a value JSON cannot hold fails here, on the caller's thread
    self._writer = threading.Thread(target=self._write, args=(step, host_state, snapshot, info),
                                    name=f"drafter-checkpoint-{step}", daemon=True)
    self._writer.start()

  def wait(self) -> None:
    """Blocks until the save in flight is on disk; its failure is raised here."""
    if self._writer is not None:
      self._writer.join()
      self._writer = None
    if self._failure is not None:
      step, error = self._failure
      self._failure = None
      last = self.latest_step()
      kept = "no checkpoint yet" if last is None else f"the last good one is step {last}"
      reason = (error.strerror if isinstance(error, OSError) and error.strerror
                else (str(error).splitlines() or [type(error).__name__])[0][:300])
      raise UserInputError(f"{self.directory}: drafter checkpoint of step {step} failed "
                           f"({reason}); {kept}")

  def close(self) -> None:
    self.wait()

  def __enter__(self) -> DrafterCheckpoints:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def restore(self, template: Any, buffer: buffer_lib.OnlineBuffer | None = None,
              step: int | None = None) -> tuple[Any, dict[str, Any]]:
    """(the state (a pytree, e.g. a TrainState) shaped and placed like `template`, the
    caller's meta) of `step` (default: the latest); `buffer`, when given, is loaded with the
    saved one."""
    step = self.latest_step() if step is None else step
    if step is None or step not in self.steps():
      raise UserInputError(f"{self.directory}: no drafter checkpoint"
                           + ("" if step is None else f" of step {step}"))
    path = self._path(step)
    info = _read_json(os.path.join(path, META_FILE))
    if buffer is not None:
      if not info["buffer"]:
        raise UserInputError(f"{path}: holds no drafter buffer")
      buffer_lib.load_state(path, buffer)
    return _state_from_arrays(read_arrays(os.path.join(path, STATE_FILE)), template,
                              path), info["meta"]

  def _path(self, step: int) -> str:
    return os.path.join(self.directory, f"step_{step:08d}")

  def _write(self, step: int, host_state: Any, snapshot, info: dict[str, Any]) -> None:
    try:
      with atomic_dir(self._path(step), overwrite=True) as tmp:
        write_arrays(os.path.join(tmp, STATE_FILE), _state_arrays(host_state))
        if snapshot is not None:
          buffer_lib.save_state(tmp, snapshot())
        write_atomic(os.path.join(tmp, META_FILE), json.dumps(info, indent=1))
      for old in self.steps()[:-self.keep]:
        shutil.rmtree(self._path(old), ignore_errors=True)
    except BaseException as e:  # surfaced by `wait` on the caller's thread
      self._failure = (step, e)


def _state_arrays(state: Any) -> dict[str, np.ndarray]:
  return {jax.tree_util.keystr(path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}


def _state_from_arrays(arrays: dict[str, np.ndarray], template: Any, path: str) -> Any:
  """Leaves by tree path into `template`'s structure, dtypes checked, placed like it."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(template)
  wanted = {jax.tree_util.keystr(p): leaf for p, leaf in flat}
  describe = lambda a: "absent" if a is None else f"{np.dtype(a.dtype)}{list(a.shape)}"
  for name in sorted(wanted.keys() | arrays.keys()):
    want, got = wanted.get(name), arrays.get(name)
    if want is None or got is None or (got.shape, got.dtype) != (want.shape, want.dtype):
      raise UserInputError(f"{path}: drafter state {name} is stored as {describe(got)}, "
                           f"this drafter and optimizer have {describe(want)}")
  leaves = [_placed_like(arrays[name], leaf) for name, leaf in wanted.items()]
  return jax.tree_util.tree_unflatten(treedef, leaves)


def _placed_like(value: np.ndarray, leaf: Any) -> jax.Array:
  """`value` on `leaf`'s devices, committed to them only if `leaf` is (jit keys its cache on
  that: a restored state must not compile the train step again)."""
  if isinstance(leaf, jax.Array) and leaf.committed:
    return jax.device_put(value, leaf.sharding)
  return jnp.asarray(value)


def _read_json(path: str) -> dict[str, Any]:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise UserInputError(f"{path}: cannot read ({e})") from None

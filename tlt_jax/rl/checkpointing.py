"""Run checkpoints: the whole RL training state, saved asynchronously and atomically.

One orbax `CheckpointManager` step dir per saved RL step, with two items:
  state/  the policy params, optimizer state and optimizer step (arrays, orbax)
  meta/   JSON: the data iterator's state, the bandit's state, the seed, the metrics so
          far, and the run's flags (what a resumed run must continue identically)
Orbax writes each step into a temporary dir and renames it only once complete, so a save
killed midway never hides the last good checkpoint; `latest_step` sees finished ones only.

Several processes (one rollout replica each): the policy state is replicated, so process 0
alone writes, from host copies (orbax refuses device arrays of a multi-process job, and a
non-primary process's save would write a success marker with no data); every process reads
(the run dir is shared) and places what it read on the job's mesh. Each process's orbax
manager spans that process only (`active_processes`), so no save or read waits on a peer.
"""
from __future__ import annotations

import os
import re
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.sharding import SingleDeviceSharding

from tlt_jax.errors import UserInputError
from tlt_jax.rl.update import PolicyState

STATE, META = "state", "meta"


class RunCheckpoints:
  """Keeps the last `keep` checkpoints of a run dir's `checkpoints/`."""

  def __init__(self, directory: str, keep: int, async_save: bool = True):
    if keep < 1:
      raise UserInputError(f"--keep_checkpoints={keep}: must be >= 1")
    self.directory = os.path.abspath(directory)
    self.multi_process = jax.process_count() > 1
    self.writer = jax.process_index() == 0
    alone = {}
    if self.multi_process:
      me = jax.process_index()
      alone = dict(create=False, multiprocessing_options=ocp.options.MultiprocessingOptions(
          primary_host=me, active_processes={me}))
    try:
      if self.multi_process:
        os.makedirs(self.directory, exist_ok=True)
      self._manager = ocp.CheckpointManager(
          self.directory, item_names=(STATE, META),
          options=ocp.CheckpointManagerOptions(max_to_keep=keep,
                                               enable_async_checkpointing=async_save,
                                               cleanup_tmp_directories=self.writer, **alone))
    except OSError as e:
      raise UserInputError(f"{self.directory}: cannot create the checkpoint dir ({e})") from None

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: PolicyState, meta: dict[str, Any]) -> None:
    """Starts saving (returns once the arrays are copied off the device); a failure of
    the previous save surfaces here or in `wait` as a one-line error. With several
    processes only process 0 writes (host copies of the replicated state); the others
    return at once."""
    if not self.writer:
      return
    if self.multi_process:
      state = jax.device_get(state)
    self._guard(lambda: self._manager.save(
        step, args=ocp.args.Composite(**{STATE: ocp.args.StandardSave(state),
                                         META: ocp.args.JsonSave(meta)}), force=True))

  def wait(self) -> None:
    """Blocks until the save in flight is on disk."""
    self._guard(self._manager.wait_until_finished)

  def restore(self, step: int, template: PolicyState) -> tuple[PolicyState, dict[str, Any]]:
    """The state at `step`, placed like `template` (arrays or ShapeDtypeStructs); with
    several processes read onto this process's first device, then placed on the job's
    mesh."""
    local = SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=local if self.multi_process
                                       else x.sharding), template)
    try:
      restored = self._manager.restore(
          step, args=ocp.args.Composite(**{STATE: ocp.args.StandardRestore(target),
                                           META: ocp.args.JsonRestore()}))
    except (OSError, ValueError, KeyError) as e:
      raise UserInputError(f"{self.directory}/{step}: cannot restore the checkpoint "
                           f"({str(e).splitlines()[0][:300]})") from None
    state = restored[STATE]
    if self.multi_process:   # through the host: a device array cannot join another's mesh
      state = jax.device_put(jax.device_get(state), jax.tree.map(lambda x: x.sharding,
                                                                 template))
    return state, restored[META]

  def close(self) -> None:
    self._guard(self._manager.close)

  def _guard(self, action) -> None:
    try:
      action()
    except (OSError, ValueError) as e:  # tensorstore write errors arrive as ValueError
      last = self._manager.latest_step()
      kept = "no checkpoint yet" if last is None else f"the last good checkpoint is step {last}"
      raise UserInputError(f"{self.directory}: checkpoint save failed ({_reason(e)}); "
                           f"{kept}") from None


def _reason(error: Exception) -> str:
  """The OS cause (e.g. 'No space left on device') when the error carries one: tensorstore's
  messages bury it after several long paths."""
  if isinstance(error, OSError) and error.strerror:
    return error.strerror
  code = re.search(r"os_error_code='(\d+)'", str(error))
  if code:
    return os.strerror(int(code.group(1)))
  return (str(error).splitlines() or [type(error).__name__])[0][:300]

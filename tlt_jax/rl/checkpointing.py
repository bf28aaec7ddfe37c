"""Run checkpoints: the whole RL training state, saved asynchronously and atomically.

One orbax `CheckpointManager` step dir per saved RL step, with two items:
  state/  the policy params, optimizer state and optimizer step (arrays, orbax)
  meta/   JSON: the data iterator's state, the bandit's state, the seed, the metrics so
          far, and the run's flags (what a resumed run must continue identically)
Orbax writes each step into a temporary dir and renames it only once complete, so a save
killed midway never hides the last good checkpoint; `latest_step` sees finished ones only.
"""
from __future__ import annotations

import os
import re
from typing import Any

import jax
import orbax.checkpoint as ocp

from tlt_jax.errors import UserInputError
from tlt_jax.rl.update import PolicyState

STATE, META = "state", "meta"


class RunCheckpoints:
  """Keeps the last `keep` checkpoints of a run dir's `checkpoints/`."""

  def __init__(self, directory: str, keep: int, async_save: bool = True):
    if keep < 1:
      raise UserInputError(f"--keep_checkpoints={keep}: must be >= 1")
    self.directory = os.path.abspath(directory)
    try:
      self._manager = ocp.CheckpointManager(
          self.directory, item_names=(STATE, META),
          options=ocp.CheckpointManagerOptions(max_to_keep=keep,
                                               enable_async_checkpointing=async_save,
                                               cleanup_tmp_directories=True))
    except OSError as e:
      raise UserInputError(f"{self.directory}: cannot create the checkpoint dir ({e})") from None

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: PolicyState, meta: dict[str, Any]) -> None:
    """Starts saving (returns once the arrays are copied off the device); a failure of
    the previous save surfaces here or in `wait` as a one-line error."""
    self._guard(lambda: self._manager.save(
        step, args=ocp.args.Composite(**{STATE: ocp.args.StandardSave(state),
                                         META: ocp.args.JsonSave(meta)}), force=True))

  def wait(self) -> None:
    """Blocks until the save in flight is on disk."""
    self._guard(self._manager.wait_until_finished)

  def restore(self, step: int, template: PolicyState) -> tuple[PolicyState, dict[str, Any]]:
    """The state at `step`, placed like `template` (arrays or ShapeDtypeStructs)."""
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), template)
    try:
      restored = self._manager.restore(
          step, args=ocp.args.Composite(**{STATE: ocp.args.StandardRestore(target),
                                           META: ocp.args.JsonRestore()}))
    except (OSError, ValueError, KeyError) as e:
      raise UserInputError(f"{self.directory}/{step}: cannot restore the checkpoint "
                           f"({str(e).splitlines()[0][:300]})") from None
    return restored[STATE], restored[META]

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

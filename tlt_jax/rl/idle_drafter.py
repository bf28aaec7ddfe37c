"""The online drafter inside an RL step: the spot trainer (`spot_trainer.py`) driven by the
replicas' control plane (`distributed/control.py`).

`while_idle` runs on every replica right after its own rollout (and rewards): the
responses and their hidden states go into the replica's buffer; the replica counts itself
finished (BUSY -> IDLE); unless it was the last, it scores the drafters for the deploy gate
on its held-out windows, then trains the drafter (TRAINING), until the last replica's
increment publishes rollout-done, which a watcher thread turns into the event read between
drafter calls. `at_step_end` runs on every replica after the rollouts are gathered: each
replica's long responses go to every other replica's buffer, the deploy gate decides from
the scores whether the rollout's drafter changes, and the replicas' drafters are averaged
into the next candidate; it also reports the step's idle metrics for the whole job:
every replica's rounds, gathered and combined (`combine_rounds`), whichever replica
finished first. Each rollout round (a step, or a step's extra DAPO draw) has its own
control keys.

`save` / `restore` keep what resuming needs beside the run's checkpoint: each replica writes
its own drafter checkpoint (candidate and deployed drafter, optimizer state, its own online
buffer, the gate's decay watch) to its own directory.
"""
from __future__ import annotations

import sys
import time
import zlib
from typing import Any

import jax
import numpy as np

from tlt_jax.distributed import collectives
from tlt_jax.distributed.control import ReplicaControl, ReplicaState
from tlt_jax.drafter.checkpoints import DrafterCheckpoints
from tlt_jax.models.transformer import Params
from tlt_jax.rl.rollout import GroupRollouts
from tlt_jax.rl.spot_trainer import SpotTrainer
from tlt_jax.rollout.weights import DraftWeights

ROUNDS_PER_STEP = 1000   # control-plane round ids: step * ROUNDS_PER_STEP + draw


class AllProcesses:
  """`spot_trainer.Collective` over every process of the job."""

  @property
  def index(self) -> int:
    return jax.process_index()

  @property
  def processes(self) -> int:
    return collectives.process_count()

  def allgather(self, arrays: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    stacked = collectives.allgather(arrays)
    return [{k: v[i] for k, v in stacked.items()} for i in range(self.processes)]


def combine_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
  """Idle metrics of several rounds (a step's draws, or every replica's step) as one:
  counts and seconds add up, the stop's latency is the worst, the drafter steps' spans
  are listed in order, the loss is the mean over all drafter steps."""
  kept = lambda r: r.get("drafter/train_steps", 0) - r.get("drafter/discarded_steps", 0)
  out: dict[str, Any] = {}
  for key in sorted({k for r in rounds for k in r}):
    values = [r[key] for r in rounds if key in r]
    if key == "drafter/train_spans":
      out[key] = [span for spans in values for span in spans]
    elif key == "drafter/preempt_latency_s":
      out[key] = max(values)
    elif key == "drafter/loss":
      losses = [(r[key], kept(r)) for r in rounds if key in r and kept(r) > 0]
      out[key] = (sum(loss * n for loss, n in losses) / sum(n for _, n in losses)
                  if losses else float("nan"))
    else:
      out[key] = sum(values)
  return out


def _inside(spans: list[tuple[float, float]], done_at: float) -> float:
  """Seconds of `spans` before `done_at`: the drafter call in flight at the stop runs past
  the idle window (that overrun is the preempt latency, not idle time used)."""
  return float(sum(max(0.0, min(end, done_at) - start) for start, end in spans))


class IdleDrafter:
  """One replica's online drafter and its place in the control plane."""

  def __init__(self, spot: SpotTrainer, control: ReplicaControl, extra_tail_s: float = 0.0,
               checkpoints: DrafterCheckpoints | None = None):
    # extra_tail_s: seconds this replica keeps busy after its rollout, as if its tail were
    # longer (tests and demos make one replica the straggler with it).
    self.spot, self.control, self.extra_tail_s = spot, control, extra_tail_s
    self.checkpoints = checkpoints
    self.steps_trained = 0
    self.rounds: list[int] = []            # control-plane rounds of the step in flight
    self.round_metrics: list[dict[str, Any]] = []   # this replica's, of those rounds
    self.accept_len: float | None = None   # the deployed drafter's, last step

  def while_idle(self, step: int, draw: int, rollouts: GroupRollouts,
                 target_params: Params) -> None:
    """Buffer this replica's rollout, then score and train until every replica's rollout is
    done; its metrics are reported at the step end."""
    self.round_metrics.append(self._idle_round(step, draw, rollouts, target_params))

  def observe(self, step: int, rollouts: GroupRollouts) -> None:
    """This replica's responses and their hidden states into its buffer, as `step`'s."""
    self.spot.observe(step, zip(rollouts.prompts, rollouts.responses, rollouts.hidden_states))

  def _idle_round(self, step: int, draw: int, rollouts: GroupRollouts,
                  target_params: Params) -> dict[str, Any]:
    round_id = step * ROUNDS_PER_STEP + draw
    self.rounds.append(round_id)
    time.sleep(self.extra_tail_s)
    finished = time.perf_counter()
    self.observe(step, rollouts)
    self.control.set_state(round_id, ReplicaState.IDLE)
    if self.control.finish_rollout(round_id) == self.control.num_replicas:
      return {"drafter/idle_device_s_available": 0.0, "drafter/idle_device_s_used": 0.0}
    watch = self.control.watch_rollout_done(round_id)
    try:
      scoring = time.perf_counter()
      self.spot.score(step, target_params, watch.event.is_set)
      scored = (scoring, time.perf_counter())
      if not self.spot.wants_training(self.accept_len):
        watch.event.wait()
        ended = time.perf_counter()
        return {"drafter/idle_device_s_available": ended - finished,
                "drafter/idle_device_s_used": _inside([scored], ended),
                "drafter/score_s": scored[1] - scored[0]}
      self.control.set_state(round_id, ReplicaState.TRAINING)
      report = self.spot.train_while_idle(step, target_params, watch.event.is_set)
      if report.stop_seen is None:       # ran out of steps or data before the end
        watch.event.wait()
    finally:
      watch.stop()
    if watch.error is not None:
      raise RuntimeError(f"replica control plane failed: {watch.error}")
    done_at = watch.done_at
    self.steps_trained += report.steps - report.discarded
    if report.error is not None:
      print(f"warning: step {step}: replica {self.control.replica}: a drafter step failed "
            f"({report.error}); this round's drafter steps are discarded, the last synced "
            "drafter kept", file=sys.stderr)
    return {"drafter/train_steps": report.steps, "drafter/discarded_steps": report.discarded,
            "drafter/failed_rounds": int(report.error is not None),
            "drafter/loss": report.mean_loss,
            "drafter/idle_device_s_available": done_at - finished,
            "drafter/idle_device_s_used": _inside([scored, *report.spans], done_at),
            "drafter/score_s": scored[1] - scored[0],
            "drafter/preempt_latency_s": max(0.0, time.perf_counter() - done_at),
            "drafter/train_spans": [(s - finished, e - finished) for s, e in report.spans]}

  def at_step_end(self, step: int, accept_len: float | None
                  ) -> tuple[DraftWeights, dict[str, Any]]:
    """Share the step's long responses between replicas, gate on this step's scores, then
    sync every replica's drafter; (the drafter the next rollout uses, metrics: the step's
    idle figures summed over every replica's rounds).
    accept_len: the step's measured accept length (the same on every replica)."""
    self.accept_len = accept_len
    own, self.round_metrics = combine_rounds(self.round_metrics), []
    metrics = combine_rounds(collectives.allgather_json(own))
    metrics.update(self.spot.share_long(step))
    metrics["drafter/buffer_bytes"] = self.spot.buffer.stats()["bytes"]
    metrics.update(self.spot.gate())   # collectives: every replica is past its rounds
    self.spot.sync(self.steps_trained)
    metrics["drafter/replicas_identical"] = self.replicas_identical()
    for round_id in self.rounds:
      self.control.clear(round_id)
    self.steps_trained, self.rounds = 0, []
    metrics["drafter/candidate_steps"] = int(jax.device_get(self.spot.state.step))
    return self.spot.deployed, metrics

  def replicas_identical(self) -> int:
    """1 when every replica holds the same bits of the candidate and deployed drafters (a
    checksum of each, gathered), else 0."""
    leaves = jax.tree.leaves(jax.device_get((self.spot.state, self.spot.deployed.params)))
    digest = zlib.crc32(b"".join(np.ascontiguousarray(x).tobytes() for x in leaves))
    sums = self.spot.collective.allgather({"crc": np.asarray(digest, np.int64)})
    return int(len({int(c["crc"]) for c in sums}) == 1)

  def save(self, step: int) -> None:
    """This replica's drafter checkpoint of `step`, on disk on every replica when this
    returns (a collective), so a run checkpoint of `step` saved after it can resume."""
    self.checkpoints.save(step, self.spot.checkpoint_state(), self.spot.buffer,
                          meta={"spot": self.spot.host_state(), "accept_len": self.accept_len})
    self.checkpoints.wait()
    self.spot.collective.allgather({"saved": np.asarray(step, np.int64)})

  def restore(self, step: int) -> None:
    """Continues from this replica's drafter checkpoint of `step`."""
    saved, meta = self.checkpoints.restore(self.spot.checkpoint_state(), self.spot.buffer,
                                           step)
    self.spot.restore(saved, meta["spot"])
    self.accept_len = meta["accept_len"]

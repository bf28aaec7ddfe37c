"""Online drafter steps for the spot trainer: optax steps from the buffer until told to stop,
keeping only finite ones.

`train_steps` is what a replica runs once its own rows are done: drafter steps on batches
the online buffer draws for the RL step in flight, until `stop` is set (a threading.Event a
watcher thread sets when the rollout ends, or any callable returning True), `max_steps` have
run, or the batches have drawn `max_slots` trained slots (an epoch cap: a replica holding
few fresh responses would otherwise fit those few). `stop` is read between steps only and
every step is waited on, so a stop costs at most the one step in flight: the preemption
latency is bounded by one drafter step.

A step whose loss or gradient norm is NaN/Inf is discarded inside the same program: the
state it would produce is replaced by the one it was given (params, optimizer moments and
step count), so the last good drafter stays and the optimizer does not count the step.
"""
from __future__ import annotations

import dataclasses
import functools
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tlt_jax.data.packing import PackedRows
from tlt_jax.drafter import trainer
from tlt_jax.drafter.buffer import OnlineBuffer
from tlt_jax.drafter.losses import CE_WEIGHT
from tlt_jax.models import transformer
from tlt_jax.models.config import ModelConfig

Stop = threading.Event | Callable[[], bool]


@dataclasses.dataclass(frozen=True)
class StepsReport:
  steps: int                  # steps run, discarded ones included
  discarded: int              # steps whose loss or gradients were NaN/Inf
  mean_loss: float            # over the kept steps; NaN when none was kept
  seconds: float              # wall time of the call
  spans: tuple[tuple[float, float], ...]  # (start, end) time.perf_counter of each step,
                                          # drawing its batch included
  stop_seen: float | None     # time.perf_counter when the stop was seen; None if not stopped
  previous_slots: int         # trained slots drawn from the previous step's windows
  current_slots: int          # ... and from the current step's
  error: str | None = None    # a step raised: every step of the call is discarded

  @classmethod
  def failed(cls, began: float, error: BaseException) -> "StepsReport":
    """The report of a call a drafter step raised in (its state is lost: donated)."""
    first = (str(error).strip().splitlines() or [""])[0][:300]
    return cls(steps=0, discarded=0, mean_loss=float("nan"),
               seconds=time.perf_counter() - began, spans=(), stop_seen=None,
               previous_slots=0, current_slots=0, error=f"{type(error).__name__}: {first}")


@functools.partial(jax.jit, static_argnames=("config", "optimizer", "ce_weight", "unroll"),
                   donate_argnames=("state",))
def guarded_step(state: trainer.TrainState, target_params: transformer.Params,
                 rows: PackedRows, hidden: jax.Array, vocab_ids: jax.Array | None = None, *,
                 config: ModelConfig, optimizer: optax.GradientTransformation,
                 ce_weight: float = CE_WEIGHT, unroll: int = 1
                 ) -> tuple[trainer.TrainState, dict[str, jax.Array]]:
  """`trainer.train_step`, returning the given state instead when the loss or gradient
  norm is not finite; metrics["finite"] says which happened."""
  new, metrics = trainer.train_step(state, target_params, rows, vocab_ids, hidden,
                                    config=config, optimizer=optimizer, ce_weight=ce_weight,
                                    unroll=unroll)
  finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
  kept = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, state)
  return kept, metrics | {"finite": finite}


def train_steps(state: trainer.TrainState, target_params: transformer.Params,
                buffer: OnlineBuffer, step: int, stop: Stop, max_steps: int, *,
                max_slots: int | None = None, config: ModelConfig,
                optimizer: optax.GradientTransformation,
                vocab_ids: jax.Array | None = None, ce_weight: float = CE_WEIGHT,
                unroll: int = 1) -> tuple[trainer.TrainState, StepsReport]:
  """Drafter steps on `buffer.batch(step)` until `stop`, `max_steps`, `max_slots` trained
  slots drawn, or an empty buffer.

  `state` is donated (as `trainer.train_step` does); use the returned one."""
  began = time.perf_counter()
  spans, losses, discarded, slots = [], [], 0, np.zeros(2, np.int64)
  stop_seen = None
  is_stopped = stop.is_set if isinstance(stop, threading.Event) else stop
  while len(spans) < max_steps and (max_slots is None or slots.sum() < max_slots):
    if is_stopped():
      stop_seen = time.perf_counter()
      break
    start = time.perf_counter()
    batch = buffer.batch(step)
    if batch is None:
      break
    state, metrics = guarded_step(state, target_params, batch.rows, batch.hidden, vocab_ids,
                                  config=config, optimizer=optimizer, ce_weight=ce_weight,
                                  unroll=unroll)
    jax.block_until_ready(state)
    finite, loss = jax.device_get((metrics["finite"], metrics["loss"]))
    spans.append((start, time.perf_counter()))
    slots += (batch.previous_slots, batch.current_slots)
    if finite:
      losses.append(float(loss))
    else:
      discarded += 1
  return state, StepsReport(
      steps=len(spans), discarded=discarded,
      mean_loss=float(np.mean(losses)) if losses else float("nan"),
      seconds=time.perf_counter() - began, spans=tuple(spans), stop_seen=stop_seen,
      previous_slots=int(slots[0]), current_slots=int(slots[1]))

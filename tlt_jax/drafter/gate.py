"""The deploy gate: a drafter trained online replaces the deployed one only where it
measurably beats it on held-out windows of the latest rollout; and the decay watch that
lets training wait while the deployed drafter still holds its acceptance.

The score is the expected accepted length of a depth-d draft chain (bonus token excluded):

    E[L] = sum_{m=1..d} prod_{j=1..m} a_j

where a_j is the level-j acceptance rate that the unrolled drafter loss measures
(`trainer.eval_step` with unroll=d: level j consumes the drafter's own level j-1
prediction, as a tree level does at rollout): top-1 agreement with the target under greedy
decoding, sum_v min(p_v, q_v) (one draft passing rejection sampling) under sampling. The
product treats levels as independent, so E[L] is an estimate of the chain's survival, but
the same estimator on the same windows ranks the two drafters, which is all the gate
decides.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np

from tlt_jax.data.packing import PackedRows
from tlt_jax.drafter import trainer
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.drafter import DrafterParams
from tlt_jax.models.transformer import Params


def level_rates(metrics: dict[str, float], greedy: bool, depth: int) -> list[float]:
  """a_1..a_depth from `trainer.eval_step`'s metrics (top1_acc, top1_acc_pass2, ...)."""
  name = "top1_acc" if greedy else "sampled_accept"
  return [float(metrics[name if m == 1 else f"{name}_pass{m}"]) for m in range(1, depth + 1)]


def expected_accept_length(rates: Sequence[float]) -> float:
  """sum_m prod_{j<=m} a_j: drafted tokens a chain of len(rates) levels expects to keep."""
  return float(np.sum(np.cumprod(np.asarray(rates, np.float64))))


def heldout_levels(params: DrafterParams, target_params: Params,
                   windows: Sequence[tuple[PackedRows, Any]], vocab_ids: jax.Array | None, *,
                   config: ModelConfig, greedy: bool, depth: int,
                   stop: Callable[[], bool] = lambda: False) -> tuple[np.ndarray, float] | None:
  """(slot-weighted sums of a_1..a_depth, response slots) of `params` over held-out (rows,
  target hidden states) batches: sums, so replicas can add theirs before dividing. None
  where `stop()` (read before each batch) said to give up."""
  totals, slots = np.zeros(depth), 0.0
  for rows, hidden in windows:
    if stop():
      return None
    metrics = jax.device_get(trainer.eval_step(params, target_params, rows, vocab_ids, hidden,
                                               config=config, unroll=depth))
    n = float(metrics["trained_slots"])
    totals += n * np.asarray(level_rates(metrics, greedy, depth))
    slots += n
  return totals, slots


def accept_from_levels(totals: np.ndarray, slots: float) -> float:
  """E[L] from `heldout_levels`' sums (added over replicas)."""
  if slots == 0:
    raise ValueError("held-out windows hold no response slot")
  return expected_accept_length(np.asarray(totals) / slots)


def heldout_accept(params: DrafterParams, target_params: Params,
                   windows: Sequence[tuple[PackedRows, Any]], vocab_ids: jax.Array | None, *,
                   config: ModelConfig, greedy: bool, depth: int) -> float:
  """E[L] of `params` over held-out batches of one process."""
  return accept_from_levels(*heldout_levels(params, target_params, windows, vocab_ids,
                                            config=config, greedy=greedy, depth=depth))


@dataclasses.dataclass(frozen=True)
class DeployGate:
  """Deploys a candidate whose held-out E[L] beats the deployed drafter's by more than
  `margin` (relative): a tie keeps the deployed one, whose acceptance the rollout has
  already measured."""
  margin: float = 0.0

  def deploys(self, deployed: float, candidate: float) -> bool:
    return candidate > deployed * (1.0 + self.margin)

  def choose(self, deployed: float, candidate: float, shipped: float) -> str | None:
    """"candidate" where it beats both the deployed and the shipped drafter; else "shipped"
    where that beats the deployed one (an earlier candidate that won on its step's windows
    and loses on later ones is taken back); else None: the deployed drafter stays."""
    if self.deploys(max(deployed, shipped), candidate):
      return "candidate"
    return "shipped" if self.deploys(deployed, shipped) else None


@dataclasses.dataclass
class DecayWatch:
  """`--drafter_train=on_decay`: train only once the deployed drafter's accept length on the
  rollouts has fallen `tolerance` (relative) below the best it reached since it was
  deployed; a frozen drafter can hold its acceptance for many RL steps."""
  tolerance: float = 0.1
  best: float | None = None

  def observe(self, accept_len: float) -> None:
    """One step's measured accept length (tokens per verify step) of the deployed drafter."""
    self.best = accept_len if self.best is None else max(self.best, accept_len)

  def decayed(self, accept_len: float) -> bool:
    return self.best is not None and accept_len < self.best * (1.0 - self.tolerance)

  def deployed_new(self) -> None:
    """A new drafter is deployed: its own best starts from its own measurements."""
    self.best = None

  def state_dict(self) -> dict[str, Any]:
    return {"best": self.best}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    self.best = state["best"]

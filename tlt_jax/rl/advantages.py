"""Host-side reward shaping for group-relative RL: advantages, DAPO's overlong penalty and
dynamic-sampling bookkeeping.

Numpy on purpose: rewards are [prompts, samples per prompt] and tiny, and the decisions made
here (which groups to keep, whether to draw more) steer the host loop, not a device program.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from tlt_jax.errors import UserInputError
from tlt_jax.rl.config import AdvantageConfig, OverlongConfig


def _as_groups(rewards) -> np.ndarray:
  rewards = np.asarray(rewards)
  if rewards.ndim != 2 or rewards.shape[1] < 1:
    raise ValueError(f"rewards: expected [prompts, samples >= 1], got shape {rewards.shape}")
  return rewards


def informative_groups(rewards) -> np.ndarray:
  """bool [P]: True where a group's rewards differ. An all-equal group (one sample, or all
  right, or all wrong) has all-zero advantages and no learning signal, so DAPO's dynamic
  sampling drops it."""
  rewards = _as_groups(rewards)
  return np.any(rewards != rewards[:, :1], axis=1)


def group_advantages(rewards, config: AdvantageConfig) -> np.ndarray:
  """float32 [P, G] advantages of rewards [P, G], relative to each prompt's group.

  grpo: (r - mean) / (std + eps) with the *unbiased* std (ddof=1), as verl (torch.std) and
  TRL compute it; dr_grpo: r - mean. All-equal groups (G == 1 included, where ddof=1 is
  undefined) get exactly 0, not nan or rounding noise from the mean.
  """
  rewards = _as_groups(rewards).astype(np.float64)
  advantages = rewards - rewards.mean(axis=1, keepdims=True)
  informative = informative_groups(rewards)
  if config.mode == "grpo" and rewards.shape[1] > 1:
    advantages = advantages / (rewards.std(axis=1, ddof=1, keepdims=True) + config.eps)
  return np.where(informative[:, None], advantages, 0.0).astype(np.float32)


def overlong_penalty(response_lengths, max_response_len: int,
                     config: OverlongConfig) -> np.ndarray:
  """float32 [N] reward added per response: DAPO's soft overlong punishment.

  With start = max_response_len - buffer_len: 0 for L <= start, the linear ramp
  (start - L) / buffer_len * penalty_factor for start < L <= max_response_len (reaching
  -penalty_factor at the cap), -penalty_factor beyond. Zeros unless mode is `soft_penalty`
  (`mask` is applied by the learner to the loss mask, not to rewards).
  """
  lengths = np.asarray(response_lengths, np.int64)
  if config.mode != "soft_penalty":
    return np.zeros(lengths.shape, np.float32)
  if config.buffer_len > max_response_len:
    raise UserInputError(f"--overlong_buffer_len={config.buffer_len}: must be <= the max "
                         f"response length ({max_response_len})")
  start = max_response_len - config.buffer_len
  ramp = (start - lengths) / config.buffer_len * config.penalty_factor
  penalty = np.where(lengths <= start, 0.0,
                     np.where(lengths <= max_response_len, ramp, -config.penalty_factor))
  return penalty.astype(np.float32)


@dataclasses.dataclass(frozen=True)
class GroupSelection:
  """The groups that make the train batch. `groups` is int [K, 2] of (draw index, group
  index within that draw), informative ones first in arrival order, then the padding."""
  groups: np.ndarray
  num_padded: int   # uninformative groups added to reach the target (zero advantage)
  num_draws: int    # generation batches drawn


@dataclasses.dataclass(frozen=True)
class GroupFill:
  """DAPO dynamic sampling bookkeeping, one immutable step per generation batch.

  The learner's host loop:

      fill = GroupFill(target_groups=prompts_per_step, max_draws=max_gen_batches)
      draws = []
      while not fill.done:
        batch = rollout(next_prompts())          # rewards [P_d, G]; P_d may vary by draw
        draws.append(batch)
        fill = fill.add_draw(informative_groups(batch.rewards))
      picked = fill.selection(pad=True)
      train_groups = [draws[d].group(g) for d, g in picked.groups]
      metrics["dynamic_sampling/num_draws"] = picked.num_draws
      metrics["dynamic_sampling/padded_groups"] = picked.num_padded

  Informative groups are kept in arrival order until `target_groups`; the surplus of the
  last draw is dropped. If `max_draws` batches come back without filling the target,
  `selection(pad=True)` tops the batch up with uninformative groups already generated (zero
  advantage: no policy gradient, but a fixed batch size, so no new shapes to compile; their
  tokens do count in token_mean's denominator). `pad=False` returns the short batch.
  """
  target_groups: int
  max_draws: int
  kept: tuple[tuple[int, int], ...] = ()
  spare: tuple[tuple[int, int], ...] = ()   # uninformative groups seen, for padding
  num_draws: int = 0

  def __post_init__(self):
    if self.target_groups < 1:
      raise UserInputError(f"dynamic sampling target_groups={self.target_groups}: must be >= 1")
    if self.max_draws < 1:
      raise UserInputError(f"dynamic sampling max_draws={self.max_draws}: must be >= 1")

  @property
  def done(self) -> bool:
    return len(self.kept) >= self.target_groups or self.num_draws >= self.max_draws

  def add_draw(self, informative) -> GroupFill:
    """The state after one more generation batch whose groups' informativeness (bool [P_d],
    from `informative_groups`) is given."""
    if self.done:
      raise ValueError("GroupFill.add_draw called after done: the loop drew one batch too many")
    informative = np.asarray(informative, bool)
    draw = self.num_draws
    room = self.target_groups - len(self.kept)
    new_kept = [(draw, int(g)) for g in np.flatnonzero(informative)[:room]]
    spare_room = self.target_groups - len(self.spare)
    new_spare = [(draw, int(g)) for g in np.flatnonzero(~informative)[:max(spare_room, 0)]]
    return dataclasses.replace(self, kept=self.kept + tuple(new_kept),
                               spare=self.spare + tuple(new_spare), num_draws=draw + 1)

  def selection(self, pad: bool = True) -> GroupSelection:
    """The train batch: the kept groups, topped up with spare uninformative ones if `pad`."""
    padding = self.spare[:self.target_groups - len(self.kept)] if pad else ()
    groups = np.array(self.kept + padding, np.int64).reshape(-1, 2)
    return GroupSelection(groups=groups, num_padded=len(padding), num_draws=self.num_draws)

"""A rollout's groups with their rewards: what the rollout and reward stages hand on, and
what replicas gather from one another (`replicas.gather_scored`)."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from tlt_jax.rl.rollout import GroupRollouts, concat_rollouts


@dataclasses.dataclass
class ScoredGroups:
  rollouts: GroupRollouts
  rewards: np.ndarray        # [P, G] what the advantages see (shaping included)
  accuracy: np.ndarray       # [P, G] task correctness alone
  items: list                # the prompts' data items, one per group
  timeouts: int = 0
  errors: int = 0
  first_error: str | None = None


def select(scored: ScoredGroups, groups: Sequence[int], group_size: int) -> ScoredGroups:
  """The given groups of a scored draw (fault counts stay with the draw)."""
  groups = [int(g) for g in groups]
  return ScoredGroups(rollouts=scored.rollouts.select_groups(groups, group_size),
                      rewards=scored.rewards[groups], accuracy=scored.accuracy[groups],
                      items=[scored.items[g] for g in groups])


def merge_scored(parts: Sequence[ScoredGroups]) -> ScoredGroups:
  return ScoredGroups(rollouts=concat_rollouts([p.rollouts for p in parts]),
                      rewards=np.concatenate([p.rewards for p in parts]),
                      accuracy=np.concatenate([p.accuracy for p in parts]),
                      items=[i for p in parts for i in p.items])

"""The queue of a rollout under a row budget: which waiting prompts a freed row admits.

A rollout that may hold at most `batch` rows starts with the first prompts that fit and
keeps the rest waiting; at each chunk boundary, rows that finished are refilled from the
queue (`engine._Loop.admit`), so the batch stays full while prompts wait. Rows of one
group (a GRPO prompt's samples) are admitted together where the budget allows: they then
run side by side, and the model-free drafter reads siblings' text that is being written at
the same time. Groups keep their order of first appearance; a group waits (and those behind
it) until enough rows are free for all of it, unless it is larger than the whole batch,
when it is admitted piece by piece. Which rows run a prompt never changes its greedy
output, only when it is computed.
"""
from __future__ import annotations

import collections
from typing import Sequence


class AdmissionQueue:
  """Prompts (by index) waiting for a row, whole groups in order."""

  def __init__(self, group_ids: Sequence[int], batch: int):
    groups: dict[int, list[int]] = {}
    for prompt, group in enumerate(group_ids):
      groups.setdefault(group, []).append(prompt)
    self.groups = collections.deque(groups.values())
    self.batch = batch

  @property
  def waiting(self) -> int:
    return sum(len(group) for group in self.groups)

  def take(self, free: int) -> list[int]:
    """The prompts that `free` rows admit now: whole groups while they fit; a group larger
    than the batch (never fits whole) as much of it as fits; none past a group that must
    wait for more rows."""
    taken: list[int] = []
    while self.groups and free > 0:
      group = self.groups[0]
      if len(group) <= free:
        taken += group
        free -= len(group)
        self.groups.popleft()
      elif len(group) > self.batch:
        taken += group[:free]
        self.groups[0] = group[free:]
        free = 0
      else:
        break
    return taken


def first_wave(group_ids: Sequence[int], batch: int) -> tuple[list[int], AdmissionQueue]:
  """The prompts a rollout of `batch` rows starts with (ascending: with no budget, all of
  them in their order) and the queue of the rest."""
  queue = AdmissionQueue(group_ids, batch)
  return sorted(queue.take(batch)), queue

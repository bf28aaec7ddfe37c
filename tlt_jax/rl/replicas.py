"""Rollout replicas as processes: which groups of a step each replica samples, and the
gather that gives every process every replica's scored groups.

Each step's P prompt groups are cut into `count` contiguous blocks (groups whole, sizes
differing by at most one, the same on every process), so replica r samples and scores
block r with process-local programs on its own devices. The scored blocks then travel by
one collective (`collectives.allgather`) as fixed-shape arrays: responses and log-probs
padded to the length cap, blocks padded to the largest block's group count. Every process
ends with the same groups in prompt order, so the advantages, the packing and the update
(data-parallel over every process) see one batch everywhere.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from tlt_jax.distributed.collectives import allgather
from tlt_jax.rl.rollout import GroupRollouts
from tlt_jax.rl.scored import ScoredGroups


@dataclasses.dataclass(frozen=True)
class Replicas:
  """This process's replica `index` of `count` (one per process)."""
  index: int = 0
  count: int = 1

  def block(self, num_groups: int, replica: int | None = None) -> slice:
    """The groups of `replica` (default: this one) out of `num_groups`."""
    replica = self.index if replica is None else replica
    base, extra = divmod(num_groups, self.count)
    start = replica * base + min(replica, extra)
    return slice(start, start + base + (replica < extra))

  def max_block(self, num_groups: int) -> int:
    return -(-num_groups // self.count)

  def seed(self, seed: int) -> int:
    """Replica 0 samples with the step's seed (one replica: as before replicas); the
    others with seeds derived from it and their index."""
    if self.index == 0:
      return seed
    return int(np.random.SeedSequence([seed, self.index]).generate_state(1)[0])


def _pad_rows(values, rows: int, width: int, dtype) -> np.ndarray:
  out = np.zeros((rows, width), dtype)
  for i, v in enumerate(values):
    out[i, :len(v)] = v
  return out


def gather_scored(local: ScoredGroups, items: list, replicas: Replicas, group_size: int,
                  max_new_tokens: int, scalars: dict[str, float]
                  ) -> tuple[ScoredGroups, dict[str, np.ndarray]]:
  """Every replica's scored block of `items`, in prompt order, and each replica's
  `scalars` ([count] arrays, for metrics). `local` is this replica's block; its rollout
  stats and first reward error stay this process's own."""
  if replicas.count == 1:
    return local, {k: np.array([v], np.float32) for k, v in scalars.items()}
  groups = replicas.max_block(len(items))
  rows = groups * group_size
  lengths = [len(r) for r in local.rollouts.responses]
  payload = {
      "tokens": _pad_rows(local.rollouts.responses, rows, max_new_tokens, np.int32),
      "logprobs": _pad_rows(local.rollouts.logprobs, rows, max_new_tokens, np.float32),
      "lengths": _pad_rows([[n] for n in lengths], rows, 1, np.int32)[:, 0],
      "truncated": _pad_rows([[t] for t in local.rollouts.truncated], rows, 1, np.int32)[:, 0],
      "rewards": _pad_rows(local.rewards, groups, group_size, np.float32),
      "accuracy": _pad_rows(local.accuracy, groups, group_size, np.int32),
      "faults": np.array([local.timeouts, local.errors], np.int32),
      "scalars": np.array([scalars[k] for k in sorted(scalars)], np.float32),
  }
  got = allgather(payload)
  responses, logprobs, truncated, rewards, accuracy = [], [], [], [], []
  for replica in range(replicas.count):
    block = replicas.block(len(items), replica)
    n_groups = block.stop - block.start
    for row in range(n_groups * group_size):
      n = int(got["lengths"][replica, row])
      responses.append(got["tokens"][replica, row, :n].tolist())
      logprobs.append(np.asarray(got["logprobs"][replica, row, :n], np.float32))
    truncated.append(got["truncated"][replica, :n_groups * group_size].astype(bool))
    rewards.append(got["rewards"][replica, :n_groups])
    accuracy.append(got["accuracy"][replica, :n_groups].astype(bool))
  rollouts = GroupRollouts(
      prompts=[list(i.prompt_ids) for i in items for _ in range(group_size)],
      responses=responses, logprobs=logprobs, truncated=np.concatenate(truncated),
      prompt_index=np.repeat(np.arange(len(items)), group_size), stats=local.rollouts.stats)
  faults = got["faults"].sum(axis=0)
  scored = ScoredGroups(rollouts=rollouts, rewards=np.concatenate(rewards),
                        accuracy=np.concatenate(accuracy), items=list(items),
                        timeouts=int(faults[0]), errors=int(faults[1]),
                        first_error=local.first_error)
  return scored, {k: got["scalars"][:, i] for i, k in enumerate(sorted(scalars))}

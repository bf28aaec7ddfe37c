"""Hybrid drafting: per row and verify step, the learned drafter's draft or the model-free
chain, whichever has emitted more tokens per unit time for that row so far.

A small bandit per row over three arms: the learned drafter, and the model-free chain in
two contexts, after a match of the full `max_ngram` tokens or after a shorter one (known
before the step: a chain copying a sibling's sentence and one guessing from a single
token are different drafters). Each row counts, per arm, the verify steps it drafted and
the tokens they emitted, discounted by `memory` every step so that a row follows its text
(a sibling ahead makes n-gram drafts good; a new stretch of reasoning makes them bad). An
arm's rate is its discounted tokens per step; a step's chain competes with the arm of its
context. A model-free step costs one verify pass, a learned one `1 + draft_cost` (its
drafter tree), a cost the batch shares: the drafter runs when it raises the batch's
tokens per unit time (`pick_learned`).
A row's prior for an arm is the batch's rate for it (every row's counts pooled, discounted
the same way), with the weight of one step: a row that has not drafted with an arm lately
expects what the others measure, so it does not retry an arm the batch already knows to be
worse.
Replaying the pick along SmolLM2's T=1 responses (16 rows in step, the drafter always
running), priors of each row's own gave 9% of steps to the chain and 0.977x the learned
drafter's tokens per step; the batch's, 4% and 0.99x. The batch's rate starts from an
optimistic prior (every step emits the most a step can, with the weight of a tenth of a
step), so each arm is tried at once, and an arm no row picks for a while drifts back to
it and is tried again. Ties go to the model-free chain, the cheaper one. A `PickMemory`
carries the batch's counts from one rollout to the next: its first steps then pick by what
earlier rollouts measured instead of trying every arm anew (SmolLM2, T=0, a call per row of
128 tokens: the drafter drafted 3% of the steps, a try per call, and 0.7% with a memory;
benchmarks/results/model_free_hybrid_batch1_t0_cpu.json), and the optimistic prior still
brings a long-unpicked arm back.

The pick reads only earlier steps' outcomes and text, never this step's draws: the
verified draft is fixed before them, so verification stays exact whichever kind a row
picks.

`merge` selects the other design, one tree holding both drafts (see `HybridConfig`); its
counts then record which kind's draft the accepted path took (model-free when none was
accepted: it is tried first).

Why the pick is the default: under one token budget the merged tree halves each chain's
depth and always pays the drafter, while the pick gives the winning kind the whole depth
and skips the drafter when every row picks the chain. benchmarks/results/model_free_cpu.json
(SmolLM2, 2-core CPU, G = 8, 4_1_5, an earlier epoch's responses as context), the pick's
tokens/s over the merge's: T=0 1.42x, 1.29x, 1.43x at live batch 1, 4, 16 (the chain
accepts 3.9-4.0 tokens a step, the merge's half-depth chain 2.8); T=1 0.94x, 0.87x, 1.07x
(the chain accepts 1.3 there, the learned drafter 2.0, and the merge's two drafter levels
cost less than the pick's four).
"""
from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.errors import UserInputError

KINDS = ("learned", "ngram")   # the columns of `HybridStats`' [B, 2] counts
# The pick's arms: the learned drafter, and the model-free chain after a match of the full
# `max_ngram` tokens or a shorter one (at T=1 on SmolLM2 a chain after a 4-token match
# accepts ~4x as much as after a 1-token one; shorter matches are two thirds of steps).
_LEARNED, _FULL_MATCH, _SHORT_MATCH = _ARMS = range(3)
_PRIOR_STEPS = 0.1             # the batch's optimistic prior's weight, in verify steps
_POOLED_STEPS = 1.0            # the weight of a row's prior, the batch's rate, in steps


@dataclasses.dataclass(frozen=True)
class HybridConfig:
  # A learned draft's time in verify passes. DESIGN.md 4b (2-core CPU, SmolLM2, batch 1):
  # a drafter step with an 8k draft vocabulary is 0.055 of a decode step and a 5-token
  # verify 1.49, so a depth-4 chain is ~0.15-0.2 of its verify; a wider head costs more.
  # Measured (same setting, 4_1_5, greedy, one prompt, 64 tokens): a learned step 61 ms,
  # a hybrid step whose rows all picked model-free 50.5 ms (verify + catch-up): 0.21.
  draft_cost: float = 0.2
  # Per-step discount of a row's counts: ~100 steps of memory. Replaying the pick along
  # SmolLM2's T=1 responses (G=8, an earlier epoch, 16 rows in step, the drafter always
  # running; two sets of responses): 0.990-0.994x the learned drafter's tokens per step
  # at 0.99, 0.985-0.990x at 0.95 (the tries of the chain, which accepts less at T=1,
  # are the loss).
  memory: float = 0.99
  # The other design: no pick, one verify tree per step holding both drafts under the
  # strategy's budget (`speculative._merged_tree`: the model-free chain over the first
  # half of the depth, rounded up, tried first; the learned chain over the rest).
  merge: bool = False

  def __post_init__(self):
    if not self.draft_cost >= 0:
      raise UserInputError(f"hybrid draft_cost={self.draft_cost}: must be >= 0")
    if not 0 <= self.memory < 1:
      raise UserInputError(f"hybrid memory={self.memory}: must be in [0, 1)")


@flax.struct.dataclass
class HybridStats:
  steps: jax.Array           # [B, 2] int32: verify steps each kind drafted (for stats)
  tokens: jax.Array          # [B, 2] int32: tokens those steps emitted
  recent_steps: jax.Array    # [B, 3] float32: the same by arm, discounted (for the pick)
  recent_tokens: jax.Array   # [B, 3] float32
  # [B, 3] float32: the batch's discounted steps and tokens by arm, every row's pooled
  # (finished rows' too, and earlier rollouts' through a `PickMemory`). Every row holds the
  # same copy, so compaction and layout treat it as any other per-row array.
  batch_steps: jax.Array
  batch_tokens: jax.Array


class PickMemory:
  """The batch's counts by arm, carried from one rollout to the next (`SpecConfig`'s
  `pick_memory`): `init_stats` starts from them, the engine keeps a rollout's last ones."""

  def __init__(self):
    self.steps, self.tokens = (np.zeros((len(_ARMS),), np.float32) for _ in range(2))

  def keep(self, stats: HybridStats) -> None:
    self.steps, self.tokens = (np.asarray(stats.batch_steps[0]),
                               np.asarray(stats.batch_tokens[0]))


def init_stats(batch: int, memory: PickMemory | None = None) -> HybridStats:
  ints = lambda: jnp.zeros((batch, len(KINDS)), jnp.int32)
  floats = lambda: jnp.zeros((batch, len(_ARMS)), jnp.float32)
  carried = lambda counts: jnp.broadcast_to(jnp.asarray(counts, jnp.float32),
                                            (batch, len(_ARMS)))
  memory = memory or PickMemory()
  return HybridStats(steps=ints(), tokens=ints(), recent_steps=floats(),
                     recent_tokens=floats(), batch_steps=carried(memory.steps),
                     batch_tokens=carried(memory.tokens))


def merge_split(depth: int) -> tuple[int, int]:
  """A merged tree's (model-free chain depth, learned chain depth) for a strategy depth."""
  return depth - depth // 2, depth // 2


def _chain_arm(full_match: jax.Array) -> jax.Array:
  """[B] the model-free arm a step's chain belongs to, by its match length."""
  return jnp.where(full_match, _FULL_MATCH, _SHORT_MATCH)


def pick_learned(stats: HybridStats, config: HybridConfig, most_tokens: int,
                 live: jax.Array, full_match: jax.Array) -> jax.Array:
  """[B] bool: the rows the learned drafter drafts this step. Each row's model-free arm is
  set by `full_match` [B] (its chain follows a match of `max_ngram` tokens). most_tokens:
  the most one verify step can emit (depth + 1), the optimistic prior.

  The drafter's cost is the batch's, not a row's: it runs when the batch's expected
  tokens per unit time are higher with it (each live row then drafting with whichever
  kind emits more per step: a row that kept the chain would save nothing and only lose
  tokens) than without it. So one row's optimism about its drafter does not make the
  whole batch pay a drafter step (SmolLM2, batch 4, T=0: with the any-row rule the hybrid
  ran at 0.83x the model-free chain alone, with this one and the match arms 0.98x)."""
  batch_rate = ((stats.batch_tokens + _PRIOR_STEPS * most_tokens)
                / (stats.batch_steps + _PRIOR_STEPS))                          # [B, 3]
  per_step = ((stats.recent_tokens + _POOLED_STEPS * batch_rate)
              / (stats.recent_steps + _POOLED_STEPS))
  learned = per_step[:, _LEARNED]
  chain = jnp.take_along_axis(per_step, _chain_arm(full_match)[:, None], axis=1)[:, 0]
  with_drafter = jnp.sum(jnp.where(live, jnp.maximum(learned, chain), 0.0))
  without = jnp.sum(jnp.where(live, chain, 0.0))
  return (with_drafter / (1.0 + config.draft_cost) > without) & (learned > chain)


def record(stats: HybridStats, config: HybridConfig, learned: jax.Array, emitted: jax.Array,
           live: jax.Array, full_match: jax.Array) -> HybridStats:
  """Adds one verify step: live rows drafted by the learned drafter where `learned`, else
  by the model-free chain (after a full-length match where `full_match`), and emitted
  `emitted` [B] tokens."""
  used = jnp.stack([learned, ~learned], axis=1) & live[:, None]             # [B, 2]
  gained = jnp.where(used, emitted[:, None], 0)
  arm = jnp.where(learned, _LEARNED, _chain_arm(full_match))
  arm = (jnp.arange(len(_ARMS))[None, :] == arm[:, None]) & live[:, None]
  fade = jnp.where(live[:, None], config.memory, 1.0)
  arm_tokens = jnp.where(arm, emitted[:, None], 0)
  pooled = lambda counts, added: config.memory * counts + jnp.sum(added, axis=0)
  return HybridStats(steps=stats.steps + used, tokens=stats.tokens + gained,
                     recent_steps=fade * stats.recent_steps + arm,
                     recent_tokens=fade * stats.recent_tokens + arm_tokens,
                     batch_steps=pooled(stats.batch_steps, arm),
                     batch_tokens=pooled(stats.batch_tokens, arm_tokens))

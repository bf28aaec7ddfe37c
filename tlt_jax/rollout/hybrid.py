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
worse. The batch's rate starts from an optimistic prior (every step emits the most a step
can, with the weight of a tenth of a step), so each arm is tried at once, and an arm no row
picks for a while drifts back to it and is tried again. Ties go to the model-free chain,
the cheaper one. A `PickMemory` carries the batch's counts from one rollout to the next:
its first steps then pick by what earlier rollouts measured instead of trying every arm
anew.

The pick reads only earlier steps' outcomes and text, never this step's draws: the
verified draft is fixed before them, so verification stays exact whichever kind a row
picks. Both drafts have one verify shape (chain strategies), so a pick compiles nothing.

A single verify tree holding both drafts under one token budget (each chain at half the
depth, the drafter always paid) was the other design; it lost to the pick at greedy
decoding at every live batch measured (benchmarks/results/model_free_cpu.json) and was
removed.
"""
from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.errors import UserInputError
from tlt_jax.rollout import ngram
from tlt_jax.rollout.decode import DecodeState
from tlt_jax.rollout.drafting import Draft, DraftInputs, Verified, VerifyTree
from tlt_jax.rollout.learned_drafter import LearnedDrafter, LearnedState
from tlt_jax.rollout.model_free import ModelFreeDrafter
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.strategy import SpecStrategy

KINDS = ("learned", "ngram")   # the columns of `HybridStats`' [B, 2] counts
# The pick's arms: the learned drafter, and the model-free chain after a match of the full
# `max_ngram` tokens or a shorter one (a chain after a full match is accepted several times
# as often as one after a single token).
_LEARNED, _FULL_MATCH, _SHORT_MATCH = _ARMS = range(3)
_PRIOR_STEPS = 0.1             # the batch's optimistic prior's weight, in verify steps
_POOLED_STEPS = 1.0            # the weight of a row's prior, the batch's rate, in steps


@dataclasses.dataclass(frozen=True)
class HybridConfig:
  # A learned draft's time in verify passes: a depth-4 chain's drafter levels against its
  # 5-token verify (benchmarks/spec_step.py measures both on a platform).
  draft_cost: float = 0.2
  # Per-step discount of a row's counts: ~100 steps of memory.
  memory: float = 0.99

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
  """The batch's counts by arm, carried from one rollout to the next (host state its
  caller owns, `spec_config.SpecMemory`): `init_stats` starts from them, the engine keeps a
  rollout's last ones."""

  def __init__(self):
    self.steps, self.tokens = (np.zeros((len(_ARMS),), np.float32) for _ in range(2))

  def keep(self, stats: HybridStats) -> None:
    self.steps, self.tokens = (np.asarray(stats.batch_steps[0]),
                               np.asarray(stats.batch_tokens[0]))

  def state_dict(self) -> dict:
    return {"steps": self.steps.tolist(), "tokens": self.tokens.tolist()}

  def load_state_dict(self, state: dict) -> None:
    self.steps, self.tokens = (np.asarray(state[k], np.float32) for k in ("steps", "tokens"))


def init_stats(batch: int, memory: PickMemory | None = None) -> HybridStats:
  ints = lambda: jnp.zeros((batch, len(KINDS)), jnp.int32)
  floats = lambda: jnp.zeros((batch, len(_ARMS)), jnp.float32)
  carried = lambda counts: jnp.broadcast_to(jnp.asarray(counts, jnp.float32),
                                            (batch, len(_ARMS)))
  memory = memory or PickMemory()
  return HybridStats(steps=ints(), tokens=ints(), recent_steps=floats(),
                     recent_tokens=floats(), batch_steps=carried(memory.steps),
                     batch_tokens=carried(memory.tokens))


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
  whole batch pay a drafter step."""
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


@flax.struct.dataclass
class HybridState:
  learned: LearnedState
  context: ngram.DraftContext
  stats: HybridStats


@dataclasses.dataclass(frozen=True)
class HybridDrafter:
  """Both sources in step: the drafter runs the accepted pairs and the context grows by the
  emitted tokens whichever kind drafted. kind: "hybrid", each row picks per step; "learned"
  or "ngram", that kind drafts every row (a bandit pool mixing kinds). learned_run (a
  picking chunk's run of steps): whether some live row picks the drafter; if not, every
  row drafts the model-free chain and no drafter tree grows."""
  learned: LearnedDrafter
  model_free: ModelFreeDrafter
  config: HybridConfig = HybridConfig()
  kind: str = "hybrid"
  learned_run: bool = True

  def pick(self, state: HybridState, base: DecodeState, strategy: SpecStrategy,
           full_match: jax.Array | None = None) -> jax.Array:
    """[B] the rows whose pick is the learned drafter this step (`pick_learned`).
    full_match: as `ModelFreeDrafter.draft` gives it; None: the chain is matched here."""
    if full_match is None:
      ngram_config = self.model_free.ngram_config
      full_match = ngram.propose_chain(state.context, strategy.depth, ngram_config)[1] >= (
          ngram_config.max_ngram)
    return pick_learned(state.stats, self.config, strategy.depth + 1, ~base.done, full_match)

  def propose(self, key, inputs: DraftInputs, state: HybridState, base: DecodeState,
              strategy: SpecStrategy, sampling: SamplingParams) -> tuple[HybridState, Draft]:
    none = jnp.zeros(base.done.shape, bool)
    if self.kind != "learned":
      chain, full_match = self.model_free.draft(state.context, base, strategy, sampling)
    learned, root_hidden = self.learned.catch_up(inputs, state.learned)
    if self.kind == "ngram" or not self.learned_run:
      return state.replace(learned=learned), Draft(chain, none, full_match)
    learned, tree = self.learned.tree(key, inputs, learned, base, strategy, sampling,
                                      root_hidden)
    state = state.replace(learned=learned)
    if self.kind == "learned":
      return state, Draft(tree, ~none, none)
    use_learned = self.pick(state, base, strategy, full_match)
    tree, learned_rows, point_mass = _per_row(tree, chain, use_learned, sampling)
    return state, Draft(tree, learned_rows, full_match, point_mass)

  def commit(self, state: HybridState, strategy: SpecStrategy, verified: Verified
             ) -> HybridState:
    draft = verified.draft
    learned = self.learned.commit(state.learned, strategy, verified,
                                  counted=verified.live & draft.learned_rows)
    context = self.model_free.commit(state.context, strategy, verified)
    stats = record(state.stats, self.config, draft.learned_rows, verified.new_tokens,
                   verified.live, draft.full_match)
    return HybridState(learned=learned, context=context, stats=stats)

  def chunk_body(self, step, more, strategy: SpecStrategy):
    """A picking hybrid runs each kind's steps in a loop of its own rather than a
    conditional in every step, so the model-free loop's steps are the chain's alone."""
    if self.kind != "hybrid":
      return lambda carry: step(self, carry)

    def run_of(learned_run: bool):
      drafter = dataclasses.replace(self, learned_run=learned_run)

      def go_on(carry):
        s = carry[1]
        picked = self.pick(s.draft, s.base, strategy) & ~s.base.done
        return more(carry) & (jnp.any(picked) == learned_run)
      return lambda carry: jax.lax.while_loop(go_on, lambda c: step(drafter, c), carry)
    return lambda carry: run_of(True)(run_of(False)(carry))


def _per_row(learned: VerifyTree, chain: VerifyTree, use_learned: jax.Array,
             sampling: SamplingParams) -> tuple[VerifyTree, jax.Array, jax.Array | None]:
  """Per row, the learned drafter's tree where `use_learned` [B], else the model-free
  chain; and, when sampling, which nodes are point masses [B, V] (a model-free row's):
  recursive rejection then never reads their q rows."""
  pick = lambda a, b: jnp.where(use_learned.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)
  tree = learned._replace(tokens=pick(learned.tokens, chain.tokens),
                          depths=pick(learned.depths, chain.depths),
                          parents=pick(learned.parents, chain.parents),
                          mask=pick(learned.mask, chain.mask))
  point_mass = None if sampling.greedy else jnp.broadcast_to(~use_learned[:, None],
                                                             tree.tokens.shape)
  return tree, use_learned, point_mass


def start_state(learned: LearnedState, context: ngram.DraftContext,
                memory: PickMemory | None = None) -> HybridState:
  """A learned drafter's state that also drafts model-free from `context`; per-row counts
  by drafter kind feed the pick (from `memory`'s batch counts) and the stats."""
  return HybridState(learned=learned, context=context,
                     stats=init_stats(learned.pend_count.shape[0], memory))

"""Compiles a rollout's whole program pool up front, so the rollout itself compiles nothing.

`generate` compiles lazily: a program is built the first time its (batch bucket, attention
window, strategy) comes up. The first long-tail rollouts of a run, and every strategy a
bandit tries for the first time, would then pay compile time in the middle of decoding
(and a bandit chunk that compiled is not scored). `precompile` runs every program of
`Rollout.programs` once, through the same `Rollout` methods `generate` dispatches with, on
rows that are all finished, so its loops exit at once: only the prefills do real work.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.kv_cache import init_cache
from tlt_jax.models.transformer import Params
from tlt_jax.rollout import decode
from tlt_jax.rollout.buckets import BucketSpec
from tlt_jax.rollout.engine import (Admission, Program, Rollout, compiled_programs,
                                    draft_pool, prepare_rollout)
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.spec_config import SpecConfig
from tlt_jax.rollout.weights import DraftWeights
from tlt_jax.sharding.rules import MeshRules


def precompile(params: Params, config: ModelConfig, prompts: Sequence[Sequence[int]], *,
               max_new_tokens: int | Sequence[int],
               sampling: SamplingParams = SamplingParams(), eos_ids: Sequence[int] = (),
               buckets: BucketSpec = BucketSpec(), chunk_steps: int = 16,
               rules: MeshRules | None = None, spec: SpecConfig | None = None,
               drafter: DraftWeights | None = None, compact: bool = True,
               attention_impl: str = "auto", min_row_tokens: int = 0,
               group_ids: Sequence[int] | None = None,
               draft_context: Sequence[Sequence[int]] | None = None,
               capture_hidden: bool = False, max_rows: int | None = None) -> int:
  """Compiles every program `generate` can dispatch with these arguments, for any prompts
  that give the same rollout plan (batch bucket, padded prompt length, cache length,
  distinct prompts per prefill group; model-free: the same pool shapes from group_ids and
  draft_context), whatever their lengths. Returns how many programs were new."""
  before = compiled_programs()
  rollout, groups, extras = prepare_rollout(
      params, config, prompts, max_new_tokens=max_new_tokens, spec=spec, drafter=drafter,
      eos_ids=eos_ids, group_ids=group_ids, draft_context=draft_context, rules=rules,
      attention_impl=attention_impl, buckets=buckets, min_row_tokens=min_row_tokens,
      sampling=sampling, chunk_steps=chunk_steps, compact=compact,
      capture_hidden=capture_hidden, max_rows=max_rows)
  builder = ProgramBuilder(rollout, len(prompts), groups, extras)
  for program in rollout.programs():
    builder.build(program)
  jax.block_until_ready(builder.states)
  return compiled_programs() - before


class ProgramBuilder:
  """Runs each listed program once on a state of its batch, all rows finished; each kind's
  programs come after those that make its input states (`Rollout.programs`' order). The
  rollout's runner runs them: compiled and run here, or traced and lowered for another
  platform (`tlt_jax.rollout.lowering`, whose states are then shapes, not arrays)."""

  def __init__(self, rollout: Rollout, num_prompts: int, groups, extras):
    self.rollout, self.num_prompts = rollout, num_prompts
    self.groups, self.extras = groups, extras
    self.states: dict[tuple[str, int], object] = {}

  def build(self, program: Program) -> None:
    getattr(self, "_" + program.kind)(program)

  def _prefill(self, program: Program) -> None:
    # A rollout's first group starts from a fresh state, the others from a prefilled one
    # (committed to the device): jit keys those apart.
    rollout, plan = self.rollout, self.rollout.plan
    batch, width = plan.batch, program.size
    group_rows = rollout.buckets.prefill_group_rows(batch)
    state = decode.empty_state(
        _cache(rollout), jnp.ones((batch,), jnp.int32), jnp.zeros((batch,), bool),
        jax.random.key(0), max_new_tokens=plan.max_new_tokens,
        keep_hidden=rollout.keep_hidden,
        hidden_size=rollout.config.hidden_size, rules=rollout.rules)
    for count in [plan.prefill_prompts[0]] + sorted(set(plan.prefill_prompts[1:])):
      state = rollout.prefill_group(
          state, jnp.zeros((count, width), jnp.int32), jnp.ones((count,), jnp.int32),
          jnp.zeros((group_rows,), jnp.int32), jnp.int32(0))
    self.states["decode", batch] = state

  def _admit(self, program: Program) -> None:
    # Every row of the unit bound for no row (past the batch): nothing changes.
    unit = self.rollout.buckets.prefill_group_rows(program.batch)
    ints = lambda shape, value: np.full(shape, value, np.int32)
    key = "decode", program.batch
    self.states[key] = self.rollout.admit(self.states[key], Admission(
        tokens=ints((program.distinct, program.size), 0), lengths=ints(program.distinct, 1),
        sources=ints(unit, 0), rows=ints(unit, program.batch), caps=ints(unit, 1),
        prompts=ints(unit, -1)))

  def _compact(self, program: Program, kind: str = "decode") -> None:
    source = self.states[kind, program.batch]
    self.states.setdefault((kind, program.size),
                           self.rollout.take(source, np.zeros((program.size,), np.int32)))

  def _decode(self, program: Program) -> None:
    key = "decode", program.batch
    self.states[key] = self.rollout.decode(self.states[key], program.window)

  def _switch(self, program: Program) -> None:
    # Each switch donates its state: every switch from a copy of the batch's decode state.
    rollout = self.rollout
    pool = None if not rollout.spec.model_free else draft_pool(
        [[0]] * self.num_prompts, self.groups, self.extras, np.full((program.batch,), -1),
        rollout.plan)
    source = jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x,
                          self.states["decode", program.batch])
    self.states["spec", program.batch] = rollout.switch(source, program.size, pool, None)

  def _spec_compact(self, program: Program) -> None:
    self._compact(program, "spec")

  def _spec(self, program: Program) -> None:
    key = "spec", program.batch
    self.states[key] = self.rollout.speculate(self.states[key], program.strategy,
                                              program.window)


def _cache(rollout: Rollout):
  return init_cache(rollout.config, rollout.plan.batch, rollout.plan.cache_len,
                    rollout.params["embed"].dtype, rollout.rules, per_layer=True)

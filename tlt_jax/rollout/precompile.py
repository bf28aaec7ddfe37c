"""Compiles a rollout's whole program pool up front, so the rollout itself compiles nothing.

`generate` compiles lazily: a program is built the first time its (batch bucket, attention
window, strategy) comes up. The first long-tail rollouts of a run, and every strategy a
bandit tries for the first time, would then pay compile time in the middle of decoding
(and a bandit chunk that compiled is not scored). `precompile` enumerates every program
that a `generate` call with the same arguments can dispatch and runs each once on rows
that are all finished, so its loops exit at once: only the prefills do real work.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.drafter import draft_head
from tlt_jax.models.kv_cache import init_cache
from tlt_jax.models.transformer import Params
from tlt_jax.rollout import decode, speculative
from tlt_jax.rollout.buckets import BucketSpec
from tlt_jax.rollout.engine import (SpecConfig, check_attention_impl, chunk_reach,
                                    compiled_programs, draft_groups, draft_pool,
                                    place_spec, plan_rollout, switch_to_speculation,
                                    take_rows, windowed_attention)
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.sharding.rules import MeshRules


def precompile(params: Params, config: ModelConfig, prompts: Sequence[Sequence[int]], *,
               max_new_tokens: int | Sequence[int],
               sampling: SamplingParams = SamplingParams(), eos_ids: Sequence[int] = (),
               buckets: BucketSpec = BucketSpec(), chunk_steps: int = 16,
               rules: MeshRules | None = None, spec: SpecConfig | None = None,
               compact: bool = True, attention_impl: str = "auto",
               min_row_tokens: int = 0, group_ids: Sequence[int] | None = None,
               draft_context: Sequence[Sequence[int]] | None = None) -> int:
  """Compiles every program `generate` can dispatch with these arguments, for any prompts
  that give the same rollout plan (batch bucket, padded prompt length, cache length,
  distinct prompts per prefill group; model-free: the same pool shapes from group_ids and
  draft_context), whatever their lengths.
  Returns how many programs were new. A bandit's state is left untouched."""
  check_attention_impl(attention_impl)
  before = compiled_programs()
  plan = plan_rollout(prompts, max_new_tokens, config, buckets, spec, eos_ids, min_row_tokens)
  # Model-free programs are also keyed by the draft context's sizes, which these decide.
  groups, extras = draft_groups(prompts, group_ids, draft_context, spec, config.vocab_size)
  params, spec = place_spec(params, config, spec, rules)
  learned = spec is not None and spec.drafter is not None
  static = dict(config=config, sampling=sampling, eos_ids=plan.eos_ids,
                max_new_tokens=plan.max_new_tokens, attention_impl=attention_impl)
  dtype = params["embed"].dtype
  start = plan.batch
  # Compaction can shrink the batch to any smaller bucket; SD runs once live rows fit the
  # threshold, so in the buckets up to the threshold's (or only the start one, uncompacted).
  batches = [b for b in buckets.batch_buckets if b <= start] if compact else [start]
  spec_batches = []
  if spec is not None:
    spec_batches = [b for b in batches
                    if not compact or b <= buckets.batch_bucket(min(spec.threshold, start))]
  windows = lambda spec_or_none: [
      None if w == plan.cache_len else w
      for w in buckets.attention_windows(chunk_reach(1, chunk_steps, spec_or_none),
                                         plan.cache_len)
  ] if windowed_attention(attention_impl, rules) else [None]

  fresh_state = lambda: decode.empty_state(
      init_cache(config, start, plan.cache_len, dtype, rules, per_layer=True),
      jnp.ones((start,), jnp.int32), jnp.zeros((start,), bool), jax.random.key(0),
      max_new_tokens=plan.max_new_tokens, keep_hidden=learned,
      hidden_size=config.hidden_size, rules=rules)
  group_rows = buckets.prefill_group_rows(start)
  prefill = lambda state, count, width: decode.prefill_rows(
      params, state, jnp.zeros((count, width), jnp.int32), jnp.ones((count,), jnp.int32),
      jnp.zeros((group_rows,), jnp.int32), jnp.int32(0), rules=rules, **static)
  for width in buckets.prompt_lengths(plan.prompt_len):   # any prefill group's padding
    # A rollout's first group starts from a fresh state, the others from a prefilled one
    # (committed to the device): jit keys those apart.
    state = prefill(fresh_state(), plan.prefill_prompts[0], width)
    for count in sorted(set(plan.prefill_prompts[1:])):
      state = prefill(state, count, width)
  states = {start: state}
  _compact_pairs(states, batches, rules)
  for b in batches:
    for window in windows(None):
      states[b] = decode.decode_chunk(params, states[b], chunk_steps=chunk_steps, window=window,
                                      rules=rules, **static)

  if spec_batches:
    head = draft_head(params, config, spec.vocab_ids) if learned else None
    # The switch can come at any longest live row, 1..cache_len: every `drafter_prefill_len`.
    prefill_lens = buckets.attention_windows(1, plan.cache_len) if learned else []
    spec_states = {}
    for b in spec_batches:
      state = states.pop(b)
      # The pool's shapes depend neither on its text nor on the rows left.
      pool = (None if spec.ngram_config is None else
              draft_pool([[0]] * len(prompts), groups, extras, np.full((b,), -1), plan))
      if not learned:
        spec_states[b] = speculative.start_model_free(state, pool, rules)
      for length in prefill_lens:
        # Each switch donates its state: all but the last switch from a copy.
        source = state if length == prefill_lens[-1] else jax.tree.map(jnp.copy, state)
        spec_states[b] = switch_to_speculation(params, config, spec, source, plan, length,
                                               attention_impl, rules)
      if learned and pool is not None:
        spec_states[b] = speculative.add_model_free(spec_states[b], pool, rules=rules)
    _compact_pairs(spec_states, spec_batches, rules)
    for b in spec_batches:
      for window in windows(spec):
        for strategy in spec.strategies:
          spec_states[b] = speculative.spec_chunk(
              params, spec.drafter, head, spec.vocab_ids, spec_states[b], strategy=strategy,
              chunk_steps=chunk_steps, window=window, ngram_config=spec.ngram_config,
              hybrid=spec.row_counts, kind=spec.kind_of(strategy),
              draft_temperature_ratio=spec.draft_temperature_ratio, rules=rules, **static)
    jax.block_until_ready(spec_states)
  jax.block_until_ready(states)
  return compiled_programs() - before


def _compact_pairs(states: dict, sizes: list[int], rules: MeshRules | None) -> None:
  """Runs compaction from every size to every smaller one (any drop in live rows can skip
  buckets); fills `states` with a state of each size, all rows finished."""
  for size in sorted(sizes, reverse=True):
    for smaller in (s for s in sizes if s < size):
      compacted = take_rows(states[size], jnp.zeros((smaller,), jnp.int32), rules)
      states.setdefault(smaller, compacted)

"""Rollout engine: bucketed batch generation with long-tail compaction and adaptive SD.

The host loop runs jitted chunks of decode steps and, between chunks, (1) compacts the
live rows into the next smaller batch bucket once they fit, so the long tail runs at its
true size rather than padded to the starting batch, (2) switches speculative decoding on
once at most `sd_threshold` rows have stayed live for `sd_patience` steps, and (3) with a
pool of strategies, lets the BEG-MAB bandit pick each SD chunk's strategy and scores it by
the chunk's tokens per second. Drafts come from a learned drafter or, model-free, from
each row's group text (`ngram.py`: its own, its siblings', the caller's `draft_context`).
Every program is keyed by (batch bucket, cache length, strategy; model-free also the draft
context's bucketed sizes): the set is finite, `compiled_programs()` reports how many
exist, and `precompile` (precompile.py) builds a rollout's whole set before it starts.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
import warnings
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.compiles import CompileCounter
from tlt_jax.errors import UserInputError
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.drafter import DrafterParams, init_drafter_cache
from tlt_jax.models.kv_cache import KVCache, init_cache
from tlt_jax.models.transformer import Params
from tlt_jax.pallas.tree_attention import IMPLS, resolve_impl
from tlt_jax.rollout import decode, hybrid as hybrid_lib, ngram, speculative
from tlt_jax.rollout.bandit import StrategyBandit
from tlt_jax.rollout.buckets import BucketSpec
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.strategy import DRAFTER_KINDS, SpecStrategy
from tlt_jax.rollout.weights import DraftWeights, place_rollout, rollout_draft_head
from tlt_jax.sharding.rules import MeshRules, spans_devices


MAX_SD_THRESHOLD = 256   # the largest batch bucket: SD above it never pays
DEFAULT_DRAFT_TEMPERATURE_RATIO = 0.7


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  """Speculative decoding for the tail: on below `threshold` live rows for `patience` steps.

  Drafts from a learned `drafter`, model-free (`ngram_config`: chains or trees from the
  rows' group text), or, with `hybrid`, from both: each row picks one per verify step
  (`hybrid.py`).
  Either one fixed `strategy`, or a `bandit` that picks among its strategies per chunk by
  live batch size (and learns across the rollouts that share it). A strategy may name its
  drafter kind (`ngram:4_1_5`), so a pool can mix kinds; unnamed ones use `kind_of`'s
  default. The sources given must be the ones the strategies use."""
  drafter: DrafterParams | None = None
  strategy: SpecStrategy | None = None
  vocab_ids: jax.Array | None = None   # reduced draft vocabulary (sorted target ids)
  threshold: int = 32
  patience: int = 10
  bandit: StrategyBandit | None = None
  # Sampled trees draw at this times the sampling temperature (exact at any ratio). A
  # sharper q than the drafter's own puts more of a node's draws on the tokens the target
  # favours: SmolLM2 at T=1, 48 prompts, 8_8_32: accept 2.34 at ratio 1.25, 2.59 at 1, 2.66
  # at 0.8, 2.69 at 0.7, 2.55 at 0.6; 8_4_16: 2.36 at 1, 2.47 at 0.7. A chain's one draft
  # does not gain (4_1_5: 1.97 at 1, 1.91 at 0.7), so chains keep the sampling temperature.
  draft_temperature_ratio: float = DEFAULT_DRAFT_TEMPERATURE_RATIO
  ngram_config: ngram.NgramConfig | None = None
  hybrid: hybrid_lib.HybridConfig | None = None   # needs drafter and ngram_config
  # Carries the hybrid's batch counts from one rollout to the next (those that share it);
  # None: every rollout's pick starts afresh.
  pick_memory: hybrid_lib.PickMemory | None = None

  def __post_init__(self):
    if (self.strategy is None) == (self.bandit is None):
      raise UserInputError("SpecConfig: give exactly one of strategy and bandit")
    if self.hybrid is not None and (self.drafter is None or self.ngram_config is None):
      raise UserInputError("SpecConfig: hybrid drafting needs both drafter and ngram_config")
    if self.pick_memory is not None and self.hybrid is None:
      raise UserInputError("SpecConfig: pick_memory carries the hybrid's pick: needs hybrid")
    for s in self.strategies:
      kind = self.kind_of(s)
      if kind != "ngram" and self.drafter is None:
        raise UserInputError(f"--strategy={s.name}: needs a learned drafter (--drafter=DIR)")
      if kind != "learned" and self.ngram_config is None:
        raise UserInputError(f"--strategy={s.name}: needs model-free drafting "
                             "(--drafter=ngram or --hybrid)")
      if kind == "hybrid" and self.hybrid is None:
        raise UserInputError(f"--strategy={s.name}: needs --hybrid")
      if kind == "hybrid" and self.hybrid.merge and s.depth < 2:
        raise UserInputError(f"--strategy={s.name}: a merged hybrid tree splits the depth "
                             "between its two chains: needs depth >= 2")
      if kind == "hybrid" and s.topk > 1:
        # Its two drafts share one verify shape, so its learned drafts are chains too.
        raise UserInputError(f"--strategy={s.name}: hybrid drafting verifies chains "
                             "(DEPTH_1_DEPTH+1)")
    kinds = {self.kind_of(s) for s in self.strategies}
    if ((self.drafter is not None and kinds == {"ngram"})
        or (self.ngram_config is not None and kinds == {"learned"})):
      raise UserInputError("SpecConfig: give exactly one of drafter and ngram_config, or "
                           "strategies that use both")
    self.validate_schedule(self.threshold, self.patience)
    if not 0 < self.draft_temperature_ratio <= 4:
      raise UserInputError(f"--draft_temperature_ratio={self.draft_temperature_ratio}: must "
                           "be in (0, 4]")

  def kind_of(self, strategy: SpecStrategy) -> str:
    """The drafter kind of a strategy: its own, else hybrid with `hybrid`, else the one
    source given (learned when both are)."""
    if strategy.drafter is not None:
      return strategy.drafter
    if self.hybrid is not None:
      return "hybrid"
    return "learned" if self.drafter is not None else "ngram"

  @property
  def kind(self) -> str:
    """The drafter kinds of the strategies, as stats name them ("learned+ngram": a pool)."""
    kinds = {self.kind_of(s) for s in self.strategies}
    return "+".join(k for k in DRAFTER_KINDS if k in kinds)

  @property
  def row_counts(self) -> hybrid_lib.HybridConfig | None:
    """With both sources, each row counts its steps and tokens by drafter kind (a hybrid
    step's pick reads them, and the stats split by them): by `hybrid`'s settings."""
    if self.drafter is None or self.ngram_config is None:
      return None
    return self.hybrid or hybrid_lib.HybridConfig()

  @property
  def strategies(self) -> tuple[SpecStrategy, ...]:
    """Every strategy a rollout may run: its programs and cache margin cover them all."""
    return self.bandit.strategies if self.bandit is not None else (self.strategy,)

  @staticmethod
  def validate_schedule(threshold: int, patience: int) -> None:
    if not 1 <= threshold <= MAX_SD_THRESHOLD:
      raise UserInputError(f"--sd_threshold={threshold}: must be in [1, {MAX_SD_THRESHOLD}]")
    if patience < 0:
      raise UserInputError(f"--sd_patience={patience}: must be >= 0")


@dataclasses.dataclass(frozen=True)
class GenerationOutput:
  token_ids: list[int]
  logprobs: list[float]
  finish_reason: str         # "eos" | "length"


@dataclasses.dataclass(frozen=True)
class GenerationResult:
  outputs: list[GenerationOutput]
  stats: dict


@functools.partial(jax.jit, static_argnames=("rules",))
def take_rows(state, rows: jax.Array, rules: MeshRules | None = None):
  """Gathers batch rows of a decode/spec state (compaction); the RNG key is shared, and so
  is a model-free draft context's pool (only the rows' member lists are gathered)."""
  def take(x):
    if isinstance(x, KVCache):
      return x.map(lambda buf: buf[:, rows]).replace(lengths=x.lengths[rows])
    if isinstance(x, ngram.DraftContext):
      return x.replace(members=x.members[rows])
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      return x
    return x[rows]
  return decode.lay_out(jax.tree.map(
      take, state, is_leaf=lambda x: isinstance(x, (KVCache, ngram.DraftContext))), rules)


_PROGRAMS = (decode.prefill_rows, decode.decode_chunk, speculative.start_speculation,
             speculative.spec_chunk, take_rows)
_COMPILES = CompileCounter(_PROGRAMS)


def compiled_programs() -> int:
  """Programs compiled so far by the engine's jitted entry points (process-wide)."""
  return _COMPILES.count


def pad_prompts(prompts: Sequence[Sequence[int]], batch_size: int,
                padded_length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Right-pads prompts into [batch_size, padded_length]; extra rows are dead (live=False)."""
  tokens = np.zeros((batch_size, padded_length), np.int32)
  lengths = np.ones((batch_size,), np.int32)
  live = np.zeros((batch_size,), bool)
  for i, prompt in enumerate(prompts):
    tokens[i, :len(prompt)] = prompt
    lengths[i] = len(prompt)
    live[i] = True
  return tokens, lengths, live


class _Harvest:
  """Host-side outputs, filled as rows leave the device state (compaction or the end).

  Per-row SD counters are harvested with the rows: compaction drops finished rows (and
  pads with copies of one), so the final state alone would count only the tail."""

  def __init__(self, num_prompts: int):
    self.tokens: list = [None] * num_prompts
    self.logprobs: list = [None] * num_prompts
    self.spec_steps = np.zeros((num_prompts,), np.int64)
    self.spec_tokens = np.zeros((num_prompts,), np.int64)
    # With both sources: verify steps each drafter kind drafted, and the tokens they emitted.
    self.kind_steps = np.zeros((num_prompts, len(hybrid_lib.KINDS)), np.int64)
    self.kind_tokens = np.zeros((num_prompts, len(hybrid_lib.KINDS)), np.int64)

  def so_far(self, state, row_ids: np.ndarray) -> list[list[int]]:
    """Every prompt's tokens emitted so far: harvested, or still in `state`."""
    base = _base(state)
    counts, out_tokens = np.asarray(base.num_generated), np.asarray(base.out_tokens)
    outputs = list(self.tokens)
    for row, prompt in enumerate(row_ids):
      if prompt >= 0 and outputs[prompt] is None:
        outputs[prompt] = out_tokens[row, :counts[row]].tolist()
    return outputs

  def take(self, state, row_ids: np.ndarray, which: np.ndarray) -> None:
    speculating = isinstance(state, speculative.SpecState)
    base = _base(state)
    counts = np.asarray(base.num_generated)
    out_tokens, out_logprobs = np.asarray(base.out_tokens), np.asarray(base.out_logprobs)
    if speculating:
      spec_steps, spec_tokens = np.asarray(state.spec_steps), np.asarray(state.spec_tokens)
    hybrid = state.hybrid if speculating else None
    if hybrid is not None:
      kind_steps, kind_tokens = np.asarray(hybrid.steps), np.asarray(hybrid.tokens)
    for row in np.flatnonzero(which):
      prompt = row_ids[row]
      if prompt >= 0 and self.tokens[prompt] is None:
        self.tokens[prompt] = out_tokens[row, :counts[row]].tolist()
        self.logprobs[prompt] = out_logprobs[row, :counts[row]].tolist()
        if speculating:
          self.spec_steps[prompt], self.spec_tokens[prompt] = spec_steps[row], spec_tokens[row]
        if hybrid is not None:
          self.kind_steps[prompt], self.kind_tokens[prompt] = kind_steps[row], kind_tokens[row]

  def by_drafter(self, spec: SpecConfig) -> tuple[dict[str, float], dict[str, float]]:
    """Per drafter kind: tokens per verify step it drafted, and its share of verify steps.
    With both sources the steps split by what drafted them, the learned drafter or the
    model-free chain (a hybrid step under its row's pick); one source drafts them all."""
    ratio = lambda a, b: float(a / b) if b else 0.0
    if spec.row_counts is None:
      return {spec.kind: ratio(self.spec_tokens.sum(), self.spec_steps.sum())}, {spec.kind: 1.0}
    steps, tokens = self.kind_steps.sum(0), self.kind_tokens.sum(0)
    return ({k: ratio(t, n) for k, n, t in zip(hybrid_lib.KINDS, steps, tokens)},
            {k: ratio(n, steps.sum()) for k, n in zip(hybrid_lib.KINDS, steps)})


def _base(state) -> decode.DecodeState:
  return state.base if isinstance(state, speculative.SpecState) else state


def _row_caps(prompts, max_new_tokens, config) -> np.ndarray:
  """Each row's token budget, validated against the model's context."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise UserInputError("prompts: need at least one prompt, and every prompt non-empty")
  per_row = not isinstance(max_new_tokens, (int, np.integer))
  caps = np.asarray(max_new_tokens if per_row else [max_new_tokens] * len(prompts), np.int64)
  if caps.shape != (len(prompts),):
    raise UserInputError(f"max_new_tokens: {caps.size} per-row caps for {len(prompts)} prompts")
  for i, (prompt, cap) in enumerate(zip(prompts, caps)):
    name = f"max_new_tokens[{i}]" if per_row else "--max_new_tokens"
    if cap < 1:
      raise UserInputError(f"{name}={cap}: must be >= 1")
    if len(prompt) + cap > config.max_position_embeddings:
      raise UserInputError(
          f"{name}={cap}: prompt {i} of {len(prompt)} tokens + {cap} exceeds the model's "
          f"max_position_embeddings {config.max_position_embeddings}")
  return caps


@dataclasses.dataclass(frozen=True)
class RolloutPlan:
  """The shapes that key a rollout's programs: rollouts with equal plans (and equal other
  arguments) share every program."""
  caps: tuple[int, ...]        # each row's token budget
  batch: int                   # starting batch bucket
  prompt_len: int              # padded prompt length
  cache_len: int
  eos_ids: tuple[int, ...]
  prefill_prompts: tuple[int, ...]   # distinct prompts each prefill group runs, in order

  @property
  def max_new_tokens(self) -> int:
    return max(self.caps)


def plan_rollout(prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                 config: ModelConfig, buckets: BucketSpec, spec: SpecConfig | None,
                 eos_ids: Sequence[int], min_row_tokens: int = 0) -> RolloutPlan:
  """Validates the prompts and caps, and derives the shapes every program is built for.
  min_row_tokens sizes the cache for rows of at least that many tokens: a run whose
  prompts vary in length then keeps one cache length, and so one set of programs."""
  caps = _row_caps(prompts, max_new_tokens, config)
  prompt_len = buckets.prompt_length(max(len(p) for p in prompts))
  margin = speculative.cache_margin(spec.strategies) if spec else 0
  longest_row = max(min_row_tokens, *(len(p) + int(cap) for p, cap in zip(prompts, caps)))
  batch = buckets.batch_bucket(len(prompts))
  tokens, lengths, _, _ = sorted_rows(prompts, batch, prompt_len)
  return RolloutPlan(caps=tuple(int(c) for c in caps), batch=batch, prompt_len=prompt_len,
                     cache_len=buckets.cache_length(max(prompt_len, longest_row + margin)),
                     eos_ids=tuple(sorted(set(int(e) for e in eos_ids))),
                     prefill_prompts=tuple(len(picked) for _, _, picked, _
                                           in prefill_groups(tokens, lengths, buckets)))


def sorted_rows(prompts: Sequence[Sequence[int]], batch: int, prompt_len: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """The prompts padded into rows (tokens, lengths, live; see `pad_prompts`) in prefill
  order, and that order: longest first, equal prompts adjacent (see `prefill`)."""
  tokens, lengths, live = pad_prompts(prompts, batch, prompt_len)
  order = np.lexsort((prompt_ids(tokens, lengths), -lengths))
  return tokens[order], lengths[order], live[order], order


def prefill(params: Params, tokens: np.ndarray, lengths: np.ndarray, live: np.ndarray,
            caps: np.ndarray, cache: KVCache, key: jax.Array, *, buckets: BucketSpec,
            keep_hidden: bool, rules: MeshRules | None, config: ModelConfig,
            **static) -> decode.DecodeState:
  """Prefills padded prompts whose rows are sorted longest first, group by group
  (`BucketSpec.prefill_groups`), each group padded only to its own longest prompt and
  running each distinct prompt once (`distinct_prompts`)."""
  state = decode.empty_state(cache, jnp.asarray(caps), jnp.asarray(live), key,
                             max_new_tokens=static["max_new_tokens"], keep_hidden=keep_hidden,
                             hidden_size=config.hidden_size, rules=rules)
  for group, width, picked, sources in prefill_groups(tokens, lengths, buckets):
    state = decode.prefill_rows(params, state, jnp.asarray(tokens[group][picked, :width]),
                                jnp.asarray(lengths[group][picked]), jnp.asarray(sources),
                                jnp.int32(group.start), config=config, rules=rules, **static)
  return state


def prefill_groups(tokens: np.ndarray, lengths: np.ndarray, buckets: BucketSpec):
  """The prefill groups of sorted, padded rows: (rows slice, padded width, the rows it runs
  and each row's index into them; see `distinct_prompts`) per group."""
  rows = buckets.prefill_group_rows(len(lengths))
  for start in range(0, len(lengths), rows):
    group = slice(start, start + rows)
    yield (group, buckets.prompt_length(int(lengths[group].max())),
           *distinct_prompts(tokens[group], lengths[group], buckets))


def prompt_ids(tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
  """Each row's prompt, numbered by first occurrence: equal ids, equal prompts."""
  ids: dict[bytes, int] = {}
  return np.array([ids.setdefault(row[:n].tobytes(), len(ids))
                   for row, n in zip(tokens, lengths)], np.int64)


def distinct_prompts(tokens: np.ndarray, lengths: np.ndarray, buckets: BucketSpec
                     ) -> tuple[np.ndarray, np.ndarray]:
  """(rows of `tokens` [G, T] to run: one per distinct prompt, padded by repeats to
  `BucketSpec.distinct_prompts`; each row's index into them)."""
  sources = prompt_ids(tokens, lengths)
  picked = [int(np.argmax(sources == i)) for i in range(sources.max() + 1)]
  count = buckets.distinct_prompts(len(picked), len(lengths))
  return np.array(picked + picked[:1] * (count - len(picked))), sources.astype(np.int32)


def tail_seconds(trace: Sequence[tuple[float, int]], num_prompts: int) -> float:
  """`rollout/tail_s`: from the first chunk boundary with 90% of the rows done to the
  end of the rollout; trace: the (seconds, live rows) points of `rollout/live_rows`."""
  tail_rows = num_prompts - math.ceil(0.9 * num_prompts)
  started = next(t for t, live in trace if live <= tail_rows)
  return trace[-1][0] - started


def check_attention_impl(attention_impl: str) -> None:
  if attention_impl not in IMPLS:
    raise UserInputError(f"--attention_impl={attention_impl!r}: expected one of {', '.join(IMPLS)}")


def chunk_reach(longest_live: int, chunk_steps: int, spec: SpecConfig | None) -> int:
  """Cache slots a chunk can touch (the ones it may write included): with `spec`, a
  speculative chunk of any of its strategies, else a plain one."""
  if spec is None:
    return longest_live + chunk_steps
  return (longest_live + chunk_steps * speculative.pending_width(spec.strategies)
          + speculative.cache_margin(spec.strategies))


def windowed_attention(attention_impl: str, rules: MeshRules | None) -> bool:
  """Whether chunks attend over a window of the cache (copied out and back per chunk). The
  CPU attention kernel reads only the slots a query sees, where a window only adds the
  copies (SmolLM2, batch 8: ~2 ms a step)."""
  return resolve_impl(attention_impl, sharded=spans_devices(rules)) != "cpu"


def chunk_window(longest_live: int, chunk_steps: int, spec: SpecConfig | None,
                 plan: RolloutPlan, buckets: BucketSpec, windowed: bool) -> int | None:
  """The cache prefix a chunk attends over; None is the whole cache."""
  if not windowed:
    return None
  window = buckets.attention_window(chunk_reach(longest_live, chunk_steps, spec),
                                    plan.cache_len)
  return None if window == plan.cache_len else window


def switch_to_speculation(params: Params, config: ModelConfig, spec: SpecConfig,
                          state: decode.DecodeState, plan: RolloutPlan, prefill_len: int,
                          attention_impl: str, rules: MeshRules | None
                          ) -> speculative.SpecState:
  """A fresh drafter cache, prefilled over every live row's context (`state` is donated);
  prefill_len: `drafter_prefill_len`."""
  draft_cache = init_drafter_cache(config, state.done.shape[0], plan.cache_len,
                                   params["embed"].dtype, rules,
                                   per_layer=isinstance(spec.drafter["layers"], tuple))
  with warnings.catch_warnings():
    # The kept tokens and hidden states are donated with the state and dropped by design
    # (speculation runs without them), so no output can reuse them: JAX's warning about
    # that is expected here. Donating them apart instead crashed XLA's CPU compiler.
    warnings.filterwarnings("ignore", "Some donated buffers were not usable", UserWarning)
    return speculative.start_speculation(
        params, spec.drafter, state, draft_cache, config=config, strategies=spec.strategies,
        prefill_len=prefill_len, attention_impl=attention_impl, rules=rules)


def drafter_prefill_len(longest_live: int, plan: RolloutPlan, buckets: BucketSpec) -> int:
  """Slots the drafter prefill at the switch runs: the longest live row's context, bucketed
  as attention windows are (a page times a power of two, capped at the cache)."""
  return buckets.attention_window(longest_live, plan.cache_len)


def draft_groups(prompts: Sequence[Sequence[int]], group_ids: Sequence[int] | None,
                 draft_context: Sequence[Sequence[int]] | None, spec: SpecConfig | None,
                 vocab_size: int) -> tuple[list[int], list[list[int]]]:
  """Validated model-free draft inputs: each prompt's group (default: equal prompts form
  one) and its extra draft text (default: none)."""
  n = len(prompts)
  if group_ids is None:
    ids: dict[tuple, int] = {}
    group_ids = [ids.setdefault(tuple(p), len(ids)) for p in prompts]
  elif len(group_ids) != n or not all(isinstance(g, (int, np.integer)) for g in group_ids):
    raise UserInputError(f"group_ids: expected {n} integers (one per prompt), got "
                         f"{len(group_ids)} items")
  if draft_context is None:
    return list(group_ids), [[] for _ in prompts]
  if spec is None or spec.ngram_config is None:
    raise UserInputError("draft_context: needs model-free drafting (--drafter=ngram, or "
                         "--hybrid)")
  is_tokens = lambda t: isinstance(t, (list, tuple, np.ndarray)) and all(
      isinstance(x, (int, np.integer)) and 0 <= x < vocab_size for x in t)
  if len(draft_context) != n or not all(is_tokens(t) for t in draft_context):
    raise UserInputError(f"draft_context: expected {n} lists (one per prompt) of token ids "
                         f"in [0, {vocab_size})")
  return list(group_ids), [list(t) for t in draft_context]


def draft_pool(texts: Sequence[Sequence[int]], groups: Sequence[int],
               extras: Sequence[Sequence[int]], row_ids: np.ndarray,
               plan: RolloutPlan) -> ngram.DraftContext:
  """The model-free pool: every prompt's text so far (texts; prompt i is entry i, which
  batch rows find through row_ids) and the non-empty extras, each in its prompt's group."""
  with_extras = [i for i, extra in enumerate(extras) if extra]
  entries = list(texts) + [extras[i] for i in with_extras]
  # The cache length, doubled until the longest entry fits: extras longer than the cache
  # (several earlier responses) then take a few lengths, not one per cache page, so rollouts
  # whose extras differ a little share programs.
  length, longest = plan.cache_len, max(map(len, entries))
  while length < longest:
    length *= 2
  return ngram.build_context(entries, list(groups) + [groups[i] for i in with_extras],
                             row_ids, length)


def place_spec(params, config, spec, rules):
  drafter = None if spec is None or spec.drafter is None else DraftWeights(spec.drafter, spec.vocab_ids)
  params, drafter = place_rollout(params, config, drafter, rules)
  if drafter is None:
    return params, spec
  return params, dataclasses.replace(spec, drafter=drafter.params, vocab_ids=drafter.vocab_ids)


def generate(params: Params, config: ModelConfig, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int | Sequence[int], sampling: SamplingParams = SamplingParams(),
             eos_ids: Sequence[int] = (), seed: int = 0, buckets: BucketSpec = BucketSpec(),
             chunk_steps: int = 16, rules: MeshRules | None = None,
             spec: SpecConfig | None = None, compact: bool = True,
             attention_impl: str = "auto", min_row_tokens: int = 0,
             group_ids: Sequence[int] | None = None,
             draft_context: Sequence[Sequence[int]] | None = None) -> GenerationResult:
  """Generates up to `max_new_tokens` tokens for each prompt (lists of token ids); a
  sequence gives each prompt its own cap.

  Model-free drafting (`spec.ngram_config`) reads each row's group: the rows of equal
  group_ids (default: of equal prompts), their text so far and the extra token list
  draft_context[i] of each of its prompts (say an earlier epoch's response to it).

  attention_impl: "auto" (Pallas kernel on GPU, jnp elsewhere), "reference", "pallas"
  (interpreted off-GPU: slow, for checking) or "triton".
  rules: the rollout replica's mesh and sharding rules (`place_rollout`); None runs on the
  default device.
  """
  check_attention_impl(attention_impl)
  plan = plan_rollout(prompts, max_new_tokens, config, buckets, spec, eos_ids, min_row_tokens)
  groups, extras = draft_groups(prompts, group_ids, draft_context, spec, config.vocab_size)
  params, spec = place_spec(params, config, spec, rules)
  batch, prompt_len, cache_len = plan.batch, plan.prompt_len, plan.cache_len
  tokens, lengths, live, order = sorted_rows(prompts, batch, prompt_len)
  row_caps = np.ones((batch,), np.int32)
  row_caps[:len(prompts)] = plan.caps
  row_caps = row_caps[order]
  static = dict(config=config, sampling=sampling, eos_ids=plan.eos_ids,
                max_new_tokens=plan.max_new_tokens, attention_impl=attention_impl)
  dtype = params["embed"].dtype
  programs_before = compiled_programs()

  start = time.perf_counter()
  state = prefill(params, tokens, lengths, live, row_caps,
                  init_cache(config, batch, cache_len, dtype, rules, per_layer=True),
                  jax.random.key(seed),
                  buckets=buckets, keep_hidden=spec is not None and spec.drafter is not None,
                  rules=rules, **static)
  row_ids = np.where(live, order, -1)
  harvest = _Harvest(len(prompts))
  trace, spec_on_at, steps_below, chunk_start_generated = [], None, 0, 0
  context_trace = []
  plain_steps = 0
  batch_buckets_used = [batch]
  strategy_chunks = collections.Counter()
  played = None   # (live rows, strategy, start time, programs) of the SD chunk in flight
  head, context_sizes = None, None
  windowed = windowed_attention(attention_impl, rules)
  while True:
    base = _base(state)
    done = np.asarray(base.done)
    live_rows = int((~done).sum())
    longest_live = int(np.asarray(base.cache.lengths)[~done].max(initial=0))
    generated = int(np.asarray(base.num_generated).sum())
    emitted = generated - chunk_start_generated     # by the last chunk
    now = time.perf_counter()
    trace.append((round(now - start, 4), live_rows))
    context_trace.append((round(now - start, 4), longest_live, emitted,
                          isinstance(state, speculative.SpecState)))
    if played is not None:
      played_rows, strategy, began, programs = played
      # A chunk that compiled a program measured the compiler, not the strategy.
      if compiled_programs() == programs and now > began:
        spec.bandit.record(played_rows, strategy, emitted / (now - began))
      played = None
    if live_rows == 0:
      harvest.take(state, row_ids, np.ones_like(done))
      if spec is not None and spec.pick_memory is not None and spec_on_at is not None:
        spec.pick_memory.keep(state.hybrid)
      break
    if compact and buckets.batch_bucket(live_rows) < done.shape[0]:
      harvest.take(state, row_ids, done)
      keep = np.flatnonzero(~done)
      filler = np.flatnonzero(done)[0]            # a finished row: stays finished
      rows = np.concatenate([keep, np.full(buckets.batch_bucket(live_rows) - len(keep), filler)])
      state = take_rows(state, jnp.asarray(rows, jnp.int32), rules)
      row_ids = np.where(np.arange(len(rows)) < len(keep), row_ids[rows], -1)
      batch_buckets_used.append(len(rows))
      generated = int(np.asarray(_base(state).num_generated).sum())
    if spec is not None and spec_on_at is None:
      if live_rows <= spec.threshold:
        steps_below += emitted // live_rows
      else:
        steps_below = 0
      if live_rows <= spec.threshold and steps_below >= spec.patience:
        spec_on_at = time.perf_counter() - start
        if spec.ngram_config is not None:
          texts = [list(p) + out for p, out in zip(prompts, harvest.so_far(state, row_ids))]
          pool = draft_pool(texts, groups, extras, row_ids, plan)
          context_sizes = pool.sizes
        if spec.drafter is None:
          state = speculative.start_model_free(state, pool, rules)
        else:
          head = rollout_draft_head(params, config, spec.vocab_ids)
          state = switch_to_speculation(params, config, spec, state, plan,
                                        drafter_prefill_len(longest_live, plan, buckets),
                                        attention_impl, rules)
          if spec.ngram_config is not None:
            state = speculative.add_model_free(state, pool, spec.pick_memory, rules)
    chunk_start_generated = generated
    speculating = isinstance(state, speculative.SpecState)
    window = chunk_window(longest_live, chunk_steps, spec if speculating else None, plan,
                          buckets, windowed)
    if speculating:
      strategy = spec.strategy if spec.bandit is None else spec.bandit.choose(live_rows)
      if spec.bandit is not None:
        # The timer starts once compaction and the drafter prefill are done, so a reward
        # measures only the chunk it is given to.
        jax.block_until_ready(state)
        played = (live_rows, strategy, time.perf_counter(), compiled_programs())
      state = speculative.spec_chunk(params, spec.drafter, head, spec.vocab_ids, state,
                                     strategy=strategy, chunk_steps=chunk_steps,
                                     window=window, ngram_config=spec.ngram_config,
                                     hybrid=spec.row_counts, kind=spec.kind_of(strategy),
                                     draft_temperature_ratio=spec.draft_temperature_ratio,
                                     rules=rules, **static)
      strategy_chunks[strategy.name] += 1
    else:
      state = decode.decode_chunk(params, state, chunk_steps=chunk_steps, window=window,
                                  rules=rules, **static)
      plain_steps += 1
  total_s = time.perf_counter() - start

  outputs = []
  for ids, logprobs in zip(harvest.tokens, harvest.logprobs):
    reason = "eos" if ids and ids[-1] in plan.eos_ids else "length"
    outputs.append(GenerationOutput(ids, logprobs, reason))
  generated = sum(len(o.token_ids) for o in outputs)
  stats = {
      "batch_bucket": batch, "prompt_length_bucket": prompt_len, "cache_length": cache_len,
      "generated_tokens": generated, "total_s": total_s,
      "tokens_per_s": generated / total_s if total_s > 0 else 0.0,
      "rollout/live_rows": trace,
      # Per chunk boundary: seconds, the longest live row, tokens the chunk that ended there
      # emitted, whether it was speculative: a chunk's cost by context length.
      "rollout/context": context_trace,
      "rollout/tail_s": tail_seconds(trace, len(prompts)),
      "rollout/batch_buckets": batch_buckets_used,
      "compile/programs": compiled_programs(),
      "compile/new_programs": compiled_programs() - programs_before,
      "decode_chunks/plain": plain_steps, "decode_chunks/spec": sum(strategy_chunks.values()),
  }
  if spec is not None:
    verify_steps, spec_tokens = int(harvest.spec_steps.sum()), int(harvest.spec_tokens.sum())
    accept_len = spec_tokens / verify_steps if verify_steps else 0.0
    accept_by_drafter, share_by_drafter = harvest.by_drafter(spec)
    stats.update({"spec/strategy": ",".join(s.name for s in spec.strategies),
                  "spec/drafter": spec.kind,
                  "spec/accept_len_by_drafter": accept_by_drafter,
                  # The share of verify steps each drafter kind drafted (won, in a hybrid).
                  "spec/verify_share_by_drafter": share_by_drafter,
                  "spec/context_sizes": context_sizes,
                  "spec/strategy_chunks": dict(strategy_chunks),
                  "spec/verify_steps": verify_steps,
                  "spec/accept_len": accept_len,
                  "spec/enabled_frac": spec_tokens / generated if generated else 0.0,
                  "spec/on_at_s": spec_on_at})
    if spec.bandit is not None:
      stats["spec/bandit"] = spec.bandit.summary()
  return GenerationResult(outputs, stats)

"""Rollout engine: bucketed batch generation with long-tail compaction and adaptive SD.

The host loop runs jitted chunks of decode steps and, between chunks, (1) compacts the
live rows into the next smaller batch bucket once they fit, so the long tail runs at its
true size rather than padded to the starting batch, (2) switches speculative decoding on
once at most `sd_threshold` rows have stayed live for `sd_patience` steps, and (3) with a
pool of strategies, lets the BEG-MAB bandit pick each SD chunk's strategy and scores it by
the chunk's tokens per second. Drafts come from a learned drafter or, model-free, from
each row's group text (`ngram.py`: its own, its siblings', the caller's `draft_context`).
Every program is keyed by (batch bucket, cache length, strategy; model-free also the draft
context's bucketed sizes): the set is finite, `Rollout.programs` lists it (the same
`Rollout` methods dispatch every program, for `generate` and for `precompile`, which
builds the whole list before a rollout starts), and `compiled_programs()` counts them.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.compiles import CompileCounter
from tlt_jax.errors import UserInputError
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.drafter import init_drafter_cache
from tlt_jax.models.kv_cache import KVCache, init_cache
from tlt_jax.models.transformer import Params
from tlt_jax.ops import ATTENTION_IMPLS, resolve_attention
from tlt_jax.rollout import decode, hybrid as hybrid_lib, ngram, speculative
from tlt_jax.rollout.admission import AdmissionQueue, first_wave
from tlt_jax.rollout.budget import kv_bytes_per_row
from tlt_jax.rollout.buckets import BucketSpec
from tlt_jax.rollout.drafting import DraftInputs
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.spec_config import SpecConfig, SpecMemory
from tlt_jax.rollout.strategy import SpecStrategy
from tlt_jax.rollout.weights import DraftWeights, place_rollout, rollout_draft_head
from tlt_jax.sharding.rules import MeshRules, spans_devices


@dataclasses.dataclass(frozen=True)
class GenerationOutput:
  token_ids: list[int]
  logprobs: list[float]
  finish_reason: str         # "eos" | "length"
  # With `capture_hidden`: the target's last-layer, post-final-norm hidden state (what
  # `lm_logits` reads, and what the drafter trainer's `target_hidden` computes) at every
  # position of prompt + response but the last, [prompt_len + len(token_ids) - 1, E], in
  # the dtype the rollout computed it in. Those are the positions the rollout ran through
  # the target; the last emitted token never is. Row p is the state that predicted token
  # p + 1. As drafter training data: the sample `(prompt + token_ids)[:-1]` with these
  # states as its `hidden` (`drafter.trainer.train_step`).
  hidden_states: np.ndarray | None = None


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


_PROGRAMS = (decode.prefill_rows, decode.admit_rows, decode.decode_chunk,
             speculative.start_speculation, speculative.spec_chunk, take_rows)
_COMPILES = CompileCounter(_PROGRAMS)


def compiled_programs() -> int:
  """Programs compiled so far by the engine's jitted entry points (process-wide)."""
  return _COMPILES.count


def program_totals() -> dict[str, int]:
  """The engine's programs so far, built and loaded from the persistent compilation cache
  (`CompileCounter.totals`)."""
  return _COMPILES.totals()


def _programs_made() -> int:
  return _COMPILES.count + _COMPILES.loaded


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

  def __init__(self, prompt_lengths: Sequence[int], capture_hidden: bool):
    num_prompts = len(prompt_lengths)
    self.prompt_lengths, self.capture_hidden = prompt_lengths, capture_hidden
    self.tokens: list = [None] * num_prompts
    self.logprobs: list = [None] * num_prompts
    self.hidden: list = [None] * num_prompts
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
    hybrid = (state.draft.stats if speculating
              and isinstance(state.draft, hybrid_lib.HybridState) else None)
    if hybrid is not None:
      kind_steps, kind_tokens = np.asarray(hybrid.steps), np.asarray(hybrid.tokens)
    # One transfer of the whole record per harvest, then each leaving row's positions.
    hidden = np.asarray(base.hidden_buf) if self.capture_hidden else None
    for row in np.flatnonzero(which):
      prompt = row_ids[row]
      if prompt >= 0 and self.tokens[prompt] is None:
        self.tokens[prompt] = out_tokens[row, :counts[row]].tolist()
        self.logprobs[prompt] = out_logprobs[row, :counts[row]].tolist()
        if hidden is not None:
          ran = self.prompt_lengths[prompt] + counts[row] - 1
          self.hidden[prompt] = hidden[row, :ran].copy()
        if speculating:
          self.spec_steps[prompt], self.spec_tokens[prompt] = spec_steps[row], spec_tokens[row]
        if hybrid is not None:
          self.kind_steps[prompt], self.kind_tokens[prompt] = kind_steps[row], kind_tokens[row]

  def by_drafter(self, spec: SpecConfig) -> tuple[dict[str, float], dict[str, float]]:
    """Per drafter kind: tokens per verify step it drafted, and its share of verify steps.
    With both sources the steps split by what drafted them, the learned drafter or the
    model-free chain (a hybrid step under its row's pick); one source drafts them all."""
    ratio = lambda a, b: float(a / b) if b else 0.0
    if not (spec.learned and spec.model_free):
      return ({spec.kinds: ratio(self.spec_tokens.sum(), self.spec_steps.sum())},
              {spec.kinds: 1.0})
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
  queued: int = 0              # prompts that wait for rows (a row budget's queue)

  @property
  def max_new_tokens(self) -> int:
    return max(self.caps)


def plan_rollout(prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                 config: ModelConfig, buckets: BucketSpec, spec: SpecConfig | None,
                 eos_ids: Sequence[int], min_row_tokens: int = 0,
                 group_ids: Sequence[int] | None = None) -> RolloutPlan:
  """Validates the prompts and caps, and derives the shapes every program is built for.
  min_row_tokens sizes the cache for rows of at least that many tokens: a run whose
  prompts vary in length then keeps one cache length, and so one set of programs.
  The largest batch bucket is the most rows the rollout holds (a row budget caps it:
  `BucketSpec.capped`); prompts beyond it queue (`admission`), groups of group_ids (default:
  equal prompts) kept together."""
  caps = _row_caps(prompts, max_new_tokens, config)
  prompt_len = buckets.prompt_length(max(len(p) for p in prompts))
  longest_row = max(min_row_tokens, *(len(p) + int(cap) for p, cap in zip(prompts, caps)))
  batch = buckets.batch_bucket(min(len(prompts), buckets.batch_buckets[-1]))
  wave, _ = first_wave(default_group_ids(prompts) if group_ids is None else group_ids, batch)
  tokens, lengths, _, _ = sorted_rows([prompts[i] for i in wave], batch, prompt_len)
  return RolloutPlan(caps=tuple(int(c) for c in caps), batch=batch, prompt_len=prompt_len,
                     cache_len=cache_length(longest_row, prompt_len, spec, buckets),
                     eos_ids=tuple(sorted(set(int(e) for e in eos_ids))),
                     prefill_prompts=tuple(len(picked) for _, _, picked, _
                                           in prefill_groups(tokens, lengths, buckets)),
                     queued=len(prompts) - len(wave))


def cache_length(longest_row: int, prompt_len: int, spec: SpecConfig | None,
                 buckets: BucketSpec) -> int:
  """Cache slots per row for rows of up to `longest_row` tokens (prompts padded to
  prompt_len), with the slots one speculative step of `spec` may write past a row."""
  margin = speculative.cache_margin(spec.strategies) if spec else 0
  return buckets.cache_length(max(prompt_len, longest_row + margin))


def default_group_ids(prompts: Sequence[Sequence[int]]) -> list[int]:
  """Each prompt's group when the caller names none: equal prompts form one."""
  ids: dict[tuple, int] = {}
  return [ids.setdefault(tuple(p), len(ids)) for p in prompts]


def sorted_rows(prompts: Sequence[Sequence[int]], batch: int, prompt_len: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """The prompts padded into rows (tokens, lengths, live; see `pad_prompts`) in prefill
  order, and that order: longest first, equal prompts adjacent (see `prefill`)."""
  tokens, lengths, live = pad_prompts(prompts, batch, prompt_len)
  order = np.lexsort((prompt_ids(tokens, lengths), -lengths))
  return tokens[order], lengths[order], live[order], order


def run_program(fn: Callable, args: tuple, kwargs: dict) -> Any:
  """Runs one of the rollout's programs (a `Rollout.runner`): calls it."""
  return fn(*args, **kwargs)


def prefill(params: Params, tokens: np.ndarray, lengths: np.ndarray, live: np.ndarray,
            caps: np.ndarray, cache: KVCache, key: jax.Array, *, buckets: BucketSpec,
            keep_hidden: bool, rules: MeshRules | None, config: ModelConfig,
            runner: Callable[[Callable, tuple, dict], Any] = run_program,
            **static) -> decode.DecodeState:
  """Prefills padded prompts whose rows are sorted longest first, group by group
  (`BucketSpec.prefill_groups`), each group padded only to its own longest prompt and
  running each distinct prompt once (`distinct_prompts`); `runner` runs each group's
  program (`Rollout.runner`)."""
  state = decode.empty_state(cache, jnp.asarray(caps), jnp.asarray(live), key,
                             max_new_tokens=static["max_new_tokens"], keep_hidden=keep_hidden,
                             hidden_size=config.hidden_size, rules=rules)
  for group, width, picked, sources in prefill_groups(tokens, lengths, buckets):
    state = runner(decode.prefill_rows,
                   (params, state, jnp.asarray(tokens[group][picked, :width]),
                    jnp.asarray(lengths[group][picked]), jnp.asarray(sources),
                    jnp.int32(group.start)), dict(config=config, rules=rules, **static))
  return state


def prefill_groups(tokens: np.ndarray, lengths: np.ndarray, buckets: BucketSpec):
  """The prefill groups of sorted, padded rows: (rows slice, padded width, the rows it runs
  and each row's index into them; see `distinct_prompts`) per group."""
  rows = buckets.prefill_group_rows(len(lengths))
  for start in range(0, len(lengths), rows):
    group = slice(start, start + rows)
    yield (group, buckets.prompt_length(int(lengths[group].max())),
           *distinct_prompts(tokens[group], lengths[group], buckets))


@dataclasses.dataclass(frozen=True)
class Admission:
  """One `decode.admit_rows` call: waiting prompts prefilled into freed batch rows."""
  tokens: np.ndarray     # [U, T] the distinct prompts, right-padded to the unit's longest
  lengths: np.ndarray    # [U]
  sources: np.ndarray    # [G] each row's prompt among them
  rows: np.ndarray       # [G] batch rows; the batch size pads (dropped)
  caps: np.ndarray       # [G] token budgets
  prompts: np.ndarray    # [G] prompt indices; -1 pads


def admissions(prompts: Sequence[Sequence[int]], admitted: Sequence[int], rows: np.ndarray,
               plan: RolloutPlan, buckets: BucketSpec):
  """The admitted prompts (by index) into free batch rows `rows`, sorted as a prefill sorts
  them (longest first, equal prompts adjacent) and cut into units of a prefill group's rows,
  each padded to its own longest prompt and running each distinct prompt once. A short
  last unit is padded with repeats of its first prompt bound for no row."""
  unit = buckets.prefill_group_rows(plan.batch)
  admitted = np.asarray(admitted)
  tokens, lengths, _ = pad_prompts([prompts[i] for i in admitted], len(admitted),
                                   plan.prompt_len)
  order = np.lexsort((prompt_ids(tokens, lengths), -lengths))
  for start in range(0, len(order), unit):
    part = order[start:start + unit]
    padded = np.concatenate([part, np.repeat(part[:1], unit - len(part))])
    picked, sources = distinct_prompts(tokens[padded], lengths[padded], buckets)
    width = buckets.prompt_length(int(lengths[padded].max()))
    pad = lambda x, fill: np.concatenate([x, np.full(unit - len(part), fill)]).astype(np.int32)
    yield Admission(tokens=tokens[padded][picked, :width], lengths=lengths[padded][picked],
                    sources=sources, rows=pad(rows[start:start + len(part)], plan.batch),
                    caps=np.asarray(plan.caps, np.int32)[admitted[padded]],
                    prompts=pad(admitted[part], -1))


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
  """`rollout/tail_s`: from the first chunk boundary with 90% of the rows done (at least
  all but one: under 10 rows, a tenth is less than a row) to the end of the rollout;
  trace: the (seconds, live rows) points of `rollout/live_rows`."""
  tail_rows = max(1, num_prompts - math.ceil(0.9 * num_prompts))
  started = next(t for t, live in trace if live <= tail_rows)
  return trace[-1][0] - started


def check_attention_impl(attention_impl: str) -> None:
  if attention_impl not in ATTENTION_IMPLS:
    raise UserInputError(f"--attention_impl={attention_impl!r}: expected one of "
                         f"{', '.join(ATTENTION_IMPLS)}")


def chunk_reach(longest_live: int, chunk_steps: int, spec: SpecConfig | None) -> int:
  """Cache slots a chunk can touch (the ones it may write included): with `spec`, a
  speculative chunk of any of its strategies, else a plain one."""
  if spec is None:
    return longest_live + chunk_steps
  return (longest_live + chunk_steps * speculative.pending_width(spec.strategies)
          + speculative.cache_margin(spec.strategies))


def windowed_attention(attention_impl: str, rules: MeshRules | None,
                       platform: str | None = None) -> bool:
  """Whether chunks attend over a window of the cache (copied out and back per chunk), on
  `platform` (None: this process's default backend). The CPU attention kernel reads only
  the slots a query sees, where a window only adds the copies (SmolLM2, batch 8: ~2 ms a
  step)."""
  return resolve_attention(attention_impl, platform, sharded=spans_devices(rules)) != "cpu"


def chunk_window(longest_live: int, chunk_steps: int, spec: SpecConfig | None,
                 plan: RolloutPlan, buckets: BucketSpec, windowed: bool) -> int | None:
  """The cache prefix a chunk attends over; None is the whole cache."""
  if not windowed:
    return None
  window = buckets.attention_window(chunk_reach(longest_live, chunk_steps, spec),
                                    plan.cache_len)
  return None if window == plan.cache_len else window


def switch_to_speculation(inputs: DraftInputs, config: ModelConfig,
                          strategies: tuple[SpecStrategy, ...], state: decode.DecodeState,
                          plan: RolloutPlan, prefill_len: int, keep_hidden: bool,
                          attention_impl: str, rules: MeshRules | None,
                          runner: Callable[[Callable, tuple, dict], Any] = run_program
                          ) -> speculative.SpecState:
  """A fresh drafter cache, prefilled over every live row's context (`state` is donated);
  prefill_len: `drafter_prefill_len`; keep_hidden: the state's record goes on into SD;
  `runner` runs the program (`Rollout.runner`)."""
  draft_cache = init_drafter_cache(config, state.done.shape[0], plan.cache_len,
                                   inputs.params["embed"].dtype, rules,
                                   per_layer=isinstance(inputs.weights.params["layers"], tuple))
  with warnings.catch_warnings():
    # Without keep_hidden, the kept tokens and hidden states are donated with the state and
    # dropped by design (speculation runs without them), so no output can reuse them: JAX's
    # warning about that is expected here. Donating them apart instead crashed XLA's CPU
    # compiler.
    warnings.filterwarnings("ignore", "Some donated buffers were not usable", UserWarning)
    return runner(speculative.start_speculation, (inputs, state, draft_cache),
                  dict(config=config, strategies=strategies, prefill_len=prefill_len,
                       keep_hidden=keep_hidden, attention_impl=attention_impl, rules=rules))


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
    group_ids = default_group_ids(prompts)
  elif len(group_ids) != n or not all(isinstance(g, (int, np.integer)) for g in group_ids):
    raise UserInputError(f"group_ids: expected {n} integers (one per prompt), got "
                         f"{len(group_ids)} items")
  if draft_context is None:
    return list(group_ids), [[] for _ in prompts]
  if spec is None or not spec.model_free:
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




@dataclasses.dataclass(frozen=True)
class Program:
  """One program a rollout can dispatch (`Rollout.programs`): what `precompile` builds and
  `generate` runs. size: a prefill's or admission's padded prompt width, a switch's
  drafter prefill length, a compaction's target batch."""
  kind: str       # "prefill", "admit", "compact", "decode", "switch", "spec_compact", "spec"
  batch: int
  window: int | None = None
  strategy: SpecStrategy | None = None
  size: int = 0
  distinct: int = 0   # an admission's distinct prompts


@dataclasses.dataclass
class Rollout:
  """One rollout's fixed parts (placed weights, plan, settings), and the one place each of
  its programs is dispatched from: `generate` and `precompile` both run these methods, and
  `programs` lists every program they can dispatch."""
  params: Params
  config: ModelConfig
  plan: RolloutPlan
  spec: SpecConfig | None
  drafter: DraftWeights | None
  sampling: SamplingParams
  buckets: BucketSpec
  chunk_steps: int
  attention_impl: str
  rules: MeshRules | None
  compact: bool
  # Keep the target's hidden state of every position run, through SD, for the outputs.
  capture_hidden: bool = False
  # The platform the programs are for, where the host lays them out (packed weights,
  # attention windows); None: this process's default backend. The kernels inside follow
  # the platform each program is lowered for (`ops.by_platform`).
  platform: str | None = None
  # Runs each program, given (jitted function, args, kwargs): `run_program` calls it;
  # `tlt_jax.rollout.lowering` traces it and lowers it for other platforms instead.
  runner: Callable[[Callable, tuple, dict], Any] = run_program
  dispatched: set = dataclasses.field(default_factory=set)

  @property
  def static(self) -> dict:
    return dict(config=self.config, sampling=self.sampling, eos_ids=self.plan.eos_ids,
                max_new_tokens=self.plan.max_new_tokens, attention_impl=self.attention_impl)

  @functools.cached_property
  def inputs(self) -> DraftInputs:
    """What the drafter reads; the draft head is made once the learned drafter runs."""
    head = None if self.drafter is None else rollout_draft_head(
        self.params, self.config, self.drafter.vocab_ids)
    return DraftInputs(self.params, self.drafter, head)

  @property
  def windowed(self) -> bool:
    return windowed_attention(self.attention_impl, self.rules, self.platform)

  @property
  def keep_hidden(self) -> bool:
    """Whether decode states record tokens and hidden states: for the outputs
    (capture_hidden), or for the learned drafter's prefill at the SD switch."""
    return self.capture_hidden or (self.spec is not None and self.spec.learned)

  def prefill(self, tokens, lengths, live, caps, key):
    """Every prompt prefilled into a fresh cache (`prefill`), its first token emitted."""
    for _, width, _, _ in prefill_groups(tokens, lengths, self.buckets):
      self.dispatched.add(Program("prefill", self.plan.batch, size=width))
    cache = init_cache(self.config, self.plan.batch, self.plan.cache_len,
                       self.params["embed"].dtype, self.rules, per_layer=True)
    return prefill(self.params, tokens, lengths, live, caps, cache, key,
                   buckets=self.buckets, keep_hidden=self.keep_hidden,
                   rules=self.rules, runner=self.runner, **self.static)

  def prefill_group(self, state, tokens, lengths, sources, row_start):
    """One prefill group's program (`decode.prefill_rows`), as `prefill` runs it."""
    return self.runner(decode.prefill_rows, (self.params, state, tokens, lengths, sources,
                                             row_start), dict(rules=self.rules, **self.static))

  def admit(self, state, unit: Admission):
    """Waiting prompts prefilled into finished rows (`decode.admit_rows`)."""
    self.dispatched.add(Program("admit", state.done.shape[0], size=unit.tokens.shape[1],
                                distinct=unit.tokens.shape[0]))
    return self.runner(decode.admit_rows, (self.params, state, *map(jnp.asarray, (
        unit.tokens, unit.lengths, unit.sources, unit.rows, unit.caps))),
                       dict(rules=self.rules, **self.static))

  def decode(self, state, window: int | None):
    self.dispatched.add(Program("decode", state.done.shape[0], window))
    return self.runner(decode.decode_chunk, (self.params, state),
                       dict(chunk_steps=self.chunk_steps, window=window, rules=self.rules,
                            **self.static))

  def take(self, state, rows: np.ndarray):
    kind = "spec_compact" if isinstance(state, speculative.SpecState) else "compact"
    self.dispatched.add(Program(kind, _base(state).done.shape[0], size=len(rows)))
    return self.runner(take_rows, (state, jnp.asarray(rows, jnp.int32)), dict(rules=self.rules))

  def switch(self, state, prefill_len: int, pool, picks: hybrid_lib.PickMemory | None):
    """Speculation from a decode state: the drafter prefilled over each row's context
    (learned), the model-free pool (model-free), or both."""
    batch = state.done.shape[0]
    self.dispatched.add(Program("switch", batch, size=prefill_len if self.spec.learned else 0))
    if not self.spec.learned:
      return self.runner(speculative.start_model_free, (state, pool), dict(rules=self.rules))
    state = switch_to_speculation(self.inputs, self.config, self.spec.strategies, state,
                                  self.plan, prefill_len, self.capture_hidden,
                                  self.attention_impl, self.rules, self.runner)
    if self.spec.model_free:
      state = self.runner(speculative.add_model_free, (state, pool),
                          dict(memory=picks, rules=self.rules))
    return state

  def speculate(self, state, strategy: SpecStrategy, window: int | None):
    self.dispatched.add(Program("spec", state.base.done.shape[0], window, strategy))
    drafter = self.spec.drafter(strategy, self.config, self.attention_impl, self.rules)
    return self.runner(speculative.spec_chunk, (self.params, self.inputs, state),
                       dict(drafter=drafter, strategy=strategy, chunk_steps=self.chunk_steps,
                            window=window, rules=self.rules, **self.static))

  def programs(self) -> list[Program]:
    """Every program this rollout can dispatch, in an order `precompile` can build them:
    the prefill at any group's padding, compaction to any smaller batch bucket, decode
    chunks at every batch and attention window; with SD, in the batches up to the
    threshold's, the switch at every drafter prefill length, and every strategy's chunk."""
    plan, buckets, spec = self.plan, self.buckets, self.spec
    batches = [b for b in buckets.batch_buckets if b <= plan.batch] if self.compact else [
        plan.batch]
    out = [Program("prefill", plan.batch, size=w)
           for w in buckets.prompt_lengths(plan.prompt_len)]
    out += self.admissions()
    pairs = lambda kind, sizes: [Program(kind, b, size=s) for b in sorted(sizes, reverse=True)
                                 for s in sizes if s < b]
    out += pairs("compact", batches)
    out += [Program("decode", b, w) for b in batches for w in self.windows(None)]
    if spec is None:
      return out
    spec_batches = [b for b in batches if not self.compact
                    or b <= buckets.batch_bucket(min(spec.threshold, plan.batch))]
    lengths = buckets.attention_windows(1, plan.cache_len) if spec.learned else [0]
    out += [Program("switch", b, size=n) for b in spec_batches for n in lengths]
    out += pairs("spec_compact", spec_batches)
    return out + [Program("spec", b, w, s) for b in spec_batches for w in self.windows(spec)
                  for s in spec.strategies]

  def admissions(self) -> list[Program]:
    """With prompts queued: an admission unit at any padded width and count of distinct
    prompts (a power of two up to the unit's rows, or all of them)."""
    if not self.plan.queued:
      return []
    unit = self.buckets.prefill_group_rows(self.plan.batch)
    counts = sorted({self.buckets.distinct_prompts(n, unit) for n in range(1, unit + 1)})
    return [Program("admit", self.plan.batch, size=w, distinct=u)
            for w in self.buckets.prompt_lengths(self.plan.prompt_len) for u in counts]

  def windows(self, spec: SpecConfig | None) -> list[int | None]:
    """Every attention window a chunk (speculative with `spec`) can take."""
    if not self.windowed:
      return [None]
    return [None if w == self.plan.cache_len else w for w in self.buckets.attention_windows(
        chunk_reach(1, self.chunk_steps, spec), self.plan.cache_len)]


def prepare_rollout(params: Params, config: ModelConfig, prompts: Sequence[Sequence[int]], *,
                    max_new_tokens: int | Sequence[int], spec: SpecConfig | None,
                    drafter: DraftWeights | None, eos_ids: Sequence[int],
                    group_ids: Sequence[int] | None,
                    draft_context: Sequence[Sequence[int]] | None, rules: MeshRules | None,
                    attention_impl: str, buckets: BucketSpec, min_row_tokens: int,
                    platform: str | None = None, max_rows: int | None = None,
                    **settings) -> tuple[Rollout, list[int], list[list[int]]]:
  """Checks a rollout's arguments, places its weights and plans it: the `Rollout`, and the
  model-free drafter's groups and extra draft text (`draft_groups`), which are also the
  groups a row budget (max_rows) admits together. platform: the one its programs are for
  (`Rollout.platform`)."""
  check_attention_impl(attention_impl)
  if spec is not None:
    spec.check_weights(drafter)
  elif drafter is not None:
    raise UserInputError("drafter weights given without a SpecConfig (speculation is off)")
  buckets = buckets.capped(max_rows)
  groups, extras = draft_groups(prompts, group_ids, draft_context, spec, config.vocab_size)
  plan = plan_rollout(prompts, max_new_tokens, config, buckets, spec, eos_ids, min_row_tokens,
                      groups)
  params, drafter = place_rollout(params, config, drafter, rules, platform)
  return Rollout(params, config, plan, spec, drafter, buckets=buckets, rules=rules,
                 attention_impl=attention_impl, platform=platform, **settings), groups, extras


class _Loop:
  """The host side of one `generate` call between chunks: what rows are live, when to
  compact and switch SD on, which strategy plays, and the outputs and stats so far."""

  def __init__(self, rollout: Rollout, prompts, groups, extras, row_ids: np.ndarray,
               memory: SpecMemory | None, queue: AdmissionQueue):
    self.rollout, self.prompts, self.groups, self.extras = rollout, prompts, groups, extras
    self.row_ids, self.memory, self.queue = row_ids, memory, queue
    self.harvest = _Harvest([len(p) for p in prompts], rollout.capture_hidden)
    self.start = time.perf_counter()
    self.trace, self.context_trace, self.buckets_used = [], [], [rollout.plan.batch]
    self.queued_trace, self.waves = [], 0     # prompts waiting per trace point; admissions
    self.spec_on_at, self.steps_below, self.chunk_start, self.plain_chunks = None, 0, 0, 0
    self.strategy_chunks, self.played, self.context_sizes = collections.Counter(), None, None
    self.generated = self.emitted = 0   # tokens so far, and by the last chunk

  def observe(self, state) -> tuple[int, int]:
    """A chunk boundary: the live rows and the longest live row's length; traces them and
    scores the SD chunk that just ended for the bandit."""
    base = _base(state)
    live_rows, longest_live = self.trace_rows(base)
    self.emitted = self.generated - self.chunk_start     # by the last chunk
    now = time.perf_counter()
    self.context_trace.append((round(now - self.start, 4), longest_live, self.emitted,
                               isinstance(state, speculative.SpecState)))
    if self.played is not None:
      played_rows, strategy, began, programs = self.played
      # A chunk that compiled (or loaded) a program measured that, not the strategy.
      if _programs_made() == programs and now > began:
        self.memory.bandit.record(played_rows, strategy, self.emitted / (now - began))
      self.played = None
    return live_rows, longest_live

  def trace_rows(self, base: decode.DecodeState) -> tuple[int, int]:
    """The live rows and the longest live row's length, traced with the prompts waiting
    (`rollout/live_rows`, `rollout/queued`); the tokens generated so far updated."""
    done = np.asarray(base.done)
    live_rows = int((~done).sum())
    self.generated = int(np.asarray(base.num_generated).sum())
    seconds = round(time.perf_counter() - self.start, 4)
    self.trace.append((seconds, live_rows))
    self.queued_trace.append((seconds, self.queue.waiting))
    return live_rows, int(np.asarray(base.cache.lengths)[~done].max(initial=0))

  def admit(self, state, view: tuple[int, int]):
    """Continuous admission: the finished rows harvested and refilled with waiting prompts
    (`admission.AdmissionQueue.take`), the new view of the rows returned with the state."""
    done = np.asarray(state.done)
    free = np.flatnonzero(done)
    admitted = self.queue.take(len(free))
    if not admitted:
      return state, view
    self.harvest.take(state, self.row_ids, done)
    self.row_ids = np.where(done, -1, self.row_ids)
    for unit in admissions(self.prompts, admitted, free[:len(admitted)], self.rollout.plan,
                           self.rollout.buckets):
      state = self.rollout.admit(state, unit)
      filled = unit.prompts >= 0
      self.row_ids[unit.rows[filled]] = unit.prompts[filled]
    self.waves += 1
    return state, self.trace_rows(state)

  def compact(self, state, live_rows: int):
    """The live rows gathered into the smallest batch bucket that holds them."""
    rollout = self.rollout
    done = np.asarray(_base(state).done)
    if not rollout.compact or rollout.buckets.batch_bucket(live_rows) >= done.shape[0]:
      return state
    self.harvest.take(state, self.row_ids, done)
    keep = np.flatnonzero(~done)
    filler = np.flatnonzero(done)[0]            # a finished row: stays finished
    rows = np.concatenate([keep, np.full(rollout.buckets.batch_bucket(live_rows) - len(keep),
                                         filler)])
    state = rollout.take(state, rows)
    self.row_ids = np.where(np.arange(len(rows)) < len(keep), self.row_ids[rows], -1)
    self.buckets_used.append(len(rows))
    self.generated = int(np.asarray(_base(state).num_generated).sum())
    return state

  def maybe_switch(self, state, live_rows: int, longest_live: int):
    """Speculation on once at most `threshold` rows have stayed live for `patience` steps."""
    spec, rollout = self.rollout.spec, self.rollout
    if spec is None or self.spec_on_at is not None:
      return state
    self.steps_below = self.steps_below + self.emitted // live_rows if (
        live_rows <= spec.threshold) else 0
    if live_rows > spec.threshold or self.steps_below < spec.patience:
      return state
    self.spec_on_at = time.perf_counter() - self.start
    pool = None
    if spec.model_free:
      texts = [list(p) + out for p, out in
               zip(self.prompts, self.harvest.so_far(state, self.row_ids))]
      pool = draft_pool(texts, self.groups, self.extras, self.row_ids, rollout.plan)
      self.context_sizes = pool.sizes
    prefill_len = drafter_prefill_len(longest_live, rollout.plan, rollout.buckets)
    return rollout.switch(state, prefill_len if spec.learned else 0, pool, self.memory.picks)

  def chunk(self, state, live_rows: int, longest_live: int):
    """One chunk: speculative once SD is on (the bandit's strategy), else plain decoding."""
    rollout, spec = self.rollout, self.rollout.spec
    self.chunk_start = self.generated
    if not isinstance(state, speculative.SpecState):
      self.plain_chunks += 1
      return rollout.decode(state, chunk_window(longest_live, rollout.chunk_steps, None,
                                                rollout.plan, rollout.buckets, rollout.windowed))
    bandit = self.memory.bandit
    strategy = spec.strategy if bandit is None else bandit.choose(live_rows)
    if bandit is not None:
      # The timer starts once compaction and the drafter prefill are done, so a reward
      # measures only the chunk it is given to.
      jax.block_until_ready(state)
      self.played = (live_rows, strategy, time.perf_counter(), _programs_made())
    self.strategy_chunks[strategy.name] += 1
    return rollout.speculate(state, strategy, chunk_window(
        longest_live, rollout.chunk_steps, spec, rollout.plan, rollout.buckets,
        rollout.windowed))

  def finish(self, state) -> None:
    """The last rows harvested; the hybrid's batch counts kept for the next rollout."""
    self.harvest.take(state, self.row_ids, np.ones(self.row_ids.shape, bool))
    if (self.memory is not None and self.memory.picks is not None
        and self.spec_on_at is not None):
      self.memory.picks.keep(state.draft.stats)
    self.total_s = time.perf_counter() - self.start


def generate(params: Params, config: ModelConfig, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int | Sequence[int], sampling: SamplingParams = SamplingParams(),
             eos_ids: Sequence[int] = (), seed: int = 0, buckets: BucketSpec = BucketSpec(),
             chunk_steps: int = 16, rules: MeshRules | None = None,
             spec: SpecConfig | None = None, drafter: DraftWeights | None = None,
             memory: SpecMemory | None = None, compact: bool = True,
             attention_impl: str = "auto", min_row_tokens: int = 0,
             group_ids: Sequence[int] | None = None,
             draft_context: Sequence[Sequence[int]] | None = None,
             capture_hidden: bool = False, max_rows: int | None = None) -> GenerationResult:
  """Generates up to `max_new_tokens` tokens for each prompt (lists of token ids); a
  sequence gives each prompt its own cap; outputs come back in prompt order.

  max_rows: the most rows the rollout holds at once (its KV cache's batch); prompts beyond
  it wait and are prefilled into rows that finish, whole groups (group_ids) at a time,
  and compaction and SD start once none wait. Greedy outputs are the same for any
  max_rows; sampled ones are drawn from the same distributions (other random draws).

  spec: speculative decoding for the tail; drafter: the learned drafter's weights, when a
  strategy drafts with it; memory: what SD learned in earlier rollouts (the caller keeps
  it; None: learn afresh). Model-free drafting reads each row's group: the rows of equal
  group_ids (default: of equal prompts), their text so far and the extra token list
  draft_context[i] of each of its prompts (say an earlier epoch's response to it).
  attention_impl: "auto" (Pallas kernel on GPU, jnp elsewhere), "reference", "pallas"
  (interpreted off-GPU: slow, for checking) or "triton". rules: the rollout replica's mesh
  and sharding rules (`weights.place_rollout`); None runs on the default device.
  capture_hidden: each output also carries the target's hidden states of its sequence
  (`GenerationOutput.hidden_states`), kept from the passes the rollout runs anyway (plain
  decode steps and SD verify passes), with no extra forward; its programs are their own
  (the decode state carries the record), so a rollout without it pays nothing.
  """
  rollout, groups, extras = prepare_rollout(
      params, config, prompts, max_new_tokens=max_new_tokens, spec=spec, drafter=drafter,
      eos_ids=eos_ids, group_ids=group_ids, draft_context=draft_context, rules=rules,
      attention_impl=attention_impl, buckets=buckets, min_row_tokens=min_row_tokens,
      sampling=sampling, chunk_steps=chunk_steps, compact=compact,
      capture_hidden=capture_hidden, max_rows=max_rows)
  plan = rollout.plan
  wave, queue = first_wave(groups, plan.batch)
  tokens, lengths, live, order = sorted_rows([prompts[i] for i in wave], plan.batch,
                                             plan.prompt_len)
  caps = np.ones((plan.batch,), np.int32)
  caps[:len(wave)] = np.asarray(plan.caps)[wave]
  wave = np.asarray(wave + [-1] * (plan.batch - len(wave)))
  memory = memory or (SpecMemory(spec) if spec is not None else None)
  programs_before = program_totals()
  loop = _Loop(rollout, prompts, groups, extras, np.where(live, wave[order], -1), memory,
               queue)
  state = rollout.prefill(tokens, lengths, live, caps[order], jax.random.key(seed))
  # While prompts wait, finished rows are refilled at every chunk boundary; compaction and
  # SD only start once the queue is empty: they are for the tail.
  while (view := loop.observe(state))[0] or queue.waiting:
    if queue.waiting:
      state, view = loop.admit(state, view)
    else:
      state = loop.compact(state, view[0])
      state = loop.maybe_switch(state, *view)
    state = loop.chunk(state, *view)
  loop.finish(state)
  return GenerationResult(_outputs(loop.harvest, plan), _stats(loop, programs_before))


def _outputs(harvest: _Harvest, plan: RolloutPlan) -> list[GenerationOutput]:
  return [GenerationOutput(ids, logprobs, "eos" if ids and ids[-1] in plan.eos_ids
                           else "length", hidden)
          for ids, logprobs, hidden in zip(harvest.tokens, harvest.logprobs, harvest.hidden)]


def _stats(loop: _Loop, programs_before: dict[str, int]) -> dict:
  rollout, harvest, plan = loop.rollout, loop.harvest, loop.rollout.plan
  generated = sum(len(ids) for ids in harvest.tokens)
  total_s = loop.total_s
  stats = {
      "batch_bucket": plan.batch, "prompt_length_bucket": plan.prompt_len,
      "cache_length": plan.cache_len, "generated_tokens": generated, "total_s": total_s,
      "tokens_per_s": generated / total_s if total_s > 0 else 0.0,
      "rollout/live_rows": loop.trace,
      # Per chunk boundary: seconds, the longest live row, tokens the chunk that ended there
      # emitted, whether it was speculative: a chunk's cost by context length.
      "rollout/context": loop.context_trace,
      "rollout/tail_s": tail_seconds([(t, live + queued) for (t, live), (_, queued)
                                      in zip(loop.trace, loop.queued_trace)],
                                     len(loop.prompts)),
      "rollout/batch_buckets": loop.buckets_used,
      # The row budget: rows held at most, the queue over time, refills, the target's cache.
      "rollout/max_rows": plan.batch,
      "rollout/peak_rows": max(live for _, live in loop.trace),
      "rollout/queued": loop.queued_trace,
      "rollout/admission_waves": loop.waves,
      "rollout/kv_cache_bytes": plan.batch * kv_bytes_per_row(
          rollout.config, plan.cache_len, rollout.params["embed"].dtype),
      "compile/programs": compiled_programs(),
      "compile/new_programs": compiled_programs() - programs_before["programs"],
      "compile/cache_hits": program_totals()["cache_hits"] - programs_before["cache_hits"],
      # Programs run that `Rollout.programs` does not list (so `precompile` would miss).
      "compile/unlisted": sorted(map(str, rollout.dispatched - set(rollout.programs()))),
      "decode_chunks/plain": loop.plain_chunks,
      "decode_chunks/spec": sum(loop.strategy_chunks.values()),
  }
  spec = rollout.spec
  if spec is None:
    return stats
  verify_steps, spec_tokens = int(harvest.spec_steps.sum()), int(harvest.spec_tokens.sum())
  accept_by_drafter, share_by_drafter = harvest.by_drafter(spec)
  stats.update({"spec/strategy": ",".join(s.name for s in spec.strategies),
                "spec/drafter": spec.kinds,
                "spec/accept_len_by_drafter": accept_by_drafter,
                # The share of verify steps each drafter kind drafted (won, in a hybrid).
                "spec/verify_share_by_drafter": share_by_drafter,
                "spec/context_sizes": loop.context_sizes,
                "spec/strategy_chunks": dict(loop.strategy_chunks),
                "spec/verify_steps": verify_steps,
                "spec/accept_len": spec_tokens / verify_steps if verify_steps else 0.0,
                "spec/enabled_frac": spec_tokens / generated if generated else 0.0,
                "spec/on_at_s": loop.spec_on_at})
  if loop.memory.bandit is not None:
    stats["spec/bandit"] = loop.memory.bandit.summary()
  return stats

"""Plain decoding programs: a jitted prefill and jitted multi-step decode chunks.

Prompts of different lengths are right-padded; each cache row keeps its own committed
length, so rows never wait on each other's padding. A decode chunk runs up to
`chunk_steps` tokens per dispatch inside one `lax.while_loop` (exits early once all rows
are done), and the state is donated so the cache is updated in place.
"""
from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.kv_cache import KVCache
from tlt_jax.models.transformer import Params, forward, forward_new_kv, lm_logits
from tlt_jax.rollout.ngram import DraftContext
from tlt_jax.rollout.sampling import SamplingParams, policy_logprob_of, sample
from tlt_jax.sharding.rules import MeshRules, constrain


@flax.struct.dataclass
class DecodeState:
  cache: KVCache
  last_tokens: jax.Array     # [B] int32: last emitted token, the next step's input
  num_generated: jax.Array   # [B] int32
  done: jax.Array            # [B] bool
  caps: jax.Array            # [B] int32: each row's token budget (<= max_new_tokens)
  out_tokens: jax.Array      # [B, max_new_tokens] int32
  out_logprobs: jax.Array    # [B, max_new_tokens] float32
  key: jax.Array
  # Optional per-position record of committed tokens [B, S] and target hidden states
  # [B, S, E]: what a drafter prefill (SD switched on mid-run) and drafter training need.
  history: jax.Array | None = None
  hidden_buf: jax.Array | None = None

  def record(self, positions: jax.Array, tokens: jax.Array, hidden: jax.Array,
             rows: jax.Array | None = None) -> "DecodeState":
    """Stores tokens [R, T] and their hidden states [R, T, E] at positions [R, T] of `rows`
    [R] (default: every row)."""
    if self.history is None:
      return self
    rows = (jnp.arange(tokens.shape[0]) if rows is None else rows)[:, None]
    return self.replace(
        history=self.history.at[rows, positions].set(tokens, mode="drop"),
        hidden_buf=self.hidden_buf.at[rows, positions].set(
            hidden.astype(self.hidden_buf.dtype), mode="drop"))


def lay_out(state, rules: MeshRules | None):
  """A decode or speculative state laid out one way on the replica's mesh: caches by
  CACHE_AXES, a model-free draft context by its own rules, per-row arrays over the batch,
  the RNG key replicated. Every program ends with it (and `empty_state` starts with it):
  left to GSPMD, an output's layout varies from program to program, and each new input
  layout compiles the next program again."""
  def put(x):
    if isinstance(x, (KVCache, DraftContext)):
      return x.laid_out(rules)
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      return constrain(x, (None,) * x.ndim, rules)
    return constrain(x, ("batch",) + (None,) * (x.ndim - 1), rules)
  return jax.tree.map(put, state, is_leaf=lambda x: isinstance(x, (KVCache, DraftContext)))


def _is_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
  if not eos_ids:
    return jnp.zeros(tokens.shape, bool)
  return jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32))


def emit(state: DecodeState, tokens, logprobs, live, eos_ids, max_new_tokens) -> DecodeState:
  """Appends one token to every live row and updates done flags."""
  rows = jnp.arange(tokens.shape[0])
  slot = jnp.where(live, state.num_generated, max_new_tokens)  # out of range -> dropped
  num_generated = state.num_generated + live
  done = state.done | (live & (_is_eos(tokens, eos_ids) | (num_generated >= state.caps)))
  return state.replace(
      last_tokens=jnp.where(live, tokens, state.last_tokens),
      num_generated=num_generated,
      done=done,
      out_tokens=state.out_tokens.at[rows, slot].set(tokens, mode="drop"),
      out_logprobs=state.out_logprobs.at[rows, slot].set(logprobs, mode="drop"))


def sample_and_score(key, logits, sampling):
  tokens = sample(key, logits, sampling)
  return tokens, policy_logprob_of(logits, tokens, sampling)


def empty_state(cache: KVCache, caps: jax.Array, live: jax.Array, key: jax.Array, *,
                max_new_tokens: int, keep_hidden: bool, hidden_size: int,
                rules: MeshRules | None = None) -> DecodeState:
  """The state before prefill: an empty `cache`, nothing emitted, dead rows (live=False)
  already done; keep_hidden adds the token/hidden-state record a drafter needs."""
  b, max_len = cache.batch_size, cache.max_len
  return lay_out(DecodeState(
      cache=cache,
      last_tokens=jnp.zeros((b,), jnp.int32),
      num_generated=jnp.zeros((b,), jnp.int32),
      done=~live,
      caps=caps.astype(jnp.int32),
      out_tokens=jnp.zeros((b, max_new_tokens), jnp.int32),
      out_logprobs=jnp.zeros((b, max_new_tokens), jnp.float32),
      key=key,
      history=jnp.zeros((b, max_len), jnp.int32) if keep_hidden else None,
      hidden_buf=(jnp.zeros((b, max_len, hidden_size), cache.dtype) if keep_hidden
                  else None)), rules)


# Prompt positions a prefill runs per pass. In one pass, a prompt of 8k tokens scored a
# [heads, 8k, 8k] float32 block per layer (1 GiB for 4 heads): memory quadratic in the
# prompt. In passes of this many positions, each against the prompt's own cache (masked past
# what earlier passes wrote), it is linear: benchmarks/long_context.py's 8k child (rollouts,
# then a 2-row 8k-token prefill, tiny model) peaked at 4.2 GB RSS before, 1.4 GB after.
PREFILL_CHUNK = 1024


def _prefill_in_chunks(params: Params, config: ModelConfig, tokens: jax.Array,
                       positions: jax.Array, cache: KVCache, chunk: int,
                       rules: MeshRules | None, attention_impl: str
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`forward_new_kv` of prompts [U, T] attending to themselves alone (not to any empty,
  masked slot of the batch's cache: that took a third of a 16-row, 192-token prefill with a
  1024-slot cache on CPU), in passes of `chunk` positions. A `lax.scan`, so one pass's
  temporaries are live at a time (unrolled, XLA kept them all: quadratic again); each pass
  scores the whole [U, T] prompt cache, masked past the slots the passes before it wrote.
  cache: the batch's cache, for its form and dtype."""
  u, t = tokens.shape
  if t <= chunk:
    return forward_new_kv(params, config, tokens, positions, cache.without_slots(u), None,
                          rules, attention_impl)
  padded = -(-t // chunk) * chunk
  pad = lambda x: jnp.pad(x, ((0, 0), (0, padded - t)))   # padding sees only what precedes it
  tokens, positions = pad(tokens), pad(positions)

  def one_pass(prompt_cache, start):
    take = lambda x: jax.lax.dynamic_slice_in_dim(x, start, chunk, axis=1)
    hidden, new_k, new_v = forward_new_kv(
        params, config, take(tokens), take(positions),
        prompt_cache.replace(lengths=jnp.full((u,), start, jnp.int32)), None, rules,
        attention_impl)
    return prompt_cache.write_prefix(new_k, new_v, slot_start=start), (hidden, new_k, new_v)

  _, (hidden, new_k, new_v) = jax.lax.scan(one_pass, cache.empty_like(u, padded),
                                           jnp.arange(0, padded, chunk))
  # [passes, U, chunk, E] and [passes, L, U, chunk, K, D] -> one prompt of T positions.
  hidden = hidden.transpose(1, 0, 2, 3).reshape(u, padded, -1)[:, :t]
  joined = lambda new: jnp.moveaxis(new, 0, 2).reshape(
      new.shape[1:3] + (padded,) + new.shape[4:])[:, :, :t]
  return hidden, joined(new_k), joined(new_v)


_PREFILL_STATIC = ("config", "sampling", "eos_ids", "max_new_tokens", "rules", "attention_impl",
                   "prefill_chunk")


@functools.partial(jax.jit, static_argnames=_PREFILL_STATIC, donate_argnames=("state",))
def prefill_rows(params: Params, state: DecodeState, tokens: jax.Array, lengths: jax.Array,
                 sources: jax.Array, row_start: jax.Array, *, config: ModelConfig,
                 sampling: SamplingParams, eos_ids: tuple[int, ...], max_new_tokens: int,
                 rules: MeshRules | None = None, attention_impl: str = "auto",
                 prefill_chunk: int = PREFILL_CHUNK) -> DecodeState:
  """Prefills cache rows row_start..+G, which are empty, and emits their first tokens (rows
  already done emit nothing). Row i holds prompt `sources[i]` of the right-padded, distinct
  prompts `tokens` [U, T] (true lengths [U]): the U prompts run once and their K/V are
  copied to every row that shares them, as a GRPO group's rows do. First tokens are drawn
  per row.

  A batch is prefilled in groups of rows of similar prompt length, each padded only to its
  own longest prompt; one program per (U, G, T) serves every group of that shape.
  prefill_chunk: prompt positions per pass (`PREFILL_CHUNK`)."""
  rows = row_start + jnp.arange(sources.shape[0])

  def write(cache: KVCache, new_k, new_v, row_lengths):
    return cache.write_prefix(new_k, new_v, row_start, sources).replace(
        lengths=jax.lax.dynamic_update_slice(cache.lengths, row_lengths, (row_start,)))
  return _prefill_into(params, state, tokens, lengths, sources, rows, write, config=config,
                       sampling=sampling, eos_ids=eos_ids, max_new_tokens=max_new_tokens,
                       rules=rules, attention_impl=attention_impl, prefill_chunk=prefill_chunk)


@functools.partial(jax.jit, static_argnames=_PREFILL_STATIC, donate_argnames=("state",))
def admit_rows(params: Params, state: DecodeState, tokens: jax.Array, lengths: jax.Array,
               sources: jax.Array, rows: jax.Array, caps: jax.Array, *, config: ModelConfig,
               sampling: SamplingParams, eos_ids: tuple[int, ...], max_new_tokens: int,
               rules: MeshRules | None = None, attention_impl: str = "auto",
               prefill_chunk: int = PREFILL_CHUNK) -> DecodeState:
  """Continuous admission: prefills waiting prompts into batch rows `rows` [G] of a running
  batch, rows whose earlier prompts have finished (and been harvested), and emits their
  first tokens. Each row starts afresh (nothing emitted, its own cap caps[i]) with prompt
  sources[i] of the distinct prompts `tokens` [U, T], as in `prefill_rows`; entries of
  `rows` past the batch pad it to a fixed G and are dropped. The rest of the batch is left
  as it is, so it decodes on in the next chunk beside the new rows. One program per
  (batch, G, U, T), like JetStream's insert."""
  fresh = lambda x, value: x.at[rows].set(value, mode="drop")
  state = state.replace(num_generated=fresh(state.num_generated, 0),
                        done=fresh(state.done, False), caps=fresh(state.caps, caps))

  def write(cache: KVCache, new_k, new_v, row_lengths):
    return cache.write_rows(new_k, new_v, rows, sources).replace(
        lengths=fresh(cache.lengths, row_lengths))
  return _prefill_into(params, state, tokens, lengths, sources, rows, write, config=config,
                       sampling=sampling, eos_ids=eos_ids, max_new_tokens=max_new_tokens,
                       rules=rules, attention_impl=attention_impl, prefill_chunk=prefill_chunk)


def _prefill_into(params: Params, state: DecodeState, tokens: jax.Array, lengths: jax.Array,
                  sources: jax.Array, rows: jax.Array, write, *, config: ModelConfig,
                  sampling: SamplingParams, eos_ids: tuple[int, ...], max_new_tokens: int,
                  rules: MeshRules | None, attention_impl: str,
                  prefill_chunk: int) -> DecodeState:
  """The prefill both programs share: the U distinct prompts run once (in passes of
  prefill_chunk positions), `write(cache, new_k, new_v, lengths [G])` puts row i's K/V
  (prompt sources[i]) and length into batch row rows[i], and every live row of `rows`
  emits its first token."""
  u, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (u, t))
  hidden, new_k, new_v = _prefill_in_chunks(params, config, tokens, positions, state.cache,
                                            prefill_chunk, rules, attention_impl)
  tokens, positions, hidden, lengths = (x[sources] for x in (tokens, positions, hidden, lengths))
  cache = write(state.cache, new_k, new_v, lengths.astype(jnp.int32))
  last_hidden = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
  key, sub = jax.random.split(state.key)
  first, first_logprob = sample_and_score(sub, lm_logits(params, config, last_hidden, rules),
                                           sampling)
  state = state.replace(cache=cache, key=key).record(positions, tokens, hidden, rows)
  in_group = jnp.zeros(state.done.shape, bool).at[rows].set(True, mode="drop")
  return lay_out(emit(state, state.last_tokens.at[rows].set(first, mode="drop"),
                      jnp.zeros(state.done.shape, jnp.float32).at[rows].set(
                          first_logprob, mode="drop"),
                      in_group & ~state.done, eos_ids, max_new_tokens), rules)


@functools.partial(jax.jit, static_argnames=("config", "sampling", "eos_ids", "max_new_tokens",
                                             "chunk_steps", "window", "rules",
                                             "attention_impl"),
                   donate_argnames=("state",))
def decode_chunk(params: Params, state: DecodeState, *, config: ModelConfig,
                 sampling: SamplingParams, eos_ids: tuple[int, ...], max_new_tokens: int,
                 chunk_steps: int, window: int | None = None, rules: MeshRules | None = None,
                 attention_impl: str = "auto") -> DecodeState:
  """Up to `chunk_steps` single-token decode steps; stops early when all rows are done.

  window: attend over only the first `window` cache slots (the caller guarantees every
  live row stays within them for the whole chunk); None is the whole cache.
  """
  full_cache = state.cache
  if window is not None:
    state = state.replace(cache=full_cache.window(window))

  def step(carry):
    i, s = carry
    hidden, cache = forward(params, config, s.last_tokens[:, None], s.cache.lengths[:, None],
                            s.cache, None, rules, attention_impl)
    key, sub = jax.random.split(s.key)
    tokens, logprobs = sample_and_score(sub, lm_logits(params, config, hidden[:, 0], rules),
                                         sampling)
    live = ~s.done
    s = s.record(s.cache.lengths[:, None], s.last_tokens[:, None], hidden)
    s = s.replace(cache=cache.advance(live), key=key)  # the input token is now committed
    return i + 1, emit(s, tokens, logprobs, live, eos_ids, max_new_tokens)

  def cond(carry):
    i, s = carry
    return (i < chunk_steps) & ~jnp.all(s.done)

  state = jax.lax.while_loop(cond, step, (jnp.int32(0), state))[1]
  if window is not None:
    state = state.replace(cache=full_cache.put_window(state.cache))
  return lay_out(state, rules)

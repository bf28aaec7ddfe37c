"""Batched generation: a jitted prefill, then jitted decode chunks until every row is done.

Prompts of different lengths are right-padded; each cache row keeps its own committed
length, so rows never wait on each other's padding. The decode loop runs `chunk_steps`
tokens per dispatch inside one `lax.while_loop` (exits early once all rows are done), and
the state is donated so the cache is updated in place.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.errors import UserInputError
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.kv_cache import KVCache, init_cache
from tlt_jax.models.transformer import Params, forward, lm_logits
from tlt_jax.rollout.buckets import BucketSpec
from tlt_jax.rollout.sampling import SamplingParams, policy_logprobs, sample
from tlt_jax.sharding.rules import MeshRules


@flax.struct.dataclass
class DecodeState:
  cache: KVCache
  last_tokens: jax.Array     # [B] int32: last emitted token, the next step's input
  num_generated: jax.Array   # [B] int32
  done: jax.Array            # [B] bool
  out_tokens: jax.Array      # [B, max_new_tokens] int32
  out_logprobs: jax.Array    # [B, max_new_tokens] float32
  key: jax.Array


@dataclasses.dataclass(frozen=True)
class GenerationOutput:
  token_ids: list[int]
  logprobs: list[float]
  finish_reason: str         # "eos" | "length"


@dataclasses.dataclass(frozen=True)
class GenerationResult:
  outputs: list[GenerationOutput]
  stats: dict


def _is_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
  if not eos_ids:
    return jnp.zeros(tokens.shape, bool)
  return jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32))


def _emit(state: DecodeState, tokens, logprobs, live, eos_ids, max_new_tokens) -> DecodeState:
  """Appends one token to every live row and updates done flags."""
  rows = jnp.arange(tokens.shape[0])
  slot = jnp.where(live, state.num_generated, max_new_tokens)  # out of range -> dropped
  num_generated = state.num_generated + live
  done = state.done | (live & (_is_eos(tokens, eos_ids) | (num_generated >= max_new_tokens)))
  return state.replace(
      last_tokens=jnp.where(live, tokens, state.last_tokens),
      num_generated=num_generated,
      done=done,
      out_tokens=state.out_tokens.at[rows, slot].set(tokens, mode="drop"),
      out_logprobs=state.out_logprobs.at[rows, slot].set(logprobs, mode="drop"))


def _sample_and_score(key, logits, sampling):
  tokens = sample(key, logits, sampling)
  logprobs = jnp.take_along_axis(policy_logprobs(logits, sampling), tokens[:, None], axis=-1)
  return tokens, logprobs[:, 0]


@functools.partial(jax.jit, static_argnames=("config", "sampling", "eos_ids", "max_new_tokens",
                                             "rules"), donate_argnames=("cache",))
def prefill(params: Params, tokens: jax.Array, lengths: jax.Array, live: jax.Array,
            cache: KVCache, key: jax.Array, *, config: ModelConfig, sampling: SamplingParams,
            eos_ids: tuple[int, ...], max_new_tokens: int,
            rules: MeshRules | None = None) -> DecodeState:
  """Runs right-padded prompts [B, T] (true lengths [B]) and emits the first token."""
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  hidden, cache = forward(params, config, tokens, positions, cache, None, rules)
  last_hidden = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
  key, sub = jax.random.split(key)
  first, first_logprob = _sample_and_score(sub, lm_logits(params, config, last_hidden, rules),
                                           sampling)
  state = DecodeState(
      cache=cache.replace(lengths=lengths.astype(jnp.int32)),
      last_tokens=first,
      num_generated=jnp.zeros((b,), jnp.int32),
      done=~live,
      out_tokens=jnp.zeros((b, max_new_tokens), jnp.int32),
      out_logprobs=jnp.zeros((b, max_new_tokens), jnp.float32),
      key=key)
  return _emit(state, first, first_logprob, live, eos_ids, max_new_tokens)


@functools.partial(jax.jit, static_argnames=("config", "sampling", "eos_ids", "max_new_tokens",
                                             "chunk_steps", "rules"), donate_argnames=("state",))
def decode_chunk(params: Params, state: DecodeState, *, config: ModelConfig,
                 sampling: SamplingParams, eos_ids: tuple[int, ...], max_new_tokens: int,
                 chunk_steps: int, rules: MeshRules | None = None) -> DecodeState:
  """Up to `chunk_steps` single-token decode steps; stops early when all rows are done."""

  def step(carry):
    i, s = carry
    hidden, cache = forward(params, config, s.last_tokens[:, None], s.cache.lengths[:, None],
                            s.cache, None, rules)
    key, sub = jax.random.split(s.key)
    tokens, logprobs = _sample_and_score(sub, lm_logits(params, config, hidden[:, 0], rules),
                                         sampling)
    live = ~s.done
    s = s.replace(cache=cache.advance(live), key=key)  # the input token is now committed
    return i + 1, _emit(s, tokens, logprobs, live, eos_ids, max_new_tokens)

  def cond(carry):
    i, s = carry
    return (i < chunk_steps) & ~jnp.all(s.done)

  return jax.lax.while_loop(cond, step, (jnp.int32(0), state))[1]


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


def generate(params: Params, config: ModelConfig, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
             eos_ids: Sequence[int] = (), seed: int = 0, buckets: BucketSpec = BucketSpec(),
             chunk_steps: int = 16, rules: MeshRules | None = None,
             cache_dtype=None) -> GenerationResult:
  """Generates up to `max_new_tokens` tokens for each prompt (lists of token ids)."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise UserInputError("prompts: need at least one prompt, and every prompt non-empty")
  if max_new_tokens < 1:
    raise UserInputError(f"--max_new_tokens={max_new_tokens}: must be >= 1")
  longest = max(len(p) for p in prompts)
  if longest + max_new_tokens > config.max_position_embeddings:
    raise UserInputError(
        f"prompt length {longest} + max_new_tokens {max_new_tokens} exceeds the model's "
        f"max_position_embeddings {config.max_position_embeddings}")
  batch = buckets.batch_bucket(len(prompts))
  prompt_len = buckets.prompt_length(longest)
  cache_len = buckets.cache_length(max(prompt_len, longest + max_new_tokens))
  tokens, lengths, live = pad_prompts(prompts, batch, prompt_len)
  eos = tuple(sorted(set(int(e) for e in eos_ids)))
  static = dict(config=config, sampling=sampling, eos_ids=eos, max_new_tokens=max_new_tokens,
                rules=rules)
  cache_dtype = cache_dtype or params["embed"].dtype
  cache = init_cache(config, batch, cache_len, cache_dtype)

  start = time.perf_counter()
  state = prefill(params, jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(live), cache,
                  jax.random.key(seed), **static)
  state.done.block_until_ready()
  prefill_s = time.perf_counter() - start
  live_trace = [(0.0, int(live.sum()))]
  while True:
    done = np.asarray(state.done)
    live_trace.append((time.perf_counter() - start, int((~done).sum())))
    if done.all():
      break
    state = decode_chunk(params, state, chunk_steps=chunk_steps, **static)
  total_s = time.perf_counter() - start

  out_tokens, out_logprobs = np.asarray(state.out_tokens), np.asarray(state.out_logprobs)
  counts = np.asarray(state.num_generated)
  outputs = []
  for i in range(len(prompts)):
    ids = out_tokens[i, :counts[i]].tolist()
    reason = "eos" if ids and ids[-1] in eos else "length"
    outputs.append(GenerationOutput(ids, out_logprobs[i, :counts[i]].tolist(), reason))
  generated = int(counts[:len(prompts)].sum())
  stats = {
      "batch_bucket": batch, "prompt_length_bucket": prompt_len, "cache_length": cache_len,
      "generated_tokens": generated, "prefill_s": prefill_s, "total_s": total_s,
      "decode_s": total_s - prefill_s,
      "tokens_per_s": generated / total_s if total_s > 0 else 0.0,
      "rollout/live_rows": live_trace,
  }
  return GenerationResult(outputs, stats)

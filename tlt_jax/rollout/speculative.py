"""Lossless speculative decoding: each step proposes a draft tree, verifies it in one
target pass, accepts a path and commits it (`spec_step`).

Greedy: a drafted child is accepted iff its token is the target's argmax at its parent
(the target-only rule), so the output is bit-identical to plain greedy decoding; the bonus
token is the argmax at the deepest accepted node. Sampling: the verified tree is walked by
recursive rejection sampling (`acceptance.recursive_rejection`) against the drafter's q
(point masses for model-free drafts), so each emitted token is distributed exactly as plain
sampling from the processed target p. Emitted log-probs come from the verify pass.

The draft comes from a `drafting.Drafter` (learned, model-free or hybrid), whose state is
`SpecState.draft` and whose weights are an argument (`DraftInputs`). Between steps the
target cache holds committed tokens and the pending token x_L (emitted, not yet run) is
`base.last_tokens`.

With the base state's per-position record kept (`start_speculation(keep_hidden=True)`),
each step also records the verify pass's hidden states of the nodes it commits: the root
(the pending token) and the accepted drafts, at the positions those tokens take in the
sequence, so a rollout hands back the target's hidden state of every token it ran.
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.kv_cache import KVCache
from tlt_jax.models.transformer import Params, forward_new_kv, lm_logits
from tlt_jax.rollout import hybrid as hybrid_lib
from tlt_jax.rollout import ngram
from tlt_jax.rollout.acceptance import recursive_rejection
from tlt_jax.rollout.decode import DecodeState, emit, lay_out
from tlt_jax.rollout.drafting import Draft, DraftInputs, Drafter, Verified, VerifyTree
from tlt_jax.rollout.learned_drafter import pending_width, prefilled_state
from tlt_jax.rollout.sampling import (SamplingParams, argmax, policy_logprob_of,
                                      processed_logprobs)
from tlt_jax.rollout.strategy import SpecStrategy
from tlt_jax.sharding.rules import MeshRules


@flax.struct.dataclass
class SpecState:
  base: DecodeState
  # The drafter's state: `learned_drafter.LearnedState`, an `ngram.DraftContext` (model-free)
  # or a `hybrid.HybridState` (both).
  draft: Any
  spec_steps: jax.Array      # [B] verify steps taken while live
  spec_tokens: jax.Array     # [B] tokens emitted by those steps


def cache_margin(strategies: Sequence[SpecStrategy]) -> int:
  """Slots past the committed length that one step may write (target and drafter), for
  any of `strategies`: the drafter catches up on the pending pairs, then grows its tree."""
  width = pending_width(strategies)
  return max(max(s.verify_tokens, s.num_nodes + width) for s in strategies)


@functools.partial(jax.jit, static_argnames=("config", "strategies", "prefill_len",
                                             "keep_hidden", "attention_impl", "rules"),
                   donate_argnames=("base", "draft_cache"))
def start_speculation(inputs: DraftInputs, base: DecodeState, draft_cache: KVCache, *,
                      config: ModelConfig, strategies: tuple[SpecStrategy, ...],
                      prefill_len: int, keep_hidden: bool = False,
                      attention_impl: str = "auto", rules: MeshRules | None = None
                      ) -> SpecState:
  """Drafter prefill over each row's existing context (slots 0..L-2), leaving the pair
  (h_{L-1}, x_L) pending. strategies: those the rollout may switch between. prefill_len:
  slots prefilled, at least the longest live row's L (a bucket of it, so few programs
  serve every switch); slots past it stay empty, which only finished rows can reach
  (nothing they draft is emitted). keep_hidden: the base state's record of tokens and
  hidden states goes on into speculation (the rollout captures hidden states); without it
  the record has served its one purpose here, and speculation runs without it."""
  draft = prefilled_state(inputs, base, draft_cache, config=config, strategies=strategies,
                          prefill_len=prefill_len, attention_impl=attention_impl, rules=rules)
  zeros = jnp.zeros(base.done.shape, jnp.int32)
  if not keep_hidden:
    base = base.replace(history=None, hidden_buf=None)
  return lay_out(SpecState(base=base, draft=draft, spec_steps=zeros, spec_tokens=zeros), rules)


def start_model_free(base: DecodeState, context: ngram.DraftContext,
                     rules: MeshRules | None = None) -> SpecState:
  """Model-free speculation from a decode state: no drafter state, no prefill; `context`
  holds every row's text so far (`ngram.build_context`)."""
  zeros = lambda: jnp.zeros(base.done.shape, jnp.int32)   # two buffers: both are donated
  return lay_out(SpecState(base=base, draft=context, spec_steps=zeros(), spec_tokens=zeros()),
                 rules)


def add_model_free(state: SpecState, context: ngram.DraftContext,
                   memory: hybrid_lib.PickMemory | None = None,
                   rules: MeshRules | None = None) -> SpecState:
  """A learned drafter's state (`start_speculation`) that also drafts model-free from
  `context`: hybrid steps, or a pool of learned and model-free strategies."""
  return lay_out(state.replace(draft=hybrid_lib.start_state(state.draft, context, memory)),
                 rules)


class _Accepted(flax.struct.PyTreeNode):
  num_accepted: jax.Array    # [B] drafts accepted
  path: jax.Array            # [B, depth + 1] verify index of each emitted token's node
  emitted: jax.Array         # [B, depth + 1]
  logprobs: jax.Array        # [B, depth + 1] the emitted tokens' policy log-probs
  tries: jax.Array | None
  accepts: jax.Array | None


def _accept(key, logits: jax.Array, draft: Draft, strategy: SpecStrategy,
            sampling: SamplingParams, draft_vocab: jax.Array | None) -> _Accepted:
  """The path the target accepts through the verified tree, by the greedy rule or by
  recursive rejection sampling, with its emitted tokens and their log-probs."""
  tree = draft.tree
  if sampling.greedy:
    num_accepted, path, emitted = _accept_greedy(logits, tree.tokens, tree.parents,
                                                 tree.depths, strategy.depth)
    tries = accepts = drawn_logprobs = None
  else:
    drawn_logprobs = processed_logprobs(logits, sampling)
    num_accepted, path, emitted, tries, accepts = recursive_rejection(
        key, drawn_logprobs, tree.draft_probs, tree.tokens, tree.parents, strategy.depth,
        strategy.topk, draft.point_mass, draft_vocab=draft_vocab)
  logprobs = _emitted_logprobs(logits, drawn_logprobs, path, emitted, sampling)
  return _Accepted(num_accepted, path, emitted, logprobs, tries, accepts)


def _commit(base: DecodeState, key, accepted: _Accepted, new_k, new_v, eos_ids,
            max_new_tokens: int) -> DecodeState:
  """The accepted path's K/V into the target cache and its tokens into the outputs."""
  live = ~base.done
  path = accepted.path
  # Only the path's K/V enter the cache, in consecutive slots (the rest of the tree is
  # never committed), so no verified token's K/V has to move within the cache.
  take_path = lambda new: jnp.take_along_axis(new, path[None, :, :, None, None], axis=2)
  cache = base.cache.write_after_committed(take_path(new_k), take_path(new_v))
  base = base.replace(key=key,
                      cache=cache.advance(jnp.where(live, accepted.num_accepted + 1, 0)))
  in_path = jnp.arange(path.shape[1])[None, :] <= accepted.num_accepted[:, None]
  for j in range(path.shape[1]):
    base = emit(base, accepted.emitted[:, j], accepted.logprobs[:, j],
                ~base.done & in_path[:, j] & live, eos_ids, max_new_tokens)
  return base


def _record_path(committed: DecodeState, lengths: jax.Array, tokens: jax.Array,
                 hidden: jax.Array, path: jax.Array, new_tokens: jax.Array) -> DecodeState:
  """Records (when the state keeps a record) the tokens [B, V] and hidden states [B, V, E]
  of the path's first `new_tokens` nodes at positions lengths + depth: the root (the
  pending token, at the committed length) and the accepted drafts. Each emitted token
  then has the state that predicted it recorded (the bonus token runs next step); a row
  that emitted nothing (finished) records nothing."""
  if committed.history is None:
    return committed
  depth = jnp.arange(path.shape[1])[None, :]
  positions = jnp.where(depth < new_tokens[:, None], lengths[:, None] + depth,
                        committed.history.shape[1])             # out of range: dropped
  return committed.record(positions, jnp.take_along_axis(tokens, path, axis=1),
                          jnp.take_along_axis(hidden, path[:, :, None], axis=1))


def spec_step(params: Params, inputs: DraftInputs, state: SpecState, *, drafter: Drafter,
              config: ModelConfig, strategy: SpecStrategy, sampling: SamplingParams,
              eos_ids: tuple[int, ...], max_new_tokens: int, attention_impl: str = "auto",
              rules: MeshRules | None = None) -> SpecState:
  """Propose a tree, verify it in one target pass, accept a path, commit it plus a bonus."""
  base = state.base
  live = ~base.done
  key, draft_key, accept_key = jax.random.split(base.key, 3)
  draft_state, draft = drafter.propose(draft_key, inputs, state.draft, base, strategy,
                                       sampling)
  tree = draft.tree
  hidden, new_k, new_v = forward_new_kv(params, config, tree.tokens,
                                        base.cache.lengths[:, None] + tree.depths, base.cache,
                                        tree.mask, rules, attention_impl)
  logits = lm_logits(params, config, hidden, rules)                    # [B, V, vocab]
  draft_vocab = None if inputs.weights is None else inputs.weights.vocab_ids
  accepted = _accept(accept_key, logits, draft, strategy, sampling, draft_vocab)
  committed = _commit(base, key, accepted, new_k, new_v, eos_ids, max_new_tokens)
  new_tokens = committed.num_generated - base.num_generated
  committed = _record_path(committed, base.cache.lengths, tree.tokens, hidden, accepted.path,
                           new_tokens)
  draft_state = drafter.commit(draft_state, strategy, Verified(
      hidden=hidden, path=accepted.path, emitted=accepted.emitted,
      num_accepted=accepted.num_accepted, new_tokens=new_tokens, live=live,
      tries=accepted.tries, accepts=accepted.accepts, draft=draft))
  return SpecState(base=committed, draft=draft_state, spec_steps=state.spec_steps + live,
                   spec_tokens=state.spec_tokens + new_tokens)


@functools.partial(jax.jit, static_argnames=("drafter", "config", "strategy", "sampling",
                                             "eos_ids", "max_new_tokens", "chunk_steps",
                                             "window", "attention_impl", "rules"),
                   donate_argnames=("state",))
def spec_chunk(params: Params, inputs: DraftInputs, state: SpecState, *, drafter: Drafter,
               config: ModelConfig, strategy: SpecStrategy, sampling: SamplingParams,
               eos_ids: tuple[int, ...], max_new_tokens: int, chunk_steps: int,
               window: int | None = None, attention_impl: str = "auto",
               rules: MeshRules | None = None) -> SpecState:
  """Up to `chunk_steps` speculative steps in one program; stops when all rows are done.

  inputs.head: `draft_head(params, config, vocab_ids)`, made by the caller outside the
  chunk (`weights.rollout_draft_head` reuses it from rollout to rollout).
  window: both caches are cut to their first `window` slots for the chunk (the caller
  guarantees every write of the chunk lands inside); None is the whole cache.
  """
  full = state
  if window is not None:
    state = _map_caches(state, lambda cache: cache.window(window))

  def step(step_drafter: Drafter, carry):
    i, s = carry
    return i + 1, spec_step(params, inputs, s, drafter=step_drafter, config=config,
                            strategy=strategy, sampling=sampling, eos_ids=eos_ids,
                            max_new_tokens=max_new_tokens, attention_impl=attention_impl,
                            rules=rules)

  def more(carry):
    i, s = carry
    return (i < chunk_steps) & ~jnp.all(s.base.done)

  body = drafter.chunk_body(step, more, strategy)
  state = jax.lax.while_loop(more, body, (jnp.int32(0), state))[1]
  if window is not None:
    caches = iter(_caches(full))
    state = _map_caches(state, lambda cache: next(caches).put_window(cache))
  return lay_out(state, rules)


def _caches(state: SpecState) -> list[KVCache]:
  return [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, KVCache))
          if isinstance(x, KVCache)]


def _map_caches(state: SpecState, fn) -> SpecState:
  """`fn` over the state's KV caches (the target's, and the learned drafter's if any)."""
  return jax.tree.map(lambda x: fn(x) if isinstance(x, KVCache) else x, state,
                      is_leaf=lambda x: isinstance(x, KVCache))


def _accept_greedy(logits, tokens, parents, node_depth, depth):
  """A node is accepted iff its token is the target's argmax at its parent.

  Returns (drafted tokens accepted [B], verify index of the path node at each depth
  [B, depth+1], emitted tokens y_1..y_n + bonus [B, depth+1])."""
  choice = argmax(logits)                                              # [B, V]
  matches = tokens == jnp.take_along_axis(choice, parents, axis=1)
  accepted = jnp.zeros_like(matches).at[:, 0].set(True)
  for _ in range(depth):
    accepted = accepted.at[:, 1:].set((jnp.take_along_axis(accepted, parents, axis=1)
                                       & matches)[:, 1:])
  num_accepted = jnp.max(jnp.where(accepted, node_depth, 0), axis=1)
  on_level = accepted[:, None, :] & (
      node_depth[:, None, :] == jnp.arange(depth + 1)[None, :, None])
  path = jnp.argmax(on_level, axis=-1)
  return num_accepted, path, jnp.take_along_axis(choice, path, axis=1)


def _emitted_logprobs(logits: jax.Array, drawn_logprobs: jax.Array | None, path: jax.Array,
                      emitted: jax.Array, sampling: SamplingParams) -> jax.Array:
  """[B, depth + 1]: each emitted token's log-prob under the policy (`policy_logprob_of`)
  at the node it was drawn at (`path`). Sampling that truncates nothing draws from the
  policy itself, so its log-probs (`drawn_logprobs`, [B, V, vocab]) are read there;
  otherwise every node's is taken at the token drawn there, which reads the logits once and
  copies no row of them."""
  rows = jnp.arange(path.shape[0])[:, None]
  if drawn_logprobs is not None and not sampling.truncates(logits.shape[-1]):
    return drawn_logprobs[rows, path, emitted]
  # The path repeats the node where it ended, where every repeat emitted the same token.
  node_tokens = jnp.zeros(logits.shape[:2], jnp.int32).at[rows, path].set(emitted)
  return jnp.take_along_axis(policy_logprob_of(logits, node_tokens, sampling), path, axis=1)

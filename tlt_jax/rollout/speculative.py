"""Lossless speculative decoding: EAGLE drafter tree + one target verify pass per step.

Greedy: the drafter expands its top-k children per node, and a drafted child is accepted
iff its token is the target's argmax at its parent (the target-only rule), so the output
is bit-identical to plain greedy decoding. The bonus token is the argmax at the deepest
accepted node.

Sampling: each node's children are drawn without replacement (Gumbel top-k) from the
drafter's q, processed like p (trees: at `draft_temperature_ratio` times its temperature),
and the verified tree is walked by recursive rejection sampling
(`acceptance.recursive_rejection`), so each emitted token is distributed exactly
as plain sampling from the processed target p. Compared with accepting a top-k child only
when it equals the target's own draw, this accepts with min(1, p/q) per tried child: on
SmolLM2 at T=1 with 4 children, 0.69 of first levels instead of 0.57 (measured with a
warmed-up drafter). Which drafts a sampled tree keeps may not depend on their drawn values
(see `_propose`), so under sampling the tree's shape is fixed before the step's draws:
by each row's acceptance rates so far per level and draw rank (`_rank_scores`).

Model-free (`ngram.py`): a chain of the tokens that followed the row's longest suffix match
in its group's text, verified by the same pass and the same rules (greedy: the target
argmax; sampling: recursive rejection of point masses). Every draft source gives a
`VerifyTree`, the one layout the verify pass and acceptance read.

State between steps (per row): the target cache holds committed tokens; the pending token
x_L (emitted, not yet run) is `base.last_tokens`; the drafter cache holds slots 0..L-2 and
the pairs it still has to consume are `pend_*` (the accepted path with its true target
hidden states), so the drafter always conditions on real target features. Model-free
speculation has no drafter state (those fields are None) and a `context` instead.

Hybrid (`hybrid.py`): both, and per row and step the learned tree or the model-free chain
(`_hybrid_tree`), picked from earlier steps' outcomes by a small per-row bandit. Both
drafts have one verify shape (chain strategies), so a pick compiles nothing.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Sequence

import flax.struct
import jax
import jax.numpy as jnp

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.drafter import (DrafterParams, draft_logits, drafter_forward,
                                   drafter_forward_new_kv)
from tlt_jax.models.kv_cache import KVCache
from tlt_jax.models.transformer import Params, forward_new_kv, lm_logits
from tlt_jax.rollout.decode import DecodeState, emit, lay_out
from tlt_jax.rollout import hybrid as hybrid_lib
from tlt_jax.rollout import ngram
from tlt_jax.rollout.acceptance import recursive_rejection
from tlt_jax.rollout.sampling import (SamplingParams, argmax, policy_logprob_of,
                                      processed_logprobs)
from tlt_jax.rollout.strategy import SpecStrategy
from tlt_jax.sharding.rules import MeshRules

# Ranks a node just below an equal-scoring ancestor, so a top-n selection is ancestor-closed.
_DEPTH_TIEBREAK = 1e-3


@flax.struct.dataclass
class SpecState:
  base: DecodeState
  # draft_cache and pend_*: the learned drafter's state, None when drafting is model-free.
  draft_cache: KVCache | None
  pend_tokens: jax.Array | None     # [B, pend_width]: max depth over the strategies + 1
  pend_hidden: jax.Array | None     # [B, pend_width, E]
  pend_count: jax.Array | None      # [B]
  spec_steps: jax.Array      # [B] verify steps taken while live
  spec_tokens: jax.Array     # [B] tokens emitted by those steps
  # Sampled trees only: how often the walk tried / accepted a child, by its level and draw
  # rank, prior pseudo-counts included (see `_rank_scores`). One [B, depth, topk] count per
  # strategy (by name): chains and trees of other depths and draw temperatures accept at
  # their own rates, so pooled counts would fit every tree to a mixture.
  rank_tries: dict[str, jax.Array]
  rank_accepts: dict[str, jax.Array]
  context: ngram.DraftContext | None = None   # model-free drafting's token pool
  # With both sources (hybrid, or a pool mixing kinds): each row's steps and tokens by
  # drafter kind, which the hybrid's per-row pick reads.
  hybrid: hybrid_lib.HybridStats | None = None


class VerifyTree(NamedTuple):
  """What one verify pass checks, from any draft source: verify index 0 is the root (the
  pending token), parents precede children, siblings in the order acceptance tries them."""
  tokens: jax.Array        # [B, V]
  depths: jax.Array        # [B, V]: 0 for the root
  parents: jax.Array       # [B, V]: verify index of each node's parent (the root's: 0)
  mask: jax.Array          # [B, V, V]: node i attends to node j (its ancestors and itself)
  draft_probs: jax.Array | None   # [B, V, Vd]: q each node's children were drawn from, on
                                  # the drafter's vocabulary; None: point masses (and
                                  # greedy, which reads no q)


def pending_width(strategies: Sequence[SpecStrategy]) -> int:
  """Width of the pending (accepted, not yet drafted-on) pairs: the most any of the
  strategies a rollout may switch between can accept in one step, plus the bonus."""
  return max(s.depth for s in strategies) + 1


# Before any verify step, every draw is taken to be accepted half the times it is tried,
# with the weight of two tries: a geometric prior the row's own counts soon outweigh.
_PRIOR_TRIES, _PRIOR_ACCEPTS = 2.0, 1.0


def cache_margin(strategies: Sequence[SpecStrategy]) -> int:
  """Slots past the committed length that one step may write (target and drafter), for
  any of `strategies`: the drafter catches up on the pending pairs, then grows its tree."""
  width = pending_width(strategies)
  return max(max(s.verify_tokens, s.num_nodes + width) for s in strategies)


@functools.partial(jax.jit, static_argnames=("config", "strategies", "prefill_len",
                                             "attention_impl", "rules"),
                   donate_argnames=("base", "draft_cache"))
def start_speculation(params: Params, drafter: DrafterParams, base: DecodeState,
                      draft_cache: KVCache, *, config: ModelConfig,
                      strategies: tuple[SpecStrategy, ...], prefill_len: int,
                      attention_impl: str = "auto", rules: MeshRules | None = None
                      ) -> SpecState:
  """Drafter prefill over each row's existing context (slots 0..L-2), leaving the pair
  (h_{L-1}, x_L) pending. strategies: those the rollout may switch between. prefill_len:
  slots prefilled, at least the longest live row's L (a bucket of it, so few programs
  serve every switch); slots past it stay empty, which only finished rows can reach
  (nothing they draft is emitted)."""
  pend_width = pending_width(strategies)
  lengths = base.cache.lengths
  b = base.history.shape[0]
  tokens = jnp.concatenate([base.history[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
  positions = jnp.broadcast_to(jnp.arange(prefill_len, dtype=jnp.int32), (b, prefill_len))
  # Only the live context runs, against no cache slots: every position of the cache, scored
  # against every empty drafter slot as well, made the prefill quadratic in the cache length
  # whatever the rows' own lengths. Only the new K/V are kept, and the drafter's one layer
  # computes them from its input projection alone: XLA drops the attention, so the switch
  # is linear in the context (at 8k, 0.002 of a target prefill of the same rows; see
  # benchmarks/long_context.py).
  _, new_k, new_v = drafter_forward_new_kv(
      drafter, params, config, tokens[:, :prefill_len], base.hidden_buf[:, :prefill_len],
      positions, draft_cache.without_slots(b), attention_impl=attention_impl, rules=rules)
  draft_cache = draft_cache.write_prefix(new_k, new_v)
  rows = jnp.arange(b)
  pend_tokens = jnp.zeros((b, pend_width), jnp.int32).at[:, 0].set(base.last_tokens)
  pend_hidden = jnp.zeros((b, pend_width, config.hidden_size), base.hidden_buf.dtype)
  pend_hidden = pend_hidden.at[:, 0].set(base.hidden_buf[rows, lengths - 1])
  zeros = jnp.zeros((b,), jnp.int32)
  counts = lambda prior: {s.name: jnp.full((b, s.depth, s.topk), prior) for s in strategies}
  # The kept tokens and hidden states have served their one purpose (this drafter prefill).
  # Recording them on in the SD loop costs a copy of loop state per step (~10 ms of a 36 ms
  # depth-1 step on CPU, measured), so speculation runs without them.
  base = base.replace(history=None, hidden_buf=None)
  return lay_out(SpecState(base=base, draft_cache=draft_cache.replace(lengths=lengths - 1),
                   pend_tokens=pend_tokens, pend_hidden=pend_hidden,
                   pend_count=jnp.ones((b,), jnp.int32), spec_steps=zeros, spec_tokens=zeros,
                   rank_tries=counts(_PRIOR_TRIES), rank_accepts=counts(_PRIOR_ACCEPTS)),
                 rules)


def start_model_free(base: DecodeState, context: ngram.DraftContext,
                     rules: MeshRules | None = None) -> SpecState:
  """Model-free speculation from a decode state: no drafter state, no prefill; `context`
  holds every row's text so far (`ngram.build_context`)."""
  zeros = lambda: jnp.zeros(base.done.shape, jnp.int32)   # two buffers: both are donated
  return lay_out(SpecState(base=base, draft_cache=None, pend_tokens=None, pend_hidden=None,
                           pend_count=None, spec_steps=zeros(), spec_tokens=zeros(),
                           rank_tries={}, rank_accepts={}, context=context), rules)


def add_model_free(state: SpecState, context: ngram.DraftContext,
                   memory: hybrid_lib.PickMemory | None = None,
                   rules: MeshRules | None = None) -> SpecState:
  """A learned drafter's state (`start_speculation`) that also drafts model-free from
  `context`: hybrid steps, or a pool of learned and model-free strategies. Per-row counts
  by drafter kind feed the hybrid's pick (from `memory`'s batch counts) and the stats."""
  stats = hybrid_lib.init_stats(state.base.done.shape[0], memory)
  return lay_out(state.replace(context=context, hybrid=stats), rules)


def _rank_scores(tries: jax.Array, accepts: jax.Array) -> jax.Array:
  """Log-probability that the walk accepts a node's rank-r draw, given that it reached the
  node, from each row's counts [B, levels, ranks]: log(a_r * prod_{j<r} (1 - a_j)), a_r
  the rank's acceptance rate once the draws before it were rejected. A node's summed
  scores then estimate the log-probability that the walk reaches it, so the top-n trees
  maximize the expected accepted length (the tree of Sequoia, Chen et al. 2024), fitted to
  each row's own acceptance so far. Forced to fall strictly along the ranks (see
  `_propose`)."""
  rate = jnp.clip(accepts / tries, 1e-3, 1.0 - 1e-3)
  rejected_before = jnp.cumsum(jnp.log1p(-rate), axis=-1) - jnp.log1p(-rate)
  scores = jax.lax.cummin(jnp.log(rate) + rejected_before, axis=rate.ndim - 1)
  return scores - 1e-4 * jnp.arange(rate.shape[-1])


def _propose(key, logits, k, sampling, rank_scores):
  """Draft k candidates per row of logits [B, ..., Vd]: (score of each, index, q or None).

  Greedy: the top k by log q. Sampling: k draws from the processed q without replacement,
  in draw order (the order recursive rejection tries them), scored by `rank_scores`
  [B, >= k] (from `_rank_scores`).

  Recursive rejection is exact only if the children it tries at a node are that node's
  first draws, however those draws came out. Keeping some drafts by their drawn values (say
  their q) would condition them on those values, and the emitted tokens would drift from
  p (measurably, in a few thousand 3-token samples of a depth-2 tree). So a sampled
  candidate's score depends only on its draw rank and on the row's earlier steps: the
  tree's shape is fixed before this step's draws and the drafter only fills it; within a
  node, scores fall strictly along the draw order, so any top-n selection keeps each
  node's children a prefix of its draws."""
  if sampling.greedy:
    scores, ix = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), k)
    return scores, ix, None
  logq = processed_logprobs(logits, sampling)
  _, ix = jax.lax.top_k(logq + jax.random.gumbel(key, logq.shape, jnp.float32), k)
  scores = rank_scores[:, :k].reshape((ix.shape[0],) + (1,) * (ix.ndim - 2) + (k,))
  return jnp.broadcast_to(scores, ix.shape), ix, jnp.exp(logq)


def _caught_up(params, drafter, config, attention_impl, rules, state: SpecState
               ) -> tuple[SpecState, jax.Array]:
  """The drafter runs the pending (accepted) pairs: the state with its cache advanced past
  them, and its output at the last one [B, E], which predicts a tree's first level. Every
  step of a rollout with a drafter runs it, whichever kind drafts, so the drafter conditions
  on every emitted token. The pending width is the rollout's deepest strategy's, so
  shallower ones pay a few padded slots."""
  cache = state.draft_cache
  positions = cache.lengths[:, None] + jnp.arange(state.pend_tokens.shape[1])[None, :]
  hidden, cache = drafter_forward(drafter, params, config, state.pend_tokens, state.pend_hidden,
                                  positions, cache, attention_impl=attention_impl, rules=rules)
  last = hidden[jnp.arange(hidden.shape[0]), state.pend_count - 1]
  return state.replace(draft_cache=cache.advance(state.pend_count)), last


def _grow_tree(key, params, drafter, head, vocab_ids, config, strategy, sampling,
               attention_impl, rules, state: SpecState, root_hidden: jax.Array):
  """Drafts `depth` levels of `topk` nodes from a caught-up state and its root's drafter
  output (`_caught_up`). Node n sits at level n // topk (depth+1).

  Under sampling also returns the q each parent's children were drawn from,
  [B, 1 + (depth - 1) * topk, Vd]: the root's, then node n's at 1 + n."""
  depth, k = strategy.depth, strategy.topk
  keys = jax.random.split(key, depth)
  b = state.pend_tokens.shape[0]
  n_nodes = strategy.num_nodes
  to_token = (lambda ix: ix) if vocab_ids is None else (lambda ix: jnp.take(vocab_ids, ix))

  cache = state.draft_cache
  committed = cache.lengths
  rank_scores = _rank_scores(state.rank_tries[strategy.name],
                             state.rank_accepts[strategy.name])       # [B, depth, topk]
  scores, ix, q = _propose(keys[0], draft_logits(head, root_hidden), k, sampling,
                           rank_scores[:, 0])
  draft_probs = [None if q is None else q[:, None]]
  level_tokens, level_parents = to_token(ix), jnp.full((b, k), -1, jnp.int32)
  level_hidden = jnp.broadcast_to(root_hidden[:, None], (b, k, root_hidden.shape[-1]))
  node_tokens, node_parents, node_scores = [level_tokens], [level_parents], [scores]
  ancestors = jnp.broadcast_to(jnp.eye(n_nodes, dtype=bool), (b, n_nodes, n_nodes))

  rel = jnp.arange(cache.max_len)[None, :] - committed[:, None]         # [B, S]
  self_only = jnp.broadcast_to(jnp.eye(k, dtype=bool), (b, k, k))
  in_tree = (rel >= 0) & (rel < n_nodes)
  for level in range(1, depth):
    frontier = (level - 1) * k + jnp.arange(k)
    # Earlier levels' ancestors are in the cache; each node sees itself as a new token.
    strict = ancestors[:, frontier] & ~jnp.eye(n_nodes, dtype=bool)[frontier]
    seen = jnp.take_along_axis(strict, jnp.clip(rel, 0, n_nodes - 1)[:, None], axis=-1)
    cache_mask = (rel < 0)[:, None] | (in_tree[:, None] & seen)
    level_positions = jnp.broadcast_to(committed[:, None] - 1 + level, (b, k))
    out, cache = drafter_forward(drafter, params, config, level_tokens, level_hidden,
                                 level_positions,
                                 cache.replace(lengths=committed + (level - 1) * k),
                                 new_mask=self_only, cache_mask=cache_mask,
                                 attention_impl=attention_impl, rules=rules)
    child_scores, child_ix, q = _propose(keys[level], draft_logits(head, out), k,
                                         sampling, rank_scores[:, level])  # [B, k, k]
    draft_probs.append(q)
    scores, best = jax.lax.top_k((scores[:, :, None] + child_scores).reshape(b, k * k), k)
    parent_local = best // k
    level_tokens = to_token(jnp.take_along_axis(child_ix.reshape(b, k * k), best, axis=1))
    level_parents = frontier[parent_local]
    level_hidden = jnp.take_along_axis(out, parent_local[:, :, None], axis=1)
    new_nodes = level * k + jnp.arange(k)
    parent_rows = jnp.take_along_axis(ancestors, level_parents[:, :, None], axis=1)
    ancestors = ancestors.at[:, new_nodes].set(parent_rows | ancestors[:, new_nodes])
    node_tokens.append(level_tokens)
    node_parents.append(level_parents)
    node_scores.append(scores)
  cache = cache.replace(lengths=committed)
  return (state.replace(draft_cache=cache), jnp.concatenate(node_tokens, 1),
          jnp.concatenate(node_parents, 1), jnp.concatenate(node_scores, 1), ancestors,
          None if sampling.greedy else jnp.concatenate(draft_probs, axis=1))


def _select_verify_set(strategy, node_tokens, node_parents, node_scores, ancestors,
                       root_tokens):
  """Best `verify_tokens - 1` nodes plus the root, ordered so parents precede children.

  Returns the verified tokens, depths, parents (verify indices) and attention mask, and
  the tree node behind each verify index but the root [B, verify_tokens - 1]."""
  k, n_sel = strategy.topk, strategy.verify_tokens - 1
  node_depth = jnp.arange(strategy.num_nodes) // k + 1
  _, sel = jax.lax.top_k(node_scores - _DEPTH_TIEBREAK * node_depth, n_sel)
  sel = jnp.sort(sel, axis=1)                                         # [B, n_sel]
  tokens = jnp.concatenate([root_tokens[:, None],
                            jnp.take_along_axis(node_tokens, sel, axis=1)], axis=1)
  depth = jnp.concatenate([jnp.zeros_like(sel[:, :1]), node_depth[sel]], axis=1)
  sel_parent = jnp.take_along_axis(node_parents, sel, axis=1)
  # Verify index of each parent: 0 for the root, else 1 + its rank in `sel`.
  parent_rank = jnp.argmax(sel[:, None, :] == sel_parent[:, :, None], axis=-1) + 1
  parents = jnp.concatenate([jnp.zeros_like(sel[:, :1]),
                             jnp.where(sel_parent < 0, 0, parent_rank)], axis=1)
  sub = jnp.take_along_axis(jnp.take_along_axis(ancestors, sel[:, :, None], axis=1),
                            sel[:, None, :], axis=2)                  # [B, n_sel, n_sel]
  b = sel.shape[0]
  mask = jnp.zeros((b, n_sel + 1, n_sel + 1), bool).at[:, :, 0].set(True)
  mask = mask.at[:, 1:, 1:].set(sub)
  return tokens, depth, parents, mask, sel


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


def _verified_draft_probs(draft_probs, sel):
  """The q each verified node's children were drawn from [B, V, Vd] (see `_grow_tree`)."""
  # draft_probs row of each verified node: 0 for the root, 1 + n for node n. Nodes of the
  # last level have no children and no row of their own; their q is never read.
  rows = jnp.concatenate([jnp.zeros_like(sel[:, :1]),
                          jnp.minimum(1 + sel, draft_probs.shape[1] - 1)], axis=1)
  return jnp.take_along_axis(draft_probs, rows[:, :, None], axis=1)


def _learned_tree(key, params, drafter, head, vocab_ids, config, strategy, sampling,
                  attention_impl, rules, state: SpecState, root_hidden: jax.Array
                  ) -> tuple[SpecState, VerifyTree]:
  """The drafter's tree (`_grow_tree`), cut to its best `verify_tokens` nodes."""
  state, node_tokens, node_parents, node_scores, ancestors, draft_probs = _grow_tree(
      key, params, drafter, head, vocab_ids, config, strategy, sampling, attention_impl,
      rules, state, root_hidden)
  tokens, depths, parents, mask, sel = _select_verify_set(
      strategy, node_tokens, node_parents, node_scores, ancestors, state.base.last_tokens)
  q = None if draft_probs is None else _verified_draft_probs(draft_probs, sel)
  return state, VerifyTree(tokens, depths, parents, mask, q)


def _chain_tree(root: jax.Array, drafts: jax.Array) -> VerifyTree:
  """The root [B] followed by a chain of point-mass drafts [B, D]."""
  b, d = drafts.shape
  steps = jnp.broadcast_to(jnp.arange(d + 1, dtype=jnp.int32), (b, d + 1))
  causal = jnp.tril(jnp.ones((d + 1, d + 1), bool))
  return VerifyTree(tokens=jnp.concatenate([root[:, None], drafts], axis=1), depths=steps,
                    parents=jnp.maximum(steps - 1, 0),
                    mask=jnp.broadcast_to(causal, (b, d + 1, d + 1)), draft_probs=None)


def _ngram_tree(root: jax.Array, drafts: tuple[jax.Array, ...]) -> VerifyTree:
  """The root [B] above `ngram.propose_tree`'s point-mass nodes."""
  tokens, depths, parents, ancestors = drafts
  b, n = tokens.shape
  mask = jnp.zeros((b, n + 1, n + 1), bool).at[:, :, 0].set(True).at[:, 1:, 1:].set(ancestors)
  with_root = lambda root_value, x: jnp.concatenate([root_value, x], axis=1)
  return VerifyTree(tokens=with_root(root[:, None], tokens),
                    depths=with_root(jnp.zeros((b, 1), depths.dtype), depths),
                    parents=with_root(jnp.zeros((b, 1), parents.dtype), parents), mask=mask,
                    draft_probs=None)


def _hybrid_tree(key, params, drafter, head, vocab_ids, config, strategy, sampling,
                 attention_impl, rules, state: SpecState, root_hidden: jax.Array,
                 chain: VerifyTree, use_learned: jax.Array
                 ) -> tuple[SpecState, VerifyTree, jax.Array | None]:
  """Per row, the learned drafter's tree where `use_learned` [B], else the model-free
  `chain`. Also returns, when sampling, which nodes are point masses [B, V] (a model-free
  row's): recursive rejection then never reads their q rows. Runs only in a step where
  some live row picked the drafter (`spec_chunk`'s runs of steps)."""
  state, drafted = _learned_tree(key, params, drafter, head, vocab_ids, config, strategy,
                                 sampling, attention_impl, rules, state, root_hidden)
  pick = lambda a, b: jnp.where(use_learned.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)
  tree = drafted._replace(tokens=pick(drafted.tokens, chain.tokens),
                          depths=pick(drafted.depths, chain.depths),
                          parents=pick(drafted.parents, chain.parents),
                          mask=pick(drafted.mask, chain.mask))
  point_mass = None if sampling.greedy else jnp.broadcast_to(~use_learned[:, None],
                                                             tree.tokens.shape)
  return state, tree, point_mass


def _hybrid_pick(state: SpecState, depth: int, ngram_config: ngram.NgramConfig,
                 hybrid: hybrid_lib.HybridConfig, full_match: jax.Array | None = None
                 ) -> jax.Array:
  """[B] the rows whose pick is the learned drafter this step (`hybrid.pick_learned`).
  full_match: whether each row's chain follows a full `max_ngram` match, when the caller
  has proposed it; else it is proposed here."""
  if full_match is None:
    full_match = ngram.propose_chain(state.context, depth, ngram_config)[1] >= (
        ngram_config.max_ngram)
  return hybrid_lib.pick_learned(state.hybrid, hybrid, depth + 1, ~state.base.done,
                                 full_match)


def _merged_tree(key, params, drafter, head, vocab_ids, config, strategy, sampling,
                 attention_impl, rules, state: SpecState, root_hidden: jax.Array,
                 chain: VerifyTree) -> tuple[SpecState, VerifyTree, jax.Array]:
  """One verify tree of the strategy's `depth + 1` tokens holding both drafts: the
  model-free `chain` (`hybrid.merge_split`'s depth), tried first, and the learned
  drafter's chain, both from the root. Also returns which nodes are point masses [B, V]:
  recursive rejection tries the chain's head as one and the learned head as a draw from q."""
  ngram_depth, learned_depth = hybrid_lib.merge_split(strategy.depth)
  # The learned chain's own shape, with the strategy's rank counts (a chain draws one
  # child per node, so they shape nothing: `_propose` keeps its one draw).
  sub = SpecStrategy(learned_depth, 1, learned_depth + 1)
  view = lambda counts: {sub.name: counts[strategy.name][:, :learned_depth]}
  grown, learned = _learned_tree(
      key, params, drafter, head, vocab_ids, config, sub, sampling, attention_impl, rules,
      state.replace(rank_tries=view(state.rank_tries), rank_accepts=view(state.rank_accepts)),
      root_hidden)
  state = grown.replace(rank_tries=state.rank_tries, rank_accepts=state.rank_accepts)
  b, a = chain.tokens.shape[0], ngram_depth
  v = 1 + ngram_depth + learned_depth
  mask = jnp.zeros((b, v, v), bool).at[:, :a + 1, :a + 1].set(chain.mask)
  mask = mask.at[:, a + 1:, 0].set(True).at[:, a + 1:, a + 1:].set(learned.mask[:, 1:, 1:])
  learned_parents = learned.parents[:, 1:]
  tree = VerifyTree(
      tokens=jnp.concatenate([chain.tokens, learned.tokens[:, 1:]], axis=1),
      depths=jnp.concatenate([chain.depths, learned.depths[:, 1:]], axis=1),
      parents=jnp.concatenate([chain.parents,
                               jnp.where(learned_parents == 0, 0, learned_parents + a)], 1),
      mask=mask,
      # The chain's nodes' children are point masses: their q rows are never read.
      draft_probs=None if learned.draft_probs is None else jnp.concatenate(
          [learned.draft_probs[:, :1], jnp.zeros_like(learned.draft_probs[:, :1]).repeat(a, 1),
           learned.draft_probs[:, 1:]], axis=1))
  point_mass = (jnp.arange(v) >= 1) & (jnp.arange(v) <= a)
  return state, tree, jnp.broadcast_to(point_mass, (b, v))


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


def _count_ranks(state: SpecState, strategy: SpecStrategy, tries: jax.Array,
                 accepts: jax.Array, live: jax.Array) -> SpecState:
  """Adds one step's [B, depth, topk] try / accept counts of live rows to the statistics
  of the strategy that drew them."""
  add = lambda counts, x: {**counts, strategy.name: counts[strategy.name]
                           + jnp.where(live[:, None, None], x, 0)}
  return state.replace(rank_tries=add(state.rank_tries, tries),
                       rank_accepts=add(state.rank_accepts, accepts))


def _resolved_kind(kind: str | None, drafter, ngram_config) -> str:
  """The kind a step drafts with (`spec_step`'s kind; None: from the sources it has)."""
  if kind is not None:
    return kind
  return "learned" if ngram_config is None else "ngram" if drafter is None else "hybrid"


def spec_step(params: Params, drafter: DrafterParams | None, head: jax.Array | None,
              vocab_ids: jax.Array | None, state: SpecState, *, config: ModelConfig,
              strategy: SpecStrategy, sampling: SamplingParams, eos_ids: tuple[int, ...],
              max_new_tokens: int, ngram_config: ngram.NgramConfig | None = None,
              hybrid: hybrid_lib.HybridConfig | None = None, kind: str | None = None,
              learned_run: bool = True, draft_temperature_ratio: float = 1.0,
              attention_impl: str = "auto", rules: MeshRules | None = None) -> SpecState:
  """Draft a tree, verify it in one target pass, commit the accepted path plus a bonus.

  The state's draft sources: `drafter` (learned), `ngram_config` (model-free, a chain from
  `state.context`), or both, with `hybrid` for their per-row counts (`state.hybrid`).
  kind: which drafts this step (`strategy.DRAFTER_KINDS`; "hybrid": each row picks one
  of the two, `hybrid.py`); None: the only source, or "hybrid" with both. Every source
  the state holds stays in step: the drafter runs the accepted pairs and the context
  grows by the emitted tokens whichever kind drafted.
  learned_run (a picking hybrid): whether some live row picks the learned drafter this
  step (`spec_chunk` runs each kind's steps in a loop of their own); if not, every row
  drafts the model-free chain and no drafter tree grows.
  Sampled tree drafts (topk > 1) come from the drafter at `draft_temperature_ratio` times
  the sampling temperature (top-p / top-k as given); rejection sampling reads the same q,
  so any ratio is exact and only acceptance changes. A chain's single draft passes most
  often when q is closest to p, so chains draw at the sampling temperature itself."""
  base = state.base
  depth = strategy.depth
  live = ~base.done
  key, draft_key, accept_key = jax.random.split(base.key, 3)
  learned = drafter is not None
  kind = _resolved_kind(kind, drafter, ngram_config)
  ratio = draft_temperature_ratio if strategy.topk > 1 else 1.0
  draft_sampling = dataclasses.replace(sampling, temperature=sampling.temperature * ratio)
  merged = kind == "hybrid" and hybrid.merge
  point_mass = None
  own_first = not sampling.greedy   # see `ngram.propose_chain`
  # The model-free draft, and whether it follows a full `max_ngram` match (the hybrid's
  # pick and counts read it; a learned step has none).
  if kind == "ngram" and strategy.topk > 1:
    *nodes, matched = ngram.propose_tree(state.context, depth, strategy.topk,
                                         strategy.verify_tokens - 1, ngram_config)
    model_free = _ngram_tree(base.last_tokens, nodes)
  elif kind != "learned":
    drafts, matched = ngram.propose_chain(
        state.context, hybrid_lib.merge_split(depth)[0] if merged else depth, ngram_config,
        own_first=own_first)
    model_free = _chain_tree(base.last_tokens, drafts)
  full_match = (jnp.zeros_like(live) if kind == "learned"
                else matched >= ngram_config.max_ngram)
  if learned:
    state, root_hidden = _caught_up(params, drafter, config, attention_impl, rules, state)
  if merged:
    state, tree, point_mass = _merged_tree(draft_key, params, drafter, head, vocab_ids, config,
                                           strategy, draft_sampling, attention_impl, rules,
                                           state, root_hidden, model_free)
  elif kind == "hybrid" and learned_run:
    use_learned = _hybrid_pick(state, depth, ngram_config, hybrid, full_match)
    state, tree, point_mass = _hybrid_tree(draft_key, params, drafter, head, vocab_ids,
                                           config, strategy, draft_sampling, attention_impl,
                                           rules, state, root_hidden, model_free, use_learned)
  elif kind == "learned":
    use_learned = jnp.ones_like(live)
    state, tree = _learned_tree(draft_key, params, drafter, head, vocab_ids, config, strategy,
                                draft_sampling, attention_impl, rules, state, root_hidden)
  else:
    use_learned = jnp.zeros_like(live)
    tree = model_free

  committed = base.cache.lengths
  hidden, new_k, new_v = forward_new_kv(params, config, tree.tokens,
                                        committed[:, None] + tree.depths, base.cache, tree.mask,
                                        rules, attention_impl)
  logits = lm_logits(params, config, hidden, rules)                    # [B, V, vocab]
  drawn_logprobs = None
  if sampling.greedy:
    num_accepted, path, emitted = _accept_greedy(logits, tree.tokens, tree.parents,
                                                 tree.depths, depth)
  else:
    drawn_logprobs = processed_logprobs(logits, sampling)
    num_accepted, path, emitted, tries, accepts = recursive_rejection(
        accept_key, drawn_logprobs, tree.draft_probs, tree.tokens, tree.parents, depth,
        2 if merged else strategy.topk, point_mass, draft_vocab=vocab_ids)
    if learned and not merged:   # the rank statistics shape learned trees: their steps count
      state = _count_ranks(state, strategy, tries, accepts, live & use_learned)
  if merged:   # the kind whose draft the path took
    use_learned = (num_accepted > 0) & (path[:, 1] > hybrid_lib.merge_split(depth)[0])
  in_path = jnp.arange(depth + 1)[None, :] <= num_accepted[:, None]

  # Only the path's K/V enter the cache, in consecutive slots (the rest of the tree is
  # never committed), so no verified token's K/V has to move within the cache.
  take_path = lambda new: jnp.take_along_axis(new, path[None, :, :, None, None], axis=2)
  cache = base.cache.write_after_committed(take_path(new_k), take_path(new_v))

  emitted_logprobs = _emitted_logprobs(logits, drawn_logprobs, path, emitted, sampling)

  base = base.replace(key=key, cache=cache.advance(jnp.where(live, num_accepted + 1, 0)))
  generated_before = base.num_generated
  for j in range(depth + 1):
    base = emit(base, emitted[:, j], emitted_logprobs[:, j], ~base.done & in_path[:, j] & live,
                eos_ids, max_new_tokens)
  new_tokens = base.num_generated - generated_before
  state = state.replace(base=base, spec_steps=state.spec_steps + live,
                        spec_tokens=state.spec_tokens + new_tokens)
  if ngram_config is not None:
    state = state.replace(context=ngram.append(state.context, emitted, new_tokens))
  if hybrid is not None:
    state = state.replace(hybrid=hybrid_lib.record(state.hybrid, hybrid, use_learned,
                                                   new_tokens, live, full_match))
  if not learned:
    return state
  # Pending pairs are padded to the rollout's pend width (shared by all its strategies).
  pad = state.pend_tokens.shape[1] - (depth + 1)
  path_hidden = jnp.take_along_axis(hidden, path[:, :, None], axis=1)
  return state.replace(pend_tokens=jnp.pad(emitted, ((0, 0), (0, pad))),
                       pend_hidden=jnp.pad(path_hidden, ((0, 0), (0, pad), (0, 0))),
                       pend_count=num_accepted + 1)


@functools.partial(jax.jit, static_argnames=("config", "strategy", "sampling", "eos_ids",
                                             "max_new_tokens", "chunk_steps", "window",
                                             "ngram_config", "hybrid", "kind",
                                             "draft_temperature_ratio",
                                             "attention_impl", "rules"),
                   donate_argnames=("state",))
def spec_chunk(params: Params, drafter: DrafterParams | None, head: jax.Array | None,
               vocab_ids: jax.Array | None, state: SpecState, *, config: ModelConfig,
               strategy: SpecStrategy,
               sampling: SamplingParams, eos_ids: tuple[int, ...], max_new_tokens: int,
               chunk_steps: int, window: int | None = None,
               ngram_config: ngram.NgramConfig | None = None,
               hybrid: hybrid_lib.HybridConfig | None = None, kind: str | None = None,
               draft_temperature_ratio: float = 1.0, attention_impl: str = "auto",
               rules: MeshRules | None = None) -> SpecState:
  """Up to `chunk_steps` speculative steps in one program; stops when all rows are done.

  head: `draft_head(params, config, vocab_ids)`, made by the caller outside the chunk (its
  column gather of a 16k draft vocabulary takes ~11 ms on a 2-core CPU, ten drafting
  levels; the engine's `rollout_draft_head` also reuses it from rollout to rollout).
  Model-free alone (`ngram_config` given, no drafter): drafter, head and vocab_ids are
  None. kind, ngram_config, hybrid: see `spec_step`.

  window: both caches are cut to their first `window` slots for the chunk (the caller
  guarantees every write of the chunk lands inside); None is the whole cache.
  """
  full_cache, full_draft_cache = state.base.cache, state.draft_cache
  learned = full_draft_cache is not None
  if window is not None:
    state = state.replace(base=state.base.replace(cache=full_cache.window(window)),
                          draft_cache=full_draft_cache.window(window) if learned else None)

  def steps(learned_run=True):
    def step(carry):
      i, s = carry
      return i + 1, spec_step(params, drafter, head, vocab_ids, s, config=config,
                              strategy=strategy, sampling=sampling, eos_ids=eos_ids,
                              max_new_tokens=max_new_tokens, ngram_config=ngram_config,
                              hybrid=hybrid, kind=kind, learned_run=learned_run,
                              draft_temperature_ratio=draft_temperature_ratio,
                              attention_impl=attention_impl, rules=rules)
    return step

  def more(carry):
    i, s = carry
    return (i < chunk_steps) & ~jnp.all(s.base.done)

  def run_of(learned_run):
    """Steps while the batch's pick stays `learned_run` (any live row picks the drafter)."""
    def go_on(carry):
      s = carry[1]
      picked = _hybrid_pick(s, strategy.depth, ngram_config, hybrid) & ~s.base.done
      return more(carry) & (jnp.any(picked) == learned_run)
    return lambda carry: jax.lax.while_loop(go_on, steps(learned_run), carry)

  # A picking hybrid runs each kind's steps in a loop of its own rather than a conditional
  # in every step: the model-free loop's steps are the chain's alone. With a conditional
  # (branches: the drafter's tree or nothing), a batch-1 T=0 step whose rows all picked the
  # chain took 1.08-1.09x the model-free chain's time (SmolLM2, 2-core CPU); so, 1.00-1.01x.
  picking = _resolved_kind(kind, drafter, ngram_config) == "hybrid" and not hybrid.merge
  body = (lambda carry: run_of(True)(run_of(False)(carry))) if picking else steps()
  state = jax.lax.while_loop(more, body, (jnp.int32(0), state))[1]
  if window is not None:
    state = state.replace(base=state.base.replace(cache=full_cache.put_window(state.base.cache)),
                          draft_cache=(full_draft_cache.put_window(state.draft_cache)
                                       if learned else None))
  return lay_out(state, rules)

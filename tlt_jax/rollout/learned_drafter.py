"""The learned drafter (EAGLE): a one-layer model over the target's hidden states that
grows a tree of drafts per step.

State between steps (per row): the drafter cache holds slots 0..L-2, and the pairs it still
has to consume are `pend_*` (the accepted path with its true target hidden states), so the
drafter always conditions on real target features. Greedy: each node's top-k children.
Sampling: k draws without replacement from the drafter's q (trees at
`draft_temperature_ratio` times the sampling temperature), in a tree whose shape is fixed
before the step's draws by each row's acceptance so far per level and draw rank
(`_rank_scores`), as exact recursive rejection needs (see `_propose`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.drafter import draft_logits, drafter_forward, drafter_forward_new_kv
from tlt_jax.models.kv_cache import KVCache
from tlt_jax.rollout.decode import DecodeState
from tlt_jax.rollout.drafting import Draft, DraftInputs, Verified, VerifyTree
from tlt_jax.rollout.sampling import SamplingParams, processed_logprobs
from tlt_jax.rollout.strategy import SpecStrategy
from tlt_jax.sharding.rules import MeshRules

# Ranks a node just below an equal-scoring ancestor, so a top-n selection is ancestor-closed.
_DEPTH_TIEBREAK = 1e-3
# Before any verify step, every draw is taken to be accepted half the times it is tried,
# with the weight of two tries: a geometric prior the row's own counts soon outweigh.
_PRIOR_TRIES, _PRIOR_ACCEPTS = 2.0, 1.0


@flax.struct.dataclass
class LearnedState:
  cache: KVCache                # the drafter's: slots 0..L-2 of each row
  pend_tokens: jax.Array        # [B, pend_width]: max depth over the strategies + 1
  pend_hidden: jax.Array        # [B, pend_width, E]
  pend_count: jax.Array         # [B]
  # Sampled trees only: how often the walk tried / accepted a child, by its level and draw
  # rank, prior pseudo-counts included (see `_rank_scores`). One [B, depth, topk] count per
  # strategy (by name): chains and trees of other depths and draw temperatures accept at
  # their own rates, so pooled counts would fit every tree to a mixture.
  rank_tries: dict[str, jax.Array]
  rank_accepts: dict[str, jax.Array]


def pending_width(strategies) -> int:
  """Width of the pending (accepted, not yet drafted-on) pairs: the most any of the
  strategies a rollout may switch between can accept in one step, plus the bonus."""
  return max(s.depth for s in strategies) + 1


def prefilled_state(inputs: DraftInputs, base: DecodeState, cache: KVCache, *,
                    config: ModelConfig, strategies: tuple[SpecStrategy, ...],
                    prefill_len: int, attention_impl: str, rules: MeshRules | None
                    ) -> LearnedState:
  """Drafter prefill over each row's existing context (slots 0..L-2), leaving the pair
  (h_{L-1}, x_L) pending; see `speculative.start_speculation`."""
  pend_width = pending_width(strategies)
  lengths = base.cache.lengths
  b = base.history.shape[0]
  tokens = jnp.concatenate([base.history[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
  positions = jnp.broadcast_to(jnp.arange(prefill_len, dtype=jnp.int32), (b, prefill_len))
  # Only the live context runs, against no cache slots: every position of the cache, scored
  # against every empty drafter slot as well, made the prefill quadratic in the cache length
  # whatever the rows' own lengths. Only the new K/V are kept, and the drafter's one layer
  # computes them from its input projection alone: XLA drops the attention, so the switch
  # is linear in the context (benchmarks/long_context.py).
  _, new_k, new_v = drafter_forward_new_kv(
      inputs.weights.params, inputs.params, config, tokens[:, :prefill_len],
      base.hidden_buf[:, :prefill_len], positions, cache.without_slots(b),
      attention_impl=attention_impl, rules=rules)
  cache = cache.write_prefix(new_k, new_v)
  rows = jnp.arange(b)
  pend_tokens = jnp.zeros((b, pend_width), jnp.int32).at[:, 0].set(base.last_tokens)
  pend_hidden = jnp.zeros((b, pend_width, config.hidden_size), base.hidden_buf.dtype)
  pend_hidden = pend_hidden.at[:, 0].set(base.hidden_buf[rows, lengths - 1])
  counts = lambda prior: {s.name: jnp.full((b, s.depth, s.topk), prior) for s in strategies}
  return LearnedState(cache=cache.replace(lengths=lengths - 1), pend_tokens=pend_tokens,
                      pend_hidden=pend_hidden, pend_count=jnp.ones((b,), jnp.int32),
                      rank_tries=counts(_PRIOR_TRIES), rank_accepts=counts(_PRIOR_ACCEPTS))


@dataclasses.dataclass(frozen=True)
class LearnedDrafter:
  """The learned drafter of a target model (`config`), run on the replica's mesh (`rules`).
  Sampled tree drafts (topk > 1) draw at `draft_temperature_ratio` times the sampling
  temperature (top-p / top-k as given); rejection sampling reads the same q, so any ratio is
  exact and only acceptance changes. A chain's single draft passes most often when q is
  closest to p, so chains draw at the sampling temperature itself."""
  config: ModelConfig
  attention_impl: str = "auto"
  rules: MeshRules | None = None
  draft_temperature_ratio: float = 1.0

  def catch_up(self, inputs: DraftInputs, state: LearnedState
               ) -> tuple[LearnedState, jax.Array]:
    """The drafter runs the pending (accepted) pairs: the state with its cache advanced past
    them, and its output at the last one [B, E], which predicts a tree's first level. Every
    step of a rollout with a drafter runs it, whichever kind drafts, so the drafter
    conditions on every emitted token. The pending width is the rollout's deepest
    strategy's, so shallower ones pay a few padded slots."""
    cache = state.cache
    positions = cache.lengths[:, None] + jnp.arange(state.pend_tokens.shape[1])[None, :]
    hidden, cache = drafter_forward(inputs.weights.params, inputs.params, self.config,
                                    state.pend_tokens, state.pend_hidden, positions, cache,
                                    attention_impl=self.attention_impl, rules=self.rules)
    last = hidden[jnp.arange(hidden.shape[0]), state.pend_count - 1]
    return state.replace(cache=cache.advance(state.pend_count)), last

  def tree(self, key, inputs: DraftInputs, state: LearnedState, base: DecodeState,
           strategy: SpecStrategy, sampling: SamplingParams, root_hidden: jax.Array
           ) -> tuple[LearnedState, VerifyTree]:
    """The drafter's tree from a caught-up state (`_grow_tree`), cut to its best
    `verify_tokens` nodes."""
    ratio = self.draft_temperature_ratio if strategy.topk > 1 else 1.0
    sampling = dataclasses.replace(sampling, temperature=sampling.temperature * ratio)
    state, node_tokens, node_parents, node_scores, ancestors, draft_probs = _grow_tree(
        key, inputs, self.config, strategy, sampling, self.attention_impl, self.rules, state,
        root_hidden)
    tokens, depths, parents, mask, sel = _select_verify_set(
        strategy, node_tokens, node_parents, node_scores, ancestors, base.last_tokens)
    q = None if draft_probs is None else _verified_draft_probs(draft_probs, sel)
    return state, VerifyTree(tokens, depths, parents, mask, q)

  def propose(self, key, inputs: DraftInputs, state: LearnedState, base: DecodeState,
              strategy: SpecStrategy, sampling: SamplingParams) -> tuple[LearnedState, Draft]:
    state, root_hidden = self.catch_up(inputs, state)
    state, tree = self.tree(key, inputs, state, base, strategy, sampling, root_hidden)
    every_row = jnp.ones(base.done.shape, bool)
    return state, Draft(tree, learned_rows=every_row, full_match=~every_row)

  def commit(self, state: LearnedState, strategy: SpecStrategy, verified: Verified,
             counted: jax.Array | None = None) -> LearnedState:
    """The emitted path's pairs pend for the next catch-up; a sampled walk's tries and
    accepts count towards the rank statistics that shape the strategy's later trees, for
    the `counted` rows (default: the live ones) whose tree the drafter grew."""
    if verified.tries is not None:
      rows = verified.live if counted is None else counted
      add = lambda counts, x: {**counts, strategy.name: counts[strategy.name]
                               + jnp.where(rows[:, None, None], x, 0)}
      state = state.replace(rank_tries=add(state.rank_tries, verified.tries),
                            rank_accepts=add(state.rank_accepts, verified.accepts))
    # Pending pairs are padded to the rollout's pend width (shared by all its strategies).
    pad = state.pend_tokens.shape[1] - (strategy.depth + 1)
    path_hidden = jnp.take_along_axis(verified.hidden, verified.path[:, :, None], axis=1)
    return state.replace(pend_tokens=jnp.pad(verified.emitted, ((0, 0), (0, pad))),
                         pend_hidden=jnp.pad(path_hidden, ((0, 0), (0, pad), (0, 0))),
                         pend_count=verified.num_accepted + 1)

  def chunk_body(self, step: Callable, more: Callable, strategy: SpecStrategy) -> Callable:
    return lambda carry: step(self, carry)


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


def _grow_tree(key, inputs: DraftInputs, config, strategy, sampling, attention_impl, rules,
               state: LearnedState, root_hidden: jax.Array):
  """Drafts `depth` levels of `topk` nodes from a caught-up state and its root's drafter
  output (`LearnedDrafter.catch_up`). Node n sits at level n // topk (depth+1).

  Under sampling also returns the q each parent's children were drawn from,
  [B, 1 + (depth - 1) * topk, Vd]: the root's, then node n's at 1 + n."""
  depth, k = strategy.depth, strategy.topk
  keys = jax.random.split(key, depth)
  b = state.pend_tokens.shape[0]
  n_nodes = strategy.num_nodes
  vocab_ids = inputs.weights.vocab_ids
  to_token = (lambda ix: ix) if vocab_ids is None else (lambda ix: jnp.take(vocab_ids, ix))

  cache = state.cache
  committed = cache.lengths
  rank_scores = _rank_scores(state.rank_tries[strategy.name],
                             state.rank_accepts[strategy.name])       # [B, depth, topk]
  scores, ix, q = _propose(keys[0], draft_logits(inputs.head, root_hidden), k, sampling,
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
    out, cache = drafter_forward(inputs.weights.params, inputs.params, config, level_tokens,
                                 level_hidden, level_positions,
                                 cache.replace(lengths=committed + (level - 1) * k),
                                 new_mask=self_only, cache_mask=cache_mask,
                                 attention_impl=attention_impl, rules=rules)
    child_scores, child_ix, q = _propose(keys[level], draft_logits(inputs.head, out), k,
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
  return (state.replace(cache=cache), jnp.concatenate(node_tokens, 1),
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


def _verified_draft_probs(draft_probs, sel):
  """The q each verified node's children were drawn from [B, V, Vd] (see `_grow_tree`)."""
  # draft_probs row of each verified node: 0 for the root, 1 + n for node n. Nodes of the
  # last level have no children and no row of their own; their q is never read.
  rows = jnp.concatenate([jnp.zeros_like(sel[:, :1]),
                          jnp.minimum(1 + sel, draft_probs.shape[1] - 1)], axis=1)
  return jnp.take_along_axis(draft_probs, rows[:, :, None], axis=1)

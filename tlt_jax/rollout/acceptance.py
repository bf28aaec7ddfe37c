"""Lossless acceptance of sampled drafts: recursive rejection sampling over a tree.

Every node's children were drawn from the drafter's q at that node *without replacement*,
in verify order. At the current node, with the processed target distribution p there, the
children are tried in turn: child x (drawn from q_i, q with the siblings tried before it
removed and renormalized) is accepted with probability min(1, p_i(x)/q_i(x)); on
rejection p_{i+1} = norm(max(0, p_i - q_i)). An accepted child becomes the current node
(with its own p and q); when every child is rejected, or the node has none, one token is
drawn from the current p_i and the walk ends. By induction from the last sibling, each
step emits exactly p_i, so every emitted token is distributed as plain decoding's p
(Leviathan et al. / Chen et al. for one child; SpecInfer-style multi-draft for several).
A chain is the tree with one child per node (walked without updating p and q over the whole
vocabulary at each level: `_chain_walk`).

Model-free drafts are point masses: child c's q is one-hot on c, whatever was tried before
it, so it is accepted with p_i(c) and a rejection removes c from p_i and renormalizes;
siblings are distinct tokens tried in their given order. Exactness only needs the tree
to be fixed before this step's draws.

A tree may mix the two (`point_mass`): a point-mass child is tried as above, and a
rejection leaves the node's q alone, since the drawn siblings were drawn from all of q,
independently of it; each drawn child x is then accepted with min(1, p_i(x)/q_i(x)) for
the residual p_i it meets, which is the same induction (the candidate is independent of
the residual's history).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from tlt_jax.rollout.sampling import categorical


def residual_probs(p: jax.Array, q: jax.Array) -> jax.Array:
  """norm(max(0, p - q)); falls back to p where p <= q everywhere (then never used)."""
  residual = jnp.maximum(p - q, 0.0)
  total = jnp.sum(residual, axis=-1, keepdims=True)
  return jnp.where(total > 0, residual / jnp.where(total > 0, total, 1.0), p)


def recursive_rejection(key: jax.Array, target_logprobs: jax.Array,
                        draft_probs: jax.Array | None,
                        tokens: jax.Array, parents: jax.Array, depth: int, max_children: int,
                        point_mass: jax.Array | None = None,
                        draft_vocab: jax.Array | None = None
                        ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
  """Walks a verified tree from its root (verify index 0).

  target_logprobs [B, N, V]: log p at each of the N verified nodes (a chain's walk reads p
  at its drafts and where it ends, not all of it). draft_probs [B, N, V]: the q
  each node's children were drawn from (any row for a leaf); None: every draft is a point
  mass (model-free, distinct siblings). point_mass [B, N] bool: with draft_probs, the nodes
  that are point masses all the same (a model-free chain in a learned tree, or a
  model-free row among learned ones; a node's point-mass children come before its drawn
  ones). draft_vocab [Vd]: draft_probs are [B, N, Vd] on a drafter's reduced vocabulary,
  column i being target token draft_vocab[i]. tokens [B, N]; parents [B, N]:
  verify index of each node's parent (entry 0, the root's, is ignored). Siblings appear in
  the order they were drawn; a child's depth is its parent's plus one, at most `depth`;
  no node has more than `max_children` children.

  Returns (drafted tokens accepted [B], verify index of the walk's node at each depth
  [B, depth + 1] (the last one repeated past the end), emitted tokens [B, depth + 1]:
  the accepted drafts, then the token drawn at the node where the walk ended, and how
  often each child was tried and accepted by its level and place among its siblings (its
  draw rank), [B, depth, max_children] each: the statistics that shape later trees.
  """
  if max_children == 1:
    return _chain_walk(key, target_logprobs, draft_probs, tokens, parents, depth, point_mass,
                       draft_vocab)
  if draft_probs is not None and draft_vocab is not None:
    draft_probs = on_target_vocab(draft_probs, draft_vocab, target_logprobs.shape[-1])
  return _tree_walk(key, jnp.exp(target_logprobs), draft_probs, tokens, parents, depth,
                    max_children, point_mass)


def on_target_vocab(q: jax.Array, draft_vocab: jax.Array, vocab_size: int) -> jax.Array:
  """q [..., Vd] on a drafter's reduced vocabulary scattered to the target's: for a tree's
  walk, right before it. (Scattered before the hybrid's per-row pick of a tree, in a
  conditional, a [B, V, vocab] q made its steps 7-8% slower than the learned drafter's
  alone with every row drafting learned: SmolLM2, CPU, batch 16, T=1.)"""
  return jnp.zeros(q.shape[:-1] + (vocab_size,), q.dtype).at[..., draft_vocab].set(q)


def _chain_walk(key, target_logprobs, draft_probs, tokens, parents, depth, point_mass,
                draft_vocab):
  """`_tree_walk` for trees of one child a node, the same draws and the same results,
  reading p and q at the drafted tokens alone and the whole vocabulary only where the walk
  ends. The tree walk updates p and q over the whole vocabulary at every child it tries:
  SmolLM2's 49k-token p, a 4-deep chain with the drafter's 8k-token q, 2-core CPU, 0.69 ms
  against 1.8 at 4 rows and 2.2 against 7.5 at 16. With SD's emitted log-probs read
  without copying the path's logits (same commit), SmolLM2's T=1 verify steps took 2% less
  at batch 4 and 7% (learned) / 5% (model-free) less at batch 16
  (benchmarks/results/spec_step_chain_acceptance_ab_cpu.json)."""
  b = tokens.shape[0]
  rows = jnp.arange(b)
  uniform_key, last_key = jax.random.split(key)
  uniforms = jax.random.uniform(uniform_key, (depth, 1, b))[:, 0]
  if draft_vocab is not None:   # each target token's draft column (-1: outside it)
    column = jnp.full((target_logprobs.shape[-1],), -1, jnp.int32).at[draft_vocab].set(
        jnp.arange(draft_vocab.shape[0], dtype=jnp.int32))
  node = jnp.zeros((b,), jnp.int32)
  walking = jnp.ones((b,), bool)
  rejected = jnp.zeros((b,), bool)   # the walk ended rejecting the child of `node`
  num_accepted = jnp.zeros((b,), jnp.int32)
  path, emitted, tries, accepts = [node], [], [], []
  for level in range(depth):
    child = _child_of(parents, node)
    token = tokens[rows, child]
    p_token = jnp.exp(target_logprobs[rows, node, token])
    q_token = jnp.ones((b,))
    if draft_probs is not None:
      q = draft_probs[rows, node]
      at = token if draft_vocab is None else jnp.maximum(column[token], 0)
      inside = True if draft_vocab is None else column[token] >= 0
      drawn = jnp.ones((b,), bool) if point_mass is None else ~point_mass[rows, child]
      q_token = jnp.where(drawn, jnp.where(inside, q[rows, at], 0.0) / jnp.maximum(
          jnp.sum(q, axis=-1), 1e-30), 1.0)
    trying = walking & (child > 0) & (q_token > 0)   # child 0: the node has none
    accept = trying & (uniforms[level] * q_token < p_token)
    rejected = rejected | (trying & ~accept)
    node = jnp.where(accept, child, node)
    walking = walking & accept
    num_accepted = num_accepted + accept
    emitted.append(tokens[rows, node])
    path.append(node)
    tries.append(trying)
    accepts.append(accept)
  # Where the walk ended: p there, less the q of the child it rejected.
  p = jnp.exp(target_logprobs[rows, node])
  last_child = _child_of(parents, node)
  q = jax.nn.one_hot(tokens[rows, last_child], p.shape[-1], dtype=p.dtype)
  if draft_probs is not None:
    drawn = draft_probs[rows, node]
    drawn = drawn / jnp.maximum(jnp.sum(drawn, axis=-1, keepdims=True), 1e-30)
    drawn = drawn if draft_vocab is None else on_target_vocab(drawn, draft_vocab, p.shape[-1])
    q = drawn if point_mass is None else jnp.where(point_mass[rows, last_child][:, None], q,
                                                   drawn)
  p = jnp.where(rejected[:, None], residual_probs(p, q), p)
  last = categorical(last_key, jnp.log(p))
  steps = jnp.arange(depth + 1)[None, :]
  drafted = jnp.stack(emitted + [last], axis=1)
  emitted = jnp.where(steps < num_accepted[:, None], drafted, last[:, None])
  as_counts = lambda flags: jnp.stack(flags, axis=1)[:, :, None].astype(jnp.int32)
  return (num_accepted, jnp.stack(path, axis=1), emitted, as_counts(tries),
          as_counts(accepts))


def _child_of(parents: jax.Array, node: jax.Array) -> jax.Array:
  """[B] the first child of each row's `node` (verify index; 0 where it has none)."""
  return jnp.argmax((parents == node[:, None]) & (jnp.arange(parents.shape[1]) > 0)[None],
                    axis=1)


def _tree_walk(key, target_probs, draft_probs, tokens, parents, depth, max_children,
               point_mass):
  """`recursive_rejection` over any tree, q on the target's vocabulary."""
  b, n = tokens.shape
  rows = jnp.arange(b)
  uniform_key, last_key = jax.random.split(key)
  uniforms = jax.random.uniform(uniform_key, (depth, max_children, b))
  not_root = jnp.arange(n)[None, :] > 0
  node = jnp.zeros((b,), jnp.int32)
  point_masses = draft_probs is None
  p = target_probs[:, 0]
  q = None if point_masses else draft_probs[:, 0]
  tried = jnp.zeros((b, n), bool)
  walking = jnp.ones((b,), bool)
  num_accepted = jnp.zeros((b,), jnp.int32)
  path, emitted, tries, accepts = [node], [], [], []
  for level in range(depth):
    moved = jnp.zeros((b,), bool)
    for i in range(max_children):
      untried = (parents == node[:, None]) & not_root & ~tried
      child = jnp.argmax(untried, axis=1)
      token = tokens[rows, child]
      one_hot = lambda: jax.nn.one_hot(token, p.shape[-1], dtype=p.dtype)
      drawn = jnp.ones((b,), bool) if point_mass is None else ~point_mass[rows, child]
      if point_masses:
        q_now = one_hot()
      else:
        q_now = q / jnp.maximum(jnp.sum(q, axis=-1, keepdims=True), 1e-30)
        if point_mass is not None:
          q_now = jnp.where(drawn[:, None], q_now, one_hot())
      q_token, p_token = q_now[rows, token], p[rows, token]
      # A child whose token has no q mass left was drawn past q's support: never a draft.
      trying = walking & ~moved & untried[rows, child] & (q_token > 0)
      accept = trying & (uniforms[level, i] * q_token < p_token)
      reject = trying & ~accept
      p = jnp.where(reject[:, None], residual_probs(p, q_now), p)
      tried = tried.at[rows, child].set(tried[rows, child] | reject)
      node = jnp.where(accept, child, node)
      p = jnp.where(accept[:, None], target_probs[rows, child], p)
      if not point_masses:
        q = jnp.where((reject & drawn)[:, None], q.at[rows, token].set(0.0), q)
        q = jnp.where(accept[:, None], draft_probs[rows, child], q)
      moved = moved | accept
      tries.append(trying)
      accepts.append(accept)
    emitted.append(tokens[rows, node])
    walking = walking & moved
    num_accepted = num_accepted + moved
    path.append(node)
  last = categorical(last_key, jnp.log(p))
  steps = jnp.arange(depth + 1)[None, :]
  drafted = jnp.stack(emitted + [last], axis=1)
  emitted = jnp.where(steps < num_accepted[:, None], drafted, last[:, None])
  by_rank = lambda flags: jnp.stack(flags, axis=1).reshape(b, depth, max_children)
  return (num_accepted, jnp.stack(path, axis=1), emitted, by_rank(tries).astype(jnp.int32),
          by_rank(accepts).astype(jnp.int32))

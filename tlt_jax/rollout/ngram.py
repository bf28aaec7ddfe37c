"""Model-free drafting: each row's longest recent-suffix match in its group's own text.

A row drafts from a set of entries of a token pool: its own prompt and output so far, those
of the other rows of its group (GRPO samples of one prompt repeat each other's formulas and
steps, and siblings ahead of it have already written what it is about to), and extra token
lists from the caller (earlier epochs' responses to the prompt). Each verify step matches
the row's last `max_ngram` tokens against every position of those entries, takes the
longest match (then the latest position: recent text predicts best, and a sibling ahead of
the row has later positions; under sampling, first one in the row's own text), and
proposes the tokens that follow it as a chain, repeating them when the chain outruns them
(a row that cycles, matched in its own text, continues the cycle); or, for a tree, merges
the continuations of several best matches into a trie and keeps its most frequent branches
(`propose_tree`). The draft is a point mass that depends only on text emitted in earlier
steps, never on this step's draws, so verification stays exact
(`acceptance.recursive_rejection` with no q).

The pool is shared by the batch, not a per-row array: compaction gathers each row's
`members` (the entries it reads) but keeps every entry, so a finished sibling's output
keeps drafting for the rows behind it. Shapes are bucketed (entries and members to powers
of two, entry length to cache pages), so they add few programs.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.errors import UserInputError
from tlt_jax.rollout.sampling import argmax
from tlt_jax.sharding.rules import MeshRules, constrain


@dataclasses.dataclass(frozen=True)
class NgramConfig:
  max_ngram: int = 4   # longest suffix matched; longer ones rarely change the choice

  def __post_init__(self):
    if self.max_ngram < 1:
      raise UserInputError(f"--max_ngram={self.max_ngram}: must be >= 1")


@flax.struct.dataclass
class DraftContext:
  tokens: jax.Array    # [P, L] int32: the pool's entries
  lengths: jax.Array   # [P] int32
  members: jax.Array   # [B, M] int32: the entries each row reads, its own first; -1 pads

  def laid_out(self, rules: MeshRules | None) -> "DraftContext":
    """The pool replicated (every row may read any entry), `members` over the batch."""
    return DraftContext(tokens=constrain(self.tokens, (None, None), rules),
                        lengths=constrain(self.lengths, (None,), rules),
                        members=constrain(self.members, ("batch", None), rules))

  @property
  def sizes(self) -> dict[str, int]:
    """The buffer shapes that key the programs: entries, entry length, entries per row."""
    return {"entries": self.tokens.shape[0], "length": self.tokens.shape[1],
            "members": self.members.shape[1]}


def _power_of_two(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def build_context(texts: Sequence[Sequence[int]], groups: Sequence[int],
                  row_entries: np.ndarray, length: int) -> DraftContext:
  """The pool on the host: entry e holds texts[e] and belongs to group groups[e]; batch row
  r owns entry row_entries[r] (-1: no prompt, a padding row) and reads every entry of its
  group. length: the entry length, at least the longest text any entry will grow to.
  The shapes depend on the entries and groups alone, not on which rows are still in the
  batch, so `precompile` can build the same programs."""
  pool = np.zeros((_power_of_two(len(texts)), length), np.int32)
  lengths = np.zeros((pool.shape[0],), np.int32)
  for e, text in enumerate(texts):
    pool[e, :len(text)] = text
    lengths[e] = len(text)
  groups = np.asarray(groups)
  rows = [[] if e < 0 else [e] + [f for f in np.flatnonzero(groups == groups[e]) if f != e]
          for e in row_entries]
  widest_group = int(np.unique(groups, return_counts=True)[1].max())
  members = np.full((len(rows), _power_of_two(widest_group)), -1, np.int32)
  for r, entries in enumerate(rows):
    members[r, :len(entries)] = entries
  return DraftContext(tokens=jnp.asarray(pool), lengths=jnp.asarray(lengths),
                      members=jnp.asarray(members))


def _continuations(context: DraftContext, count: int, depth: int, config: NgramConfig,
                   own_first: bool) -> tuple[jax.Array, jax.Array]:
  """The tokens after each row's `count` best suffix matches among its members, best first
  (longest; with own_first, then the row's own text; then latest) [B, count, depth], and
  each one's length [B, count] (0: none).

  A row with no match drafts whatever the clipped gather gives: a wrong draft costs its
  verify slot, never exactness."""
  length = context.tokens.shape[1]
  n = config.max_ngram
  own = jnp.maximum(context.members[:, 0], 0)
  own_len = context.lengths[own]
  back = own_len[:, None] - 1 - jnp.arange(n)[None, :]                # [B, n]
  suffix = jnp.take_along_axis(context.tokens[own], jnp.maximum(back, 0), axis=1)
  suffix = jnp.where(back >= 0, suffix, -1)                           # never matches
  member_ok = context.members >= 0
  entries = context.tokens[jnp.maximum(context.members, 0)]           # [B, M, L]
  # match[b, m, j]: how many of the row's last tokens end at position j of member m.
  match = jnp.zeros(entries.shape, jnp.int32)
  running = jnp.ones(entries.shape, bool)
  for k in range(n):
    shifted = jnp.pad(entries, ((0, 0), (0, 0), (k, 0)), constant_values=-1)[..., :length]
    running = running & (shifted == suffix[:, k, None, None])
    match = match + running
  position = jnp.arange(length)
  following = context.lengths[jnp.maximum(context.members, 0)][..., None] - 1 - position
  usable = member_ok[..., None] & (match > 0) & (following > 0)
  is_own = (jnp.arange(context.members.shape[1]) == 0)[None, :, None] & own_first
  score = jnp.where(usable, (2 * match + is_own) * length + position, -1).reshape(
      entries.shape[0], -1)
  if count == 1:
    best = argmax(score)[:, None]
  else:
    best = jax.lax.top_k(score, min(count, score.shape[1]))[1]
  member, end = best // length, best % length                         # [B, K]
  chosen = jnp.take_along_axis(entries, member[..., None], axis=1)    # [B, K, L]
  # A match near the end of its text continues cyclically (a row that cycles goes on).
  period = jnp.maximum(jnp.take_along_axis(following.reshape(score.shape), best, axis=1), 1)
  after = end[..., None] + 1 + jnp.arange(depth) % period[..., None]
  drafts = jnp.take_along_axis(chosen, jnp.clip(after, 0, length - 1), axis=2)
  best_score = jnp.take_along_axis(score, best, axis=1)
  return drafts, jnp.where(best_score >= 0, best_score // length // 2, 0)


def propose_chain(context: DraftContext, depth: int, config: NgramConfig,
                  own_first: bool = False) -> tuple[jax.Array, jax.Array]:
  """[B, depth] drafts: the tokens after each row's best suffix match among its members;
  and the match's length [B] (0: none), which predicts how often the chain is accepted.

  own_first (for sampling): of equally long matches, one in the row's own text before the
  latest elsewhere. A sampled row goes on wording things its own way: on SmolLM2 at T=1
  (G=8, an earlier epoch as context) its first draft is accepted 0.218 of the time instead
  of 0.190. Greedy siblings are copies of the row, so there the latest (a sibling ahead,
  at the same place) is the better source."""
  drafts, matched = _continuations(context, 1, depth, config, own_first)
  return drafts[:, 0], matched[:, 0]


def propose_tree(context: DraftContext, depth: int, topk: int, nodes: int,
                 config: NgramConfig, own_first: bool = False
                 ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """A tree of `nodes` drafts below the root: the trie of the continuations of each row's
  `nodes` best matches, where a node's weight is how many of them pass through it. Each
  node keeps its `topk` heaviest children (heaviest tried first), and the heaviest nodes
  fill the budget (a parent weighs at least as much as its child, so every kept node's
  parent is kept). Where the trie has fewer nodes, the rest repeat the first child of the
  root: tried after it, a point mass on a rejected token is rejected in turn.

  Returns tokens, depths (1..depth), parents (verify index: 0 is the root, node i is
  verify index i + 1) [B, nodes] each, and ancestors [B, nodes, nodes] (each node's
  ancestors below the root, itself included), in verify order: by depth, siblings
  heaviest first; and the best match's length [B] (0: none). own_first: as
  `propose_chain`'s, for which matches are gathered first."""
  # [B, K, D], [B, K]
  drafts, matched = _continuations(context, nodes, depth, config, own_first)
  found = matched > 0
  b, k, _ = drafts.shape
  # same[b, n, m, d]: candidates n and m agree on their first d + 1 tokens.
  same = jnp.cumprod(drafts[:, :, None, :] == drafts[:, None, :, :], axis=-1).astype(bool)
  same = same & found[:, :, None, None] & found[:, None, :, None]
  first = jnp.argmax(same, axis=2)                                    # [B, K, D]: node id
  weight = jnp.sum(same, axis=2)                                      # [B, K, D]
  is_node = (first == jnp.arange(k)[None, :, None]) & found[:, :, None]
  # The node (n, d)'s parent is (first[n, d - 1], d - 1); the root's children have -1.
  parent = jnp.concatenate([jnp.full((b, k, 1), -1), first[..., :-1]], axis=-1)
  level = jnp.arange(depth)
  # heavier[b, n, m, d]: candidate m's node outweighs n's (at equal weight, the earlier).
  w_n, w_m = weight[:, :, None], weight[:, None, :]
  earlier = (jnp.arange(k)[None, :] < jnp.arange(k)[:, None])[None, :, :, None]
  heavier = (w_m > w_n) | ((w_m == w_n) & earlier)
  siblings = is_node[:, None] & (parent[:, None] == parent[:, :, None])
  kept = is_node & (jnp.sum(siblings & heavier, axis=2) < topk)
  keep = [kept[..., 0]]
  for d in range(1, depth):          # a node is kept only under a kept parent
    keep.append(kept[..., d] & jnp.take_along_axis(keep[-1], first[..., d - 1], axis=1))
  kept = jnp.stack(keep, axis=-1)
  # Heavier first; at equal weight the shallower (a parent before its child).
  priority = jnp.where(kept, weight * (depth + 1) - level, -1).reshape(b, k * depth)
  top, sel = jax.lax.top_k(priority, nodes)                           # [B, nodes]
  real = top >= 0
  order = jnp.argsort(jnp.where(real, sel % depth, depth), axis=1, stable=True)
  sel, real = jnp.take_along_axis(sel, order, axis=1), jnp.take_along_axis(real, order, axis=1)
  flat = lambda x: jnp.take_along_axis(x.reshape(b, k * depth), sel, axis=1)
  parent_id = flat(parent * depth + level - 1)                        # its n * depth + d
  parents = jnp.where(parent_id < 0, 0, jnp.argmax(
      sel[:, None, :] == parent_id[:, :, None], axis=-1) + 1)
  # Node j is an ancestor of node i, or i itself: i's candidate agrees with j's through
  # j's depth, and j is not deeper.
  rows = jnp.take_along_axis(same.reshape(b, k, k * depth), (sel // depth)[..., None], axis=1)
  ancestors = jnp.take_along_axis(rows, sel[:, None, :], axis=2)
  depths = sel % depth + 1
  ancestors = ancestors & (depths[:, None, :] <= depths[:, :, None])
  # Padding nodes: the first child of the root again, attending to itself alone.
  eye = jnp.eye(nodes, dtype=bool)[None]
  tokens = flat(drafts)
  tokens = jnp.where(real, tokens, tokens[:, :1])
  return (tokens, jnp.where(real, depths, 1), jnp.where(real, parents, 0),
          jnp.where(real[:, :, None], ancestors & real[:, None, :], eye), matched[:, 0])


def append(context: DraftContext, tokens: jax.Array, counts: jax.Array) -> DraftContext:
  """Appends each row's first counts[b] of tokens [B, T] to its own entry (rows that
  emitted nothing, finished or padding, write nothing)."""
  num_entries = context.tokens.shape[0]
  own = context.members[:, 0]
  writes = (own >= 0)[:, None] & (jnp.arange(tokens.shape[1])[None, :] < counts[:, None])
  start = context.lengths[jnp.maximum(own, 0)]
  rows = jnp.where(writes, own[:, None], num_entries)                 # out of range: dropped
  positions = start[:, None] + jnp.arange(tokens.shape[1])[None, :]
  return context.replace(
      tokens=context.tokens.at[rows, positions].set(tokens, mode="drop"),
      lengths=context.lengths.at[jnp.where(own >= 0, own, num_entries)].add(counts,
                                                                              mode="drop"))

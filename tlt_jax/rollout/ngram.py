"""Model-free drafting: each row's longest recent-suffix match in its group's own text.

A row drafts from a set of entries of a token pool: its own prompt and output so far, those
of the other rows of its group (GRPO samples of one prompt repeat each other's formulas and
steps, and siblings ahead of it have already written what it is about to), and extra token
lists from the caller (earlier epochs' responses to the prompt). Each verify step matches
the row's last `max_ngram` tokens against every position of those entries, takes the
longest match (then the latest position: recent text predicts best, and a sibling ahead of
the row has later positions; under sampling, first one in the row's own text), and
proposes the tokens that follow it as a chain, repeating them when the chain outruns them
(a row that cycles, matched in its own text, continues the cycle); or, for a tree, grows
each node's children from the matches of the row's text followed by the node's path, and
keeps the paths most likely by the weighted share of those matches each child has
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


def _own_suffix(context: DraftContext, n: int) -> jax.Array:
  """[B, n]: each row's last n tokens, the latest first (-1 before its text's start)."""
  own = jnp.maximum(context.members[:, 0], 0)
  back = context.lengths[own][:, None] - 1 - jnp.arange(n)[None, :]
  suffix = jnp.take_along_axis(context.tokens[own], jnp.maximum(back, 0), axis=1)
  return jnp.where(back >= 0, suffix, -1)


def _member_tokens(context: DraftContext) -> jax.Array:
  """[B, M, L]: the entries each row reads (a padding member reads entry 0, length 0)."""
  return context.tokens[jnp.maximum(context.members, 0)]


def _member_lengths(context: DraftContext) -> jax.Array:
  """[B, M]: the length of each entry a row reads (0: padding)."""
  return jnp.where(context.members >= 0, context.lengths[jnp.maximum(context.members, 0)], 0)


def propose_chain(context: DraftContext, depth: int, config: NgramConfig,
                  own_first: bool = False) -> tuple[jax.Array, jax.Array]:
  """[B, depth] drafts: the tokens after each row's best suffix match among its members
  (longest; with own_first, then the row's own text; then latest), repeating them when the
  chain outruns them (a row that cycles goes on); and the match's length [B] (0: none),
  which predicts how often the chain is accepted. A row with no match drafts whatever the
  clipped gather gives: a wrong draft costs its verify slot, never exactness.

  own_first (for sampling): of equally long matches, one in the row's own text before the
  latest elsewhere. A sampled row goes on wording things its own way: on SmolLM2 at T=1
  (G=8, an earlier epoch as context) its first draft is accepted 0.218 of the time instead
  of 0.190. Greedy siblings are copies of the row, so there the latest (a sibling ahead,
  at the same place) is the better source."""
  length = context.tokens.shape[1]
  suffix = _own_suffix(context, config.max_ngram)
  entries = _member_tokens(context)                                   # [B, M, L]
  # match[b, m, j]: how many of the row's last tokens end at position j of member m.
  match = jnp.zeros(entries.shape, jnp.int32)
  running = jnp.ones(entries.shape, bool)
  for k in range(config.max_ngram):
    shifted = jnp.pad(entries, ((0, 0), (0, 0), (k, 0)), constant_values=-1)[..., :length]
    running = running & (shifted == suffix[:, k, None, None])
    match = match + running
  following = _member_lengths(context)[..., None] - 1 - jnp.arange(length)
  is_own = (jnp.arange(entries.shape[1]) == 0)[:, None] & own_first
  score = jnp.where((match > 0) & (following > 0),
                    (2 * match + is_own) * length + jnp.arange(length), -1)
  b = entries.shape[0]
  score, following = score.reshape(b, -1), following.reshape(b, -1)
  best = argmax(score)[:, None]
  period = jnp.maximum(jnp.take_along_axis(following, best, axis=1), 1)
  # A match near the end of its text continues cyclically (a row that cycles goes on).
  after = best + 1 + jnp.arange(depth) % period                       # within its member
  drafts = jnp.take_along_axis(entries.reshape(b, -1), after, axis=1)
  best_score = jnp.take_along_axis(score, best, axis=1)[:, 0]
  return drafts, jnp.where(best_score >= 0, best_score // length // 2, 0)


# A tree node's children are counted from the latest `_TREE_MATCHES` occurrences of its
# last token, a match one token longer counting `_LONGER_MATCH_WEIGHT` times as much.
# SmolLM2 T=1 in-step replay, tokens per step: 128 occurrences add 0.1%, and the 64 with
# the longest matches instead of the latest the same; a weight of 8 against 1, +1.5% at
# 64 nodes, and 32 the same as 8.
_TREE_MATCHES = 64
_LONGER_MATCH_WEIGHT = 8.0


def _occurrences(context: DraftContext) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The positions of a row's members that have a token after them, sorted by token, then
  by position (the latest last; the rest sort after them all): their tokens and flat
  indices [B, M * L]; and the members' tokens, flattened [B, M * L]."""
  length = context.tokens.shape[1]
  entries = _member_tokens(context)
  b, m, _ = entries.shape
  has_next = jnp.arange(length) < _member_lengths(context)[..., None] - 1
  key = jnp.where(has_next, entries, jnp.iinfo(jnp.int32).max).reshape(b, -1)
  position = jnp.broadcast_to(jnp.arange(length), (b, m, length)).reshape(b, -1)
  flat = jnp.broadcast_to(jnp.arange(m * length), (b, m * length))
  tokens, _, index = jax.lax.sort((key, position, flat), dimension=1, num_keys=3)
  return tokens, index, entries.reshape(b, -1)


def _children(occurrences, length: int, window, log_prob, topk: int, width: int):
  """The next level of a tree from its frontier's last `max_ngram` tokens [B, F, n] (the
  row's text then the node's path, the latest first; -1 before the text) and path
  log-probs [B, F]: a node's children are the tokens after the latest occurrences of its
  last token, each weighing `_LONGER_MATCH_WEIGHT` to the length of the suffix it
  matches, a child's estimated probability its share; at most `topk` a node (at equal
  share, the one seen latest first: recent text predicts best), and the level keeps the
  `width` likeliest paths. Returns their tokens, log-probs (-inf: none) and parents
  [B, width], and each frontier node's longest match among those occurrences [B, F]
  (0: none)."""
  sorted_tokens, index, flat = occurrences
  b, _, n = window.shape
  search = jax.vmap(lambda a, v: jnp.searchsorted(a, v, side="right"))
  end = search(sorted_tokens, window[..., 0])                         # [B, F]
  slot = end[..., None] - 1 - jnp.arange(_TREE_MATCHES)               # [B, F, C], latest first
  found = (slot >= 0) & (jnp.take_along_axis(sorted_tokens[:, None], jnp.maximum(slot, 0),
                                             axis=2) == window[..., :1])
  at = jnp.take_along_axis(index[:, None], jnp.maximum(slot, 0), axis=2)
  matched = jnp.ones(at.shape, jnp.int32)
  running = found
  for k in range(1, n):   # the suffix it ends, back within its member
    before = jnp.take_along_axis(flat[:, None], jnp.maximum(at - k, 0), axis=2)
    running = running & (at % length >= k) & (before == window[..., k:k + 1])
    matched = matched + running
  nexts = jnp.take_along_axis(flat[:, None], jnp.minimum(at + 1, flat.shape[1] - 1), axis=2)
  longest = jnp.max(jnp.where(found, matched, 0), axis=2)              # [B, F]
  # Relative to the node's longest match, so the weights neither overflow nor vanish.
  weight = jnp.where(found, _LONGER_MATCH_WEIGHT ** (matched - longest[..., None]).astype(
      jnp.float32), 0.0)
  same = (nexts[..., :, None] == nexts[..., None, :]) & found[..., None, :]
  more_recent = jnp.tril(jnp.ones((_TREE_MATCHES,) * 2, bool), -1)
  latest_of_token = found & ~jnp.any(same & more_recent, axis=-1)
  share = jnp.sum(jnp.where(same, weight[..., None, :], 0.0), axis=-1) / jnp.maximum(
      jnp.sum(weight, axis=-1, keepdims=True), 1.0)
  child = jnp.where(latest_of_token, log_prob[..., None] + jnp.log(
      jnp.where(latest_of_token, share, 1.0)), -jnp.inf)
  per_node = min(topk, _TREE_MATCHES)
  child, pick = jax.lax.top_k(child, per_node)                        # [B, F, K]
  tokens = jnp.take_along_axis(nexts, pick, axis=2).reshape(b, -1)
  child, pick = jax.lax.top_k(child.reshape(b, -1), width)
  return jnp.take_along_axis(tokens, pick, axis=1), child, pick // per_node, longest


def propose_tree(context: DraftContext, depth: int, topk: int, nodes: int,
                 config: NgramConfig
                 ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
  """A tree of `nodes` drafts below the root, grown level by level from the group's text:
  a node's children are the tokens that followed the latest occurrences of its last token,
  each counting more the longer the suffix of the row's text and the node's path (the
  drafts above it) it ends (`_children`), and a child's estimated probability is its
  share; at most `topk` children a node. The tree holds the `nodes` paths of highest
  estimated probability (a path is never likelier than its parent, so each kept node's
  parent is kept). Matching again at every node, not following the root's matches alone,
  a node's children include what followed its token elsewhere in the text: SmolLM2 T=1
  in-step replay (G=8, two prompt sets), tokens per step +3% at 64 nodes, +5% at 256,
  over the trie of the root's matches' continuations. Where fewer paths exist, the rest
  repeat the first child of the root: tried after it, a point mass on a rejected token is
  rejected in turn.

  Returns tokens, depths (1..depth), parents (verify index: 0 is the root, node i is
  verify index i + 1) [B, nodes] each, and ancestors [B, nodes, nodes] (each node's
  ancestors below the root, itself included), in verify order: by depth, then likeliest
  first; and the root's longest suffix match among the `_TREE_MATCHES` latest
  occurrences of the row's last token [B] (0: none)."""
  occurrences = _occurrences(context)
  b = context.members.shape[0]
  window, log_prob = _own_suffix(context, config.max_ngram)[:, None], jnp.zeros((b, 1))
  paths = jnp.zeros((b, 1, 0), jnp.int32)   # each frontier node's slot on each level so far
  levels = []
  for depth_above in range(depth):
    width = min(nodes, window.shape[1] * min(topk, _TREE_MATCHES))
    tokens, log_prob, parent, longest = _children(occurrences, context.tokens.shape[1],
                                                  window, log_prob, topk, width)
    if depth_above == 0:
      root_match = longest[:, 0]
    window = jnp.concatenate([tokens[..., None], jnp.take_along_axis(
        window, parent[..., None], axis=1)[..., :-1]], axis=2)
    paths = jnp.concatenate([jnp.take_along_axis(paths, parent[..., None], axis=1),
                             jnp.broadcast_to(jnp.arange(width), (b, width))[..., None]],
                            axis=2)
    levels.append((tokens, log_prob,
                   jnp.pad(paths, ((0, 0), (0, 0), (0, depth - depth_above - 1)))))
  widths = [level_tokens.shape[1] for level_tokens, _, _ in levels]
  spare = max(nodes - sum(widths), 0)       # a budget past every level: padding slots
  levels.append((jnp.zeros((b, spare), jnp.int32), jnp.full((b, spare), -jnp.inf),
                 jnp.zeros((b, spare, depth), jnp.int32)))
  widths[-1] += spare
  tokens, log_prob, paths = (jnp.concatenate(x, axis=1) for x in zip(*levels))
  slot_level = jnp.asarray(np.repeat(np.arange(depth), widths))
  slot_beam = jnp.asarray(np.concatenate([np.arange(w) for w in widths]))
  offsets = jnp.asarray(np.cumsum([0] + widths[:-1]))
  # Likeliest first; at equal log-prob the shallower (top_k: the lower slot), a parent
  # before its child. Then in verify order, by depth.
  top, sel = jax.lax.top_k(log_prob, nodes)
  real = top > -jnp.inf
  order = jnp.argsort(jnp.where(real, slot_level[sel], depth), axis=1, stable=True)
  sel, real = (jnp.take_along_axis(x, order, axis=1) for x in (sel, real))
  level, beam = slot_level[sel], slot_beam[sel]
  path = jnp.take_along_axis(paths, sel[..., None], axis=1)           # [B, nodes, depth]
  above = jnp.maximum(level - 1, 0)
  parent_slot = jnp.where(level > 0, offsets[above] + jnp.take_along_axis(
      path, above[..., None], axis=2)[..., 0], -1)
  parents = jnp.where(parent_slot < 0, 0, jnp.argmax(
      sel[:, None, :] == parent_slot[:, :, None], axis=-1) + 1)
  # Node j is an ancestor of node i, or i itself: i's path passes j's slot on j's level.
  through = jnp.einsum("bid,bjd->bij", path, jax.nn.one_hot(level, depth, dtype=jnp.int32))
  ancestors = (through == beam[:, None, :]) & (level[:, None, :] <= level[:, :, None])
  tokens = jnp.take_along_axis(tokens, sel, axis=1)
  eye = jnp.eye(nodes, dtype=bool)[None]
  return (jnp.where(real, tokens, tokens[:, :1]), jnp.where(real, level + 1, 1),
          jnp.where(real, parents, 0),
          jnp.where(real[:, :, None], ancestors & real[:, None, :], eye), root_match)


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

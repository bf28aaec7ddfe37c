"""Model-free drafting: each row's longest recent-suffix match in its group's own text.

A row drafts from a set of entries of a token pool: its own prompt and output so far, those
of the other rows of its group (GRPO samples of one prompt repeat each other's formulas and
steps, and siblings ahead of it have already written what it is about to), and extra token
lists from the caller (earlier epochs' responses to the prompt). Each verify step matches
the row's last `max_ngram` tokens against every position of those entries, takes the
longest match (then the latest position: recent text predicts best, and a sibling ahead of
the row has later positions), and proposes the tokens that follow it as a chain, repeating
them when the chain outruns them (a row that cycles, matched in its own text, continues
the cycle). The draft is a point mass that depends only on text
emitted in earlier steps, never on this step's draws, so verification stays exact
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


def propose_chain(context: DraftContext, depth: int, config: NgramConfig) -> jax.Array:
  """[B, depth] drafts: the tokens after each row's best suffix match among its members.

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
  score = jnp.where(usable, match * length + position, -1).reshape(entries.shape[0], -1)
  best = argmax(score)
  member, end = best // length, best % length
  chosen = jnp.take_along_axis(entries, member[:, None, None], axis=1)[:, 0]   # [B, L]
  period = jnp.maximum(jnp.take_along_axis(following.reshape(score.shape), best[:, None],
                                           axis=1), 1)
  after = end[:, None] + 1 + jnp.arange(depth)[None, :] % period
  return jnp.take_along_axis(chosen, jnp.clip(after, 0, length - 1), axis=1)


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

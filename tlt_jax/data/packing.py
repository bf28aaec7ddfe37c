"""Packs variable-length samples into fixed [rows, seq_len] training rows (drafter and policy).

Fixed shapes keep a train step to one compiled program per row count. Each sample in a row keeps its
own segment id, its positions restart at 0 and attention is block-diagonal causal, so a
packed row computes exactly what each sample would alone (the reference implementation let
packed samples attend to one another). Pure numpy: packing runs on the host.
"""
from __future__ import annotations

from typing import Sequence

import flax.struct
import numpy as np

from tlt_jax.errors import UserInputError
from tlt_jax.reference_ops import block_causal_mask


@flax.struct.dataclass
class PackedRows:
  """Rows of packed samples; a pytree, so `jax.tree.map(lambda a: a[idx], rows)` batches."""
  tokens: np.ndarray       # [R, T] int32; 0 on padding
  positions: np.ndarray    # [R, T] int32; position within the sample
  segment_ids: np.ndarray  # [R, T] int32; 1, 2, ... per sample in the row, 0 on padding
  loss_mask: np.ndarray    # [R, T] float32; 1 on drafter slots j whose input x_{j+1} is a
                           # response token of the same sample

  @property
  def num_rows(self) -> int:
    return self.tokens.shape[0]

  @property
  def new_mask(self):
    """[R, T, T] block-diagonal causal mask (numpy or jax, as the fields are)."""
    return block_causal_mask(self.segment_ids)


def response_slots(length: int, prompt_len: int) -> range:
  """Drafter slots j (consuming h_j, x_{j+1}) trained for a sample: x_{j+1} is a response
  token, which is exactly the slots a rollout drafts from."""
  return range(max(prompt_len - 1, 0), length - 1)


class FirstFit:
  """Fills rows of `seq_len` slots first fit, one sample at a time; `rows` is the layout
  so far: rows of (sample index, start slot). With `max_rows`, a sample that fits in none
  of them is refused."""

  def __init__(self, seq_len: int, max_rows: int | None = None):
    self.seq_len, self.max_rows = seq_len, max_rows
    self.rows: list[list[tuple[int, int]]] = []
    self._used: list[int] = []

  def place(self, index: int, length: int) -> bool:
    """Puts sample `index` of `length` <= seq_len slots in the first row with room."""
    slot = next((r for r, taken in enumerate(self._used) if taken + length <= self.seq_len),
                None)
    if slot is None:
      if self.max_rows is not None and len(self.rows) == self.max_rows:
        return False
      self.rows.append([])
      self._used.append(0)
      slot = len(self.rows) - 1
    self.rows[slot].append((index, self._used[slot]))
    self._used[slot] += length
    return True


def place_samples(lengths: Sequence[int], seq_len: int) -> list[list[tuple[int, int]]]:
  """First-fit decreasing: rows of (sample index, start slot); every length <= seq_len.

  Longest first (ties keep their order), so the layout is deterministic in the lengths."""
  fit = FirstFit(seq_len)
  for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
    fit.place(i, lengths[i])
  return fit.rows


def pack_samples(samples: Sequence[tuple[Sequence[int], int]], seq_len: int) -> PackedRows:
  """Packs (token_ids, prompt_len) samples first-fit, longest first.

  Samples longer than `seq_len` keep their first `seq_len` tokens; samples left without a
  response token are dropped.
  """
  if seq_len < 2:
    raise UserInputError(f"--seq_len={seq_len}: must be >= 2")
  kept = []
  for ids, prompt_len in samples:
    ids = list(ids)[:seq_len]
    if prompt_len < len(ids):
      kept.append((ids, prompt_len))
  if not kept:
    raise UserInputError("drafter corpus: no sample has a response token to train on")
  return layout_rows(kept, place_samples([len(ids) for ids, _ in kept], seq_len), seq_len)


def layout_rows(samples: Sequence[tuple[Sequence[int], int]],
                layout: Sequence[Sequence[tuple[int, int]]], seq_len: int,
                num_rows: int | None = None) -> PackedRows:
  """PackedRows holding (token_ids, prompt_len) samples where `layout` (rows of (sample
  index, start slot), as `place_samples` returns) puts them; rows past the layout's, up to
  `num_rows`, are padding."""
  shape = (len(layout) if num_rows is None else num_rows, seq_len)
  tokens, positions, segment_ids = (np.zeros(shape, np.int32) for _ in range(3))
  loss_mask = np.zeros(shape, np.float32)
  for r, row in enumerate(layout):
    for segment, (i, start) in enumerate(row, start=1):
      ids, prompt_len = samples[i]
      end = start + len(ids)
      tokens[r, start:end] = ids
      positions[r, start:end] = np.arange(len(ids))
      segment_ids[r, start:end] = segment
      slots = response_slots(len(ids), prompt_len)
      loss_mask[r, start + slots.start:start + slots.stop] = 1.0
  return PackedRows(tokens=tokens, positions=positions, segment_ids=segment_ids,
                    loss_mask=loss_mask)

"""Training rows for the policy: a step's responses packed into fixed [rows, seq_len] rows.

Padding is pure waste on a FLOP-bound trainer, so (prompt + response) samples are packed
first-fit (`data.packing.place_samples`) with segment ids; slot j of a row scores the token
at j + 1, so a response token k of a sample starting at slot s with prompt length p is
scored at slot s + p - 1 + k. Per-token fields (advantages, log-probs, weights) live on
the host per sequence and are scattered into whichever layout a pass uses, so the old and
reference log-probs computed over one layout serve mini-batches packed another way.
Micro-batches are `micro_rows` rows; the last is padded to a power of two (and to a
multiple of the data shards). A layout's rows are one of four lengths (quarters of the
longest, `row_lengths`): `pack_tight` takes the one that computes the fewest slots, so a
step whose trained samples are short does not pay for rows sized to the longest the run
allows. The train programs are keyed by a small, known set of (row count, row length)
shapes. Only response slots need the LM head (a fifth of a small model's FLOPs per token),
so each micro-batch lists them in `scored_slots`, padded to a quarter-step of its slot
count (`scored_slot_count`). With several data shards (`sharding.data_parallel`) a
micro-batch's rows split evenly over them, and `scored_slots` holds one equal-sized block
per shard, each indexing its shard's own rows.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

import flax.struct
import numpy as np

from tlt_jax.data.packing import place_samples
from tlt_jax.errors import UserInputError


@flax.struct.dataclass
class TrainRows:
  """One micro-batch of packed rows; every per-token field is at the scoring slot."""
  tokens: np.ndarray          # [R, T] int32
  positions: np.ndarray       # [R, T] int32, restart at 0 per sample
  segment_ids: np.ndarray     # [R, T] int32, 0 on padding
  advantages: np.ndarray      # [R, T] float32
  old_logp: np.ndarray        # [R, T] float32: the ratio's denominator
  rollout_logp: np.ndarray    # [R, T] float32: what the rollout engine reported
  ref_logp: np.ndarray        # [R, T] float32: reference policy (zeros without KL)
  loss_weights: np.ndarray    # [R, T] float32: aggregation weight, 0 outside the loss
  metric_weights: np.ndarray  # [R, T] float32: mask / tokens in the mini-batch
  scored_slots: np.ndarray    # [K] int32: flat slots (r * T + t) that score a response
                              # token, padded out of range (dropped); one block of K /
                              # shards per data shard, r counted within the shard


# TrainRows' float per-token fields, scattered from the host's per-sequence values.
_PER_TOKEN_VALUES = tuple(name for name in TrainRows.__dataclass_fields__
                          if name not in ("tokens", "positions", "segment_ids", "scored_slots"))


@dataclasses.dataclass(frozen=True)
class Sequences:
  """A step's samples on the host: prompt + response ids and per-response-token values."""
  prompts: Sequence[Sequence[int]]
  responses: Sequence[Sequence[int]]

  def __post_init__(self):
    if len(self.prompts) != len(self.responses):
      raise ValueError("Sequences: one prompt per response")

  def __len__(self) -> int:
    return len(self.responses)

  def length(self, i: int) -> int:
    return len(self.prompts[i]) + len(self.responses[i])


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where each sample of `indices` (indices into a `Sequences`) sits: row and start."""
  indices: tuple[int, ...]
  rows: np.ndarray     # [n] row of each sample
  starts: np.ndarray   # [n] first slot of each sample
  num_rows: int
  seq_len: int


def pack(sequences: Sequences, indices: Sequence[int], seq_len: int) -> Layout:
  """Places samples `indices` first-fit into rows of `seq_len` slots."""
  lengths = [sequences.length(i) for i in indices]
  too_long = [i for i, n in zip(indices, lengths) if n > seq_len]
  if too_long:
    raise UserInputError(f"training rows: sample {too_long[0]} has "
                         f"{sequences.length(too_long[0])} tokens, more than the row length "
                         f"{seq_len} (raise --train_seq_len)")
  rows, starts = np.zeros(len(indices), np.int64), np.zeros(len(indices), np.int64)
  placement = place_samples(lengths, seq_len)
  for r, row in enumerate(placement):
    for k, start in row:
      rows[k], starts[k] = r, start
  return Layout(tuple(indices), rows, starts, len(placement), seq_len)


ROW_LENGTH_MULTIPLE = 64   # a tile multiple on accelerators


def row_lengths(seq_len: int) -> list[int]:
  """The lengths a layout's rows may have: quarters of `seq_len`, rounded up to a multiple
  of ROW_LENGTH_MULTIPLE, `seq_len` at most."""
  return sorted({min(seq_len, -(-k * seq_len // 4 // ROW_LENGTH_MULTIPLE) * ROW_LENGTH_MULTIPLE)
                 for k in range(1, 5)})


def pack_tight(sequences: Sequences, indices: Sequence[int], seq_len: int, micro_rows: int,
               shards: int = 1) -> Layout:
  """`pack` into rows of whichever of `row_lengths(seq_len)` computes the fewest slots,
  counting the padding rows `row_counts` adds (ties: the shorter rows, whose attention
  costs less)."""
  longest = max((sequences.length(i) for i in indices), default=0)
  best = None
  for length in row_lengths(seq_len):
    if length >= longest:
      layout = pack(sequences, indices, length)
      slots = sum(row_counts(layout.num_rows, micro_rows, shards)) * length
      if best is None or slots < best[0]:
        best = (slots, layout)
  return best[1] if best else pack(sequences, indices, seq_len)


def response_slots(layout: Layout, sequences: Sequences, k: int) -> np.ndarray:
  """Flat slots (row * seq_len + slot) that score sample k's response tokens."""
  i = layout.indices[k]
  first = layout.rows[k] * layout.seq_len + layout.starts[k] + len(sequences.prompts[i]) - 1
  return first + np.arange(len(sequences.responses[i]))


def _padded(rows: int, micro_rows: int, shards: int) -> int:
  """A last micro-batch of `rows` rows, padded to a power of two, then to a multiple of the
  data shards; `micro_rows` (a multiple of them) at most."""
  power = 1 << (rows - 1).bit_length()
  return min(micro_rows, -(-power // shards) * shards)


def row_counts(num_rows: int, micro_rows: int, shards: int = 1) -> list[int]:
  """Padded row counts of the micro-batches covering `num_rows` rows."""
  full, rest = divmod(num_rows, micro_rows)
  counts = [micro_rows] * full
  if rest:
    counts.append(_padded(rest, micro_rows, shards))
  return counts


def possible_row_counts(micro_rows: int, shards: int = 1) -> list[int]:
  """Every row count `row_counts` can produce: the train programs' batch shapes."""
  return sorted({_padded(rows, micro_rows, shards) for rows in range(1, micro_rows + 1)})


def scored_slot_count(response_slots: int, total_slots: int) -> int:
  """K for `scored_slots`: the smallest quarter of `total_slots` that holds them all."""
  quarter = -(-total_slots // 4)
  return min(total_slots, max(quarter, -(-response_slots // quarter) * quarter))


def possible_shapes(micro_rows: int, seq_len: int, shards: int = 1
                    ) -> list[tuple[int, int, int]]:
  """Every (row count, row length, scored slot count) a micro-batch of `pack_tight`'s
  layouts can have: the train programs' shapes."""
  shapes = set()
  for count in possible_row_counts(micro_rows, shards):
    for length in row_lengths(seq_len):
      total = count // shards * length       # one shard's slots
      quarter = -(-total // 4)
      shapes.update((count, length, shards * scored_slot_count(n, total))
                    for n in range(0, total + quarter, quarter))
  return sorted(shapes)


def empty_rows(count: int, seq_len: int, scored: int) -> TrainRows:
  """A micro-batch of `count` padding rows with `scored` (dropped) scored slots: what the
  train programs are compiled for."""
  zeros = lambda dtype: np.zeros((count, seq_len), dtype)
  fields = {name: zeros(np.float32) for name in _PER_TOKEN_VALUES}
  return TrainRows(tokens=zeros(np.int32), positions=zeros(np.int32),
                   segment_ids=zeros(np.int32),
                   scored_slots=np.full(scored, count * seq_len, np.int32), **fields)


def micro_batches(layout: Layout, sequences: Sequences, micro_rows: int,
                  per_token: dict[str, Sequence[np.ndarray]],
                  per_sequence: dict[str, np.ndarray], shards: int = 1
                  ) -> Iterator[TrainRows]:
  """The layout's rows as TrainRows micro-batches, each split evenly over `shards` data
  shards.

  per_token: field -> one array per sequence (aligned with its response tokens);
  per_sequence: field -> [num sequences] values broadcast over the response tokens."""
  counts = row_counts(layout.num_rows, micro_rows, shards)
  total = sum(counts)
  shape = (total, layout.seq_len)
  tokens, positions, segments = (np.zeros(shape, np.int32) for _ in range(3))
  fields = {name: np.zeros(shape, np.float32) for name in _PER_TOKEN_VALUES}
  scored = np.zeros(shape, bool).reshape(-1)
  flat = {name: a.reshape(-1) for name, a in fields.items()}
  for k, i in enumerate(layout.indices):
    r, s, n = layout.rows[k], layout.starts[k], sequences.length(i)
    tokens[r, s:s + n] = np.concatenate([sequences.prompts[i], sequences.responses[i]])
    positions[r, s:s + n] = np.arange(n)
    # Segment ids only need to differ between neighbours of a row: the sample's rank in it.
    segments[r, s:s + n] = k + 1
    slots = response_slots(layout, sequences, k)
    scored[slots] = True
    for name, values in per_token.items():
      flat[name][slots] = values[i]
    for name, values in per_sequence.items():
      flat[name][slots] = values[i]
  scored = scored.reshape(shape)
  start = 0
  for count in counts:
    rows = slice(start, start + count)
    yield TrainRows(tokens=tokens[rows], positions=positions[rows],
                    segment_ids=segments[rows],
                    scored_slots=_shard_slots(scored[rows], shards),
                    **{name: a[rows] for name, a in fields.items()})
    start += count


def _shard_slots(scored: np.ndarray, shards: int) -> np.ndarray:
  """`scored_slots` of a micro-batch whose scored slots are `scored` [R, T]: per data shard
  (R / shards rows each) its flat slots, padded to one size for all (`scored_slot_count`)
  with an index past its slots."""
  blocks = [np.flatnonzero(block) for block in np.split(scored, shards)]
  total = scored.size // shards
  size = scored_slot_count(max(len(b) for b in blocks), total)
  padded = np.full((shards, size), total, np.int32)
  for padded_block, block in zip(padded, blocks):
    padded_block[:len(block)] = block
  return padded.reshape(-1)


def gather_response_values(layout: Layout, sequences: Sequences,
                           row_values: Sequence[np.ndarray]) -> list[np.ndarray]:
  """Inverse of the scatter: per-slot values of the micro-batches (in order) -> one array
  per sequence of `layout`, indexed by sequence (others None)."""
  flat = np.concatenate([np.asarray(v).reshape(-1) for v in row_values])
  out: list[np.ndarray | None] = [None] * len(sequences)
  for k, i in enumerate(layout.indices):
    out[i] = flat[response_slots(layout, sequences, k)]
  return out

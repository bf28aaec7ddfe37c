"""The online drafter buffer: rollout responses with the target's hidden states, tagged with
their RL step, cut into training windows and drawn into packed batches.

Input, per response: `add(step, prompt_ids, response_ids, hidden_states)`, where hidden row
i is the target's last-layer output at input token i of prompt + response, for every token
fed to the target (the sequence's length, or one less: the last emitted token is never
fed). Rows beyond the tokens, or fewer than that, are a misalignment and raise.

Windows. Drafter slot j consumes (h_j, x_{j+1}) and predicts h_{j+1}; a sequence trains the
slots whose x_{j+1} is a response token (`packing.response_slots`). Those slots are cut in
order into chunks of at most `seq_len - 1 - context` slots; a chunk's window is the
`seq_len` tokens ending just after it (the whole prefix when shorter). So each response slot
is trained in exactly one window, with at least `context` tokens before it (all there are
when fewer). Windows are views of their sequence: overlapping windows store nothing twice,
and the prompt before the first window is not stored.

Sampling rule of `batch(step)`. Two pools: the current step's training windows (the early
finishers of the rollout in flight) and the previous steps' long ones (windows of the
sequences whose response length is at least the `long_quantile` quantile of their step's),
from the `replay_steps` steps before `step`: the one-step offset (replay_steps=1), so the
drafter, which serves the long tail, does not learn from short answers only; more steps give
a replica that holds few responses a step more to learn from. Another replica's long
responses, received at a step's end (`add_received`, what its `own_long` gave), are long
windows of their step too: never the current pool, never held out, never shared again
(they count toward `max_bytes`). Each pool is shuffled by an rng seeded with (seed,
batches drawn so far). Windows are then drawn one at a time, from the previous pool while
its share of the trained slots placed so far is below `previous_ratio` and from the
current pool otherwise, and placed first fit into `batch_rows` rows of `seq_len` tokens;
a window that fits nowhere is dropped from this batch. When one pool runs out the other
fills the rest; a ratio of 0 or 1 draws from one pool only, unless it is empty. No window
is used twice in a batch. Samples stay apart in the rows (segment ids, positions restarting
at 0) and only response slots carry loss.

Held out: sequence i of a step (in add order) is held out when
floor((i + 1) * heldout_fraction) > floor(i * heldout_fraction), an exact, even spread.
Training never draws held-out windows; `heldout(step)` packs them for evaluation (the
deploy gate compares drafters on the latest step's).

A response whose hidden states hold a NaN or Inf is not stored (counted in `stats()`): it
would spoil every batch that drew it.

Bound: after each add, while the bytes held (tokens + hidden states) exceed `max_bytes`,
the oldest step's oldest sequence is evicted. A new step expires every step more than
`replay_steps` before it, which `batch` can no longer draw. Both are counted in `stats()`.

Everything is deterministic given the seed and the calls made; `state_dict` /
`load_state_dict` (and `save_state` / `load_state` for files) restore it exactly.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import threading
from typing import Any, Callable, Sequence

import numpy as np

from tlt_jax.data.packing import FirstFit, PackedRows, layout_rows, place_samples
from tlt_jax.drafter.array_file import read_arrays, write_arrays
from tlt_jax.errors import UserInputError
from tlt_jax.files import write_atomic

ARRAYS_FILE = "buffer.npz"
META_FILE = "buffer.json"


@dataclasses.dataclass(frozen=True)
class BufferConfig:
  max_bytes: int = 1 << 30      # tokens + hidden states held, at most
  seq_len: int = 512            # tokens per window and per packed row
  batch_rows: int = 8           # packed rows per batch
  context: int = 64             # tokens a window keeps before its first trained slot
  previous_ratio: float = 0.5   # share of trained slots drawn from the previous steps
  long_quantile: float = 0.5    # previous-step sequences at least this long (quantile) are drawn
  replay_steps: int = 1         # previous steps drawn from (and kept)
  heldout_fraction: float = 0.05
  seed: int = 0

  def __post_init__(self):
    checks = (("max_bytes", self.max_bytes >= 1, ">= 1"),
              ("seq_len", self.seq_len >= 2, ">= 2"),
              ("batch_rows", self.batch_rows >= 1, ">= 1"),
              ("context", 0 <= self.context <= self.seq_len - 2, "in [0, seq_len - 2]"),
              ("previous_ratio", 0.0 <= self.previous_ratio <= 1.0, "in [0, 1]"),
              ("replay_steps", self.replay_steps >= 1, ">= 1"),
              ("long_quantile", 0.0 <= self.long_quantile <= 1.0, "in [0, 1]"),
              ("heldout_fraction", 0.0 <= self.heldout_fraction < 1.0, "in [0, 1)"))
    for name, ok, rule in checks:
      if not ok:
        raise UserInputError(f"drafter buffer {name}={getattr(self, name)}: must be {rule}")


@dataclasses.dataclass(frozen=True)
class Batch:
  rows: PackedRows          # [batch_rows, seq_len]
  hidden: np.ndarray        # [batch_rows, seq_len, E]: h at each token, 0 on padding
  current_slots: int        # trained slots drawn from the current step's windows
  previous_slots: int       # ... and from the previous steps'


@dataclasses.dataclass(frozen=True)
class _Sequence:
  """One stored response: tokens and hidden rows from its first window's start."""
  step: int
  index: int                # add order within its step
  tokens: np.ndarray        # [m] int32, read-only
  hidden: np.ndarray        # [m, E], read-only
  first_slot: int           # first trained slot, in stored coordinates
  response_len: int
  heldout: bool
  received: bool = False    # another replica's long response (`add_received`)

  @property
  def nbytes(self) -> int:
    return self.tokens.nbytes + self.hidden.nbytes


_Window = tuple[_Sequence, int, int, int]   # (sequence, start, end, first trained slot)


def window_bounds(length: int, first_slot: int, seq_len: int, context: int
                  ) -> list[tuple[int, int, int]]:
  """(start, end, first trained slot) of each window of a sequence of `length` tokens whose
  trained slots are first_slot .. length - 2 (see the module docstring)."""
  chunk = seq_len - 1 - context
  bounds = []
  for first in range(first_slot, length - 1, chunk):
    end = min(first + chunk, length - 1) + 1
    bounds.append((max(0, end - seq_len), end, first))
  return bounds


def is_heldout(index: int, fraction: float) -> bool:
  return int((index + 1) * fraction) > int(index * fraction)


class OnlineBuffer:
  """Windows of rollout responses by RL step; thread-safe (the rollout adds while a
  trainer draws)."""

  def __init__(self, config: BufferConfig):
    self.config = config
    self._lock = threading.Lock()
    self._steps: dict[int, list[_Sequence]] = {}   # ascending steps, add order within
    self._added: dict[int, int] = {}               # sequences ever added, per live step
    self._bytes = 0
    self._draws = 0
    self._counts = {"evicted_sequences": 0, "evicted_bytes": 0, "expired_sequences": 0,
                    "nonfinite_sequences": 0}

  # ---- adding -----------------------------------------------------------------------

  def add(self, step: int, prompt_ids: Sequence[int], response_ids: Sequence[int],
          hidden_states: Any) -> None:
    """Stores one response of RL step `step` (see the module docstring for the input)."""
    tokens = np.concatenate([np.asarray(prompt_ids, np.int32).reshape(-1),
                             np.asarray(response_ids, np.int32).reshape(-1)])
    hidden = np.asarray(hidden_states)
    n = _fed_length(len(tokens), hidden.shape)
    first = max(len(prompt_ids) - 1, 0)
    bounds = window_bounds(n, first, self.config.seq_len, self.config.context)
    with self._lock:
      self._check_hidden(hidden)
      if self._steps and step < max(self._steps) - self.config.replay_steps:
        self._counts["expired_sequences"] += 1
        return
      index = self._added.get(step, 0)
      self._added[step] = index + 1
      if not np.isfinite(hidden[:n]).all():
        self._counts["nonfinite_sequences"] += 1
        return
      if not bounds:
        return
      offset = bounds[0][0]
      sequence = _Sequence(step, index, _frozen(tokens[offset:n]), _frozen(hidden[offset:n]),
                           first - offset, len(response_ids),
                           is_heldout(index, self.config.heldout_fraction))
      self._insert(sequence)

  def _insert(self, sequence: _Sequence) -> None:
    step = sequence.step
    if step not in self._steps:
      self._steps[step] = []
      self._steps = dict(sorted(self._steps.items()))
      self._expire_before(max(self._steps) - self.config.replay_steps)
    self._steps[step].append(sequence)
    self._bytes += sequence.nbytes
    self._evict_to(self.config.max_bytes)

  def _evict_to(self, max_bytes: int) -> None:
    while self._bytes > max_bytes:
      oldest = next(iter(self._steps))
      sequence = self._steps[oldest].pop(0)
      self._bytes -= sequence.nbytes
      self._counts["evicted_sequences"] += 1
      self._counts["evicted_bytes"] += sequence.nbytes
      if not self._steps[oldest]:
        del self._steps[oldest]

  def _expire_before(self, step: int) -> None:
    for old in [s for s in self._steps if s < step]:
      sequences = self._steps.pop(old)
      self._counts["expired_sequences"] += len(sequences)
      self._bytes -= sum(s.nbytes for s in sequences)
    self._added = {s: n for s, n in self._added.items() if s >= step}

  def _check_hidden(self, hidden: np.ndarray) -> None:
    """Every add holds hidden rows of one width and dtype (a batch stacks them)."""
    for sequences in self._steps.values():
      if sequences:
        held = sequences[0].hidden
        if (held.shape[1], held.dtype) != (hidden.shape[1], hidden.dtype):
          raise ValueError(f"hidden states {hidden.shape[1]} x {hidden.dtype}: the buffer "
                           f"holds {held.shape[1]} x {held.dtype}")
        return

  # ---- drawing ----------------------------------------------------------------------

  def batch(self, step: int) -> Batch | None:
    """A training batch for RL step `step` by the sampling rule; None with nothing to draw."""
    with self._lock:
      current, previous = self._pools(step)
      if not current and not previous:
        return None
      rng = np.random.default_rng([self.config.seed, self._draws])
      self._draws += 1
    pools = {False: collections.deque(current[i] for i in rng.permutation(len(current))),
             True: collections.deque(previous[i] for i in rng.permutation(len(previous)))}
    ratio = self.config.previous_ratio
    fit = FirstFit(self.config.seq_len, self.config.batch_rows)
    windows, slots = [], {False: 0, True: 0}
    while pools[False] or pools[True]:
      use_previous = bool(pools[True]) and (
          not pools[False] or slots[True] < ratio * max(slots[False] + slots[True], 1))
      window = pools[use_previous].popleft()
      if fit.place(len(windows), window[2] - window[1]):
        windows.append(window)
        slots[use_previous] += _slots(window)
    return self._pack(windows, fit.rows, slots[False], slots[True])

  def trainable_slots(self, step: int) -> int:
    """Trained slots `batch(step)` can draw from: one epoch of RL step `step`'s data."""
    with self._lock:
      return sum(_slots(w) for pool in self._pools(step) for w in pool)

  def _pools(self, step: int) -> tuple[list[_Window], list[_Window]]:
    """(current, previous) windows `batch(step)` draws from; a pool weighted 0 is empty."""
    current = self._windows(step, heldout=False)
    previous = [w for back in range(self.config.replay_steps, 0, -1)
                for w in self._long_windows(step - back)]
    ratio = self.config.previous_ratio
    if current and previous and ratio in (0.0, 1.0):
      return (current, []) if ratio == 0.0 else ([], previous)
    return current, previous

  def heldout(self, step: int | None = None) -> list[Batch]:
    """The held-out windows of `step` (default: the latest) in batches of batch_rows rows."""
    with self._lock:
      if step is None:
        step = max(self._steps, default=0)
      windows = self._windows(step, heldout=True)
    layout = place_samples([end - start for _, start, end, _ in windows], self.config.seq_len)
    rows = self.config.batch_rows
    batches = []
    for at in range(0, len(layout), rows):
      part = layout[at:at + rows]
      batches.append(self._pack(windows, part,
                                sum(_slots(windows[i]) for row in part for i, _ in row), 0))
    return batches

  def _windows(self, step: int, heldout: bool) -> list[_Window]:
    """This replica's own training (or held-out) windows of `step`."""
    return [(s, *bounds) for s in self._steps.get(step, [])
            if s.heldout == heldout and not s.received for bounds in self._bounds(s)]

  def _long_windows(self, step: int) -> list[_Window]:
    """Training windows of `step`'s long sequences: this replica's own at least the
    long_quantile quantile of their lengths long, and every received one (another
    replica's long ones)."""
    return [(s, *bounds) for s in self._long_sequences(step) for bounds in self._bounds(s)]

  def _long_sequences(self, step: int) -> list[_Sequence]:
    sequences = self._steps.get(step, [])
    own = [s for s in sequences if not s.heldout and not s.received]
    threshold = (np.quantile([s.response_len for s in own], self.config.long_quantile,
                             method="higher") if own else 0)
    return [s for s in sequences
            if s.received or (not s.heldout and s.response_len >= threshold)]

  # ---- sharing between replicas -----------------------------------------------------

  def own_long(self, step: int, max_bytes: int) -> dict[str, np.ndarray]:
    """This replica's own long sequences of `step` (those `batch` replays), longest first
    while their bytes fit in `max_bytes`, as arrays for another replica's `add_received`."""
    with self._lock:
      own = [s for s in self._long_sequences(step) if not s.received]
    chosen, size = [], 0
    for s in sorted(own, key=lambda s: (-s.response_len, s.index)):
      if size + s.nbytes <= max_bytes:
        chosen.append(s)
        size += s.nbytes
    return _sequence_arrays(chosen)

  def add_received(self, arrays: dict[str, np.ndarray]) -> None:
    """Stores what another replica's `own_long` returned: drawn by later steps as long
    windows of their step, never as the current step's, never held out or shared again."""
    sequences = _sequences_from_arrays(arrays)
    with self._lock:
      for s in sequences:
        if s.step < max(self._steps, default=s.step) - self.config.replay_steps:
          self._counts["expired_sequences"] += 1
          continue
        self._check_hidden(s.hidden)
        self._insert(dataclasses.replace(s, heldout=False, received=True))

  def _bounds(self, sequence: _Sequence) -> list[tuple[int, int, int]]:
    return window_bounds(len(sequence.tokens), sequence.first_slot, self.config.seq_len,
                         self.config.context)

  def _pack(self, windows: list[_Window], layout, current_slots: int,
            previous_slots: int) -> Batch:
    config = self.config
    samples = [(s.tokens[start:end], first - start + 1) for s, start, end, first in windows]
    rows = layout_rows(samples, layout, config.seq_len, config.batch_rows)
    width, dtype = _hidden_kind(windows)
    hidden = np.zeros((config.batch_rows, config.seq_len, width), dtype)
    for r, row in enumerate(layout):
      for i, at in row:
        s, start, end, _ = windows[i]
        hidden[r, at:at + end - start] = s.hidden[start:end]
    return Batch(rows, hidden, current_slots, previous_slots)

  # ---- reporting and state ----------------------------------------------------------

  def stats(self) -> dict[str, int]:
    """Bytes held, the bound, sequences and windows held, evictions, expiries and
    responses refused for non-finite hidden states."""
    with self._lock:
      sequences = [s for seqs in self._steps.values() for s in seqs]
      windows = [(s.heldout, len(self._bounds(s))) for s in sequences]
      return {"bytes": self._bytes, "max_bytes": self.config.max_bytes,
              "sequences": len(sequences), "latest_step": max(self._steps, default=-1),
              "train_windows": sum(n for h, n in windows if not h),
              "heldout_windows": sum(n for h, n in windows if h),
              "batches_drawn": self._draws, **self._counts}

  def state_dict(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(JSON-able metadata, arrays): everything `load_state_dict` needs to continue exactly."""
    return self.snapshot()()

  def snapshot(self) -> Callable[[], tuple[dict[str, Any], dict[str, np.ndarray]]]:
    """Captures the state now, cheaply (stored sequences are immutable and shared); the
    returned call builds `state_dict()`'s arrays from it, e.g. on a writer thread."""
    with self._lock:
      sequences = [s for seqs in self._steps.values() for s in seqs]
      meta = {"config": dataclasses.asdict(self.config), "draws": self._draws,
              "added": {str(k): v for k, v in self._added.items()}, **self._counts}
    return lambda: (meta, _sequence_arrays(sequences))

  def load_state_dict(self, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    """Replaces this buffer's content with a saved one; its config must match this one's
    (max_bytes may differ: a smaller bound evicts at once)."""
    stored = BufferConfig(**meta["config"])
    for field in dataclasses.fields(BufferConfig):
      mine, theirs = getattr(self.config, field.name), getattr(stored, field.name)
      if field.name != "max_bytes" and mine != theirs:
        raise UserInputError(f"drafter buffer {field.name}={mine}: the saved buffer has "
                             f"{theirs}")
    sequences = _sequences_from_arrays(arrays)
    with self._lock:
      self._steps = {}
      for s in sequences:
        self._steps.setdefault(s.step, []).append(s)
      self._bytes = sum(s.nbytes for s in sequences)
      self._added = {int(k): v for k, v in meta["added"].items()}
      self._draws = meta["draws"]
      self._counts = {k: meta[k] for k in self._counts}
      self._evict_to(self.config.max_bytes)


def save_state(directory: str, state: tuple[dict[str, Any], dict[str, np.ndarray]]) -> None:
  """Writes a `state_dict()` into `directory` as ARRAYS_FILE and META_FILE, each
  atomically; the pair is one snapshot when `directory` itself is committed as a whole."""
  meta, arrays = state
  write_arrays(os.path.join(directory, ARRAYS_FILE), arrays)
  write_atomic(os.path.join(directory, META_FILE), json.dumps(meta, indent=1))


def load_state(directory: str, buffer: OnlineBuffer) -> None:
  """Loads what `save_state` wrote into `buffer`."""
  path = os.path.join(directory, META_FILE)
  try:
    with open(path) as f:
      meta = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise UserInputError(f"{path}: cannot read the drafter buffer ({e})") from None
  buffer.load_state_dict(meta, read_arrays(os.path.join(directory, ARRAYS_FILE)))


# ---- helpers -------------------------------------------------------------------------

def _fed_length(num_tokens: int, hidden_shape: tuple[int, ...]) -> int:
  """Tokens with a hidden row: all of them, or all but the last (never fed)."""
  if len(hidden_shape) != 2 or hidden_shape[0] not in (num_tokens - 1, num_tokens):
    raise ValueError(f"hidden states of shape {hidden_shape}: expected [n_fed, E] with n_fed "
                     f"{num_tokens - 1} or {num_tokens} for {num_tokens} prompt + response "
                     "tokens (row i = the target's output at input token i)")
  return hidden_shape[0]


def _frozen(a: np.ndarray) -> np.ndarray:
  out = np.array(a)     # a copy the caller cannot change
  out.flags.writeable = False
  return out


def _slots(window: _Window) -> int:
  _, _, end, first = window
  return end - 1 - first


def _hidden_kind(windows: list[_Window]) -> tuple[int, np.dtype]:
  """(width, dtype) of the hidden rows; float32 zeros of width 0 with no windows."""
  if not windows:
    return 0, np.dtype(np.float32)
  hidden = windows[0][0].hidden
  return hidden.shape[1], hidden.dtype


_FIELDS = ("step", "index", "first_slot", "response_len", "heldout", "received")


def _sequence_arrays(sequences: list[_Sequence]) -> dict[str, np.ndarray]:
  width, dtype = _hidden_kind([(s, 0, 0, 0) for s in sequences[:1]])
  arrays = {name: np.array([getattr(s, name) for s in sequences], np.int64) for name in _FIELDS}
  arrays["length"] = np.array([len(s.tokens) for s in sequences], np.int64)
  arrays["tokens"] = np.concatenate([np.zeros((0,), np.int32)] + [s.tokens for s in sequences])
  arrays["hidden"] = np.concatenate([np.zeros((0, width), dtype)] + [s.hidden for s in sequences])
  return arrays


def _sequences_from_arrays(arrays: dict[str, np.ndarray]) -> list[_Sequence]:
  ends = np.cumsum(arrays["length"])
  sequences = []
  for i, end in enumerate(ends):
    start = end - arrays["length"][i]
    values = {name: int(arrays[name][i]) for name in _FIELDS if name in arrays}
    values["heldout"] = bool(values["heldout"])
    values["received"] = bool(values.get("received", 0))   # absent in older buffers
    sequences.append(_Sequence(tokens=_frozen(arrays["tokens"][start:end]),
                               hidden=_frozen(arrays["hidden"][start:end]), **values))
  return sequences

"""RL prompt sets: tokenized, length-filtered, streamed by a resumable grain pipeline.

The training stream is a deterministic function of (prompts, batch size, seed); its state is
one small JSON dict, so a resumed run sees exactly the prompts an uninterrupted one would.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Any, Sequence

from tlt_jax.data.rl_sources import (ANSWER_INSTRUCTION, PromptRecord, TaskSpec, gym_records,
                                     load_prompt_file, parse_task_spec)
from tlt_jax.errors import UserInputError

__all__ = ["ANSWER_INSTRUCTION", "PromptItem", "PromptRecord", "PromptStream", "RLData",
           "RLRecords", "TaskSpec", "build_rl_data", "gym_records", "load_prompt_file",
           "load_rl_records", "parse_task_spec", "to_items", "tokenize_records",
           "tokenize_rl_data"]

_STATE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class PromptItem:
  """A tokenized prompt; `index` is its position in the prompt set it came from."""
  index: int
  prompt_ids: tuple[int, ...]
  record: PromptRecord


def tokenize_records(records: Sequence[PromptRecord], tokenizer: Any, max_prompt_len: int
                     ) -> tuple[list[tuple[PromptRecord, list[int]]], int]:
  """([(record, chat-template ids)] of prompts with <= max_prompt_len ids, number dropped)."""
  if max_prompt_len < 1:
    raise UserInputError(f"--max_prompt_len: must be >= 1, got {max_prompt_len}")
  kept = []
  for record in records:
    ids = list(tokenizer.apply_chat_template(record.messages(), add_generation_prompt=True))
    if len(ids) <= max_prompt_len:
      kept.append((record, ids))
  num_filtered = len(records) - len(kept)
  if not kept:
    raise UserInputError(f"--max_prompt_len={max_prompt_len}: none of the {len(records)} "
                         f"prompts fits ({num_filtered} longer); raise it or use shorter prompts")
  return kept, num_filtered


def to_items(pairs: Sequence[tuple[PromptRecord, Sequence[int]]]) -> list[PromptItem]:
  """A fixed list of items, e.g. the held-out validation set for greedy eval."""
  return [PromptItem(i, tuple(int(t) for t in ids), record)
          for i, (record, ids) in enumerate(pairs)]


class PromptStream:
  """Endless batches of `batch_size` distinct prompts; each epoch is a fresh seeded shuffle.

  grain: source -> shuffle(seed) -> batch(drop_remainder) -> repeat. Shuffle reseeds per
  epoch, batches never straddle epochs, and the `len % batch_size` prompts dropped differ
  from epoch to epoch. Batches are drawn on demand, so extra draws (DAPO) just advance it.
  """

  def __init__(self, pairs: Sequence[tuple[PromptRecord, Sequence[int]]], batch_size: int,
               seed: int):
    import grain
    if batch_size < 1:
      raise UserInputError(f"prompt batch size must be >= 1, got {batch_size}")
    if len(pairs) < batch_size:
      raise UserInputError(f"prompt batch size {batch_size} exceeds the {len(pairs)} training "
                           "prompts left after filtering")
    if not 0 <= seed < 2**32:
      raise UserInputError(f"--seed: must be in [0, 2**32), got {seed}")
    self.items = to_items(pairs)
    self.batch_size = batch_size
    self.seed = seed
    self.batches_per_epoch = len(self.items) // batch_size
    items = self.items
    dataset = (grain.MapDataset.source(range(len(items))).shuffle(seed=seed)
               .batch(batch_size, drop_remainder=True, batch_fn=list).repeat(None)
               .map(lambda indices: [items[i] for i in indices]))
    # In-memory data: no reader threads, so nothing runs ahead of the saved state.
    options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    self._iterator = iter(dataset.to_iter_dataset(options))

  def next_batch(self) -> list[PromptItem]:
    return next(self._iterator)

  @property
  def batches_drawn(self) -> int:
    return int(self._iterator.get_state()["next_index"])

  @property
  def epoch(self) -> int:
    return self.batches_drawn // self.batches_per_epoch

  def state(self) -> dict[str, Any]:
    """JSON-serializable; `restore` checks it belongs to a stream built the same way."""
    return {"version": _STATE_VERSION, "num_prompts": len(self.items),
            "batch_size": self.batch_size, "seed": self.seed,
            "grain": dict(self._iterator.get_state())}

  def restore(self, state: dict[str, Any]) -> None:
    expected = {"version": _STATE_VERSION, "num_prompts": len(self.items),
                "batch_size": self.batch_size, "seed": self.seed}
    for key, value in expected.items():
      if state.get(key) != value:
        raise UserInputError(f"resume: prompt stream state has {key}={state.get(key)!r} but "
                             f"this run has {value!r}; resume with the same data flags")
    self._iterator.set_state(dict(state["grain"]))


@dataclasses.dataclass(frozen=True)
class RLData:
  train: list[tuple[PromptRecord, list[int]]]  # feed to PromptStream
  val: list[PromptItem]  # fixed held-out set, possibly empty
  counts: dict[str, int]  # filtered / skipped tallies for the run log


@dataclasses.dataclass(frozen=True)
class RLRecords:
  train: list[PromptRecord]
  val: list[PromptRecord]
  counts: dict[str, int]  # bad rows skipped


def build_rl_data(*, tokenizer: Any, max_prompt_len: int, seed: int, tasks: str | None = None,
                  train_file: str | None = None, val_file: str | None = None,
                  num_train: int = 0, num_val: int = 0, on_bad_row: str = "fail") -> RLData:
  """Train pairs + validation items from `--tasks` or `--train_file`, all checked up front."""
  records = load_rl_records(seed=seed, tasks=tasks, train_file=train_file, val_file=val_file,
                            num_train=num_train, num_val=num_val, on_bad_row=on_bad_row)
  return tokenize_rl_data(records, tokenizer, max_prompt_len)


def load_rl_records(*, seed: int, tasks: str | None = None, train_file: str | None = None,
                    val_file: str | None = None, num_train: int = 0, num_val: int = 0,
                    on_bad_row: str = "fail") -> RLRecords:
  """The train / validation records, without a tokenizer: bad rows are reported before the
  model loads.

  Validation: `--val_file` if given, else `num_val` prompts from a separate seed (tasks) or
  held out of the train file by a seeded shuffle; its prompts never appear in training.
  """
  if (tasks is None) == (train_file is None):
    raise UserInputError("--tasks / --train_file: give exactly one")
  if num_val < 0:
    raise UserInputError(f"--num_val: must be >= 0, got {num_val}")
  counts = {"train_skipped": 0, "val_skipped": 0}
  val_records: list[PromptRecord] = []
  if val_file is not None:
    val_records, counts["val_skipped"] = load_prompt_file(val_file, on_bad_row)
  if tasks is not None:
    specs = parse_task_spec(tasks)
    if num_train < 1:
      raise UserInputError(f"--num_train: must be >= 1 with --tasks, got {num_train}")
    if val_file is None and num_val:
      val_records = gym_records(specs, num_val, seed, split="val")
    train_records = gym_records(specs, num_train, seed, split="train",
                                exclude=[r.key() for r in val_records])
  else:
    train_records, counts["train_skipped"] = load_prompt_file(train_file, on_bad_row)
    if val_file is None and num_val:
      if num_val >= len(train_records):
        raise UserInputError(f"--num_val: {num_val} leaves none of the {len(train_records)} "
                             f"rows of {train_file} for training")
      order = list(range(len(train_records)))
      random.Random(seed).shuffle(order)
      val_records = [train_records[i] for i in sorted(order[:num_val])]
      train_records = [train_records[i] for i in sorted(order[num_val:])]
    val_keys = {r.key() for r in val_records}
    train_records = [r for r in train_records if r.key() not in val_keys]
    if not train_records:
      raise UserInputError(f"{train_file}: every prompt is also in the validation set")
  return RLRecords(train=train_records, val=val_records, counts=counts)


def tokenize_rl_data(records: RLRecords, tokenizer: Any, max_prompt_len: int) -> RLData:
  """`records` tokenized, prompts over `max_prompt_len` dropped and counted."""
  counts = dict(records.counts)
  train, counts["train_filtered"] = tokenize_records(records.train, tokenizer, max_prompt_len)
  val_pairs, counts["val_filtered"] = ([], 0)
  if records.val:
    val_pairs, counts["val_filtered"] = tokenize_records(records.val, tokenizer, max_prompt_len)
  counts.update(num_train=len(train), num_val=len(val_pairs))
  return RLData(train=train, val=to_items(val_pairs), counts=counts)

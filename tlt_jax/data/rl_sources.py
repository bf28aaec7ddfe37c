"""RL prompt records from reasoning-gym generators or JSONL/parquet files, validated eagerly.

Every source yields `PromptRecord`s in the common RL schema (chat prompt, ground truth,
data source, extra info), so the learner and the reward workers see one format. Bad input
fails before training starts, with one line naming the flag, file, line and field.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import hashlib
import json
import os
import types
import typing
from typing import Any, Iterable, Sequence

from tlt_jax.errors import UserInputError

# Short enough for a 135M instruct model to follow; a fixed form a reward can parse.
ANSWER_INSTRUCTION = "\n\nPut the final answer in \\boxed{}."
BAD_ROW_MODES = ("fail", "skip")
# Generation and the reward worker set these themselves.
_RESERVED_TASK_KEYS = ("seed", "size")


@dataclasses.dataclass(frozen=True)
class PromptRecord:
  """One RL prompt: chat messages, the answer to check against, and where it came from."""
  prompt: tuple[dict[str, str], ...]
  ground_truth: str
  data_source: str
  extra_info: dict[str, Any] = dataclasses.field(default_factory=dict)

  def messages(self) -> list[dict[str, str]]:
    return [dict(m) for m in self.prompt]

  def key(self) -> tuple[tuple[str, str], ...]:
    """Identity of the prompt text, for keeping validation prompts out of training."""
    return tuple((m["role"], m["content"]) for m in self.prompt)


def json_safe(value: Any) -> Any:
  """A JSON round-trip-stable copy: tuples become lists, other objects their str."""
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  if isinstance(value, dict):
    return {str(k): json_safe(v) for k, v in value.items()}
  if isinstance(value, (list, tuple, set, frozenset)):
    items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
    return [json_safe(v) for v in items]
  if hasattr(value, "item") and callable(value.item):  # numpy scalars
    return json_safe(value.item())
  return str(value)


# ---- reasoning-gym tasks -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  name: str
  overrides: dict[str, Any]


def parse_task_spec(spec: str, flag: str = "--tasks") -> list[TaskSpec]:
  """`task[:key=value,...][;task...]`; list values join items with `|`; `none` is None."""
  from reasoning_gym.factory import DATASETS
  tasks = []
  for part in (p.strip() for p in spec.split(";")):
    if not part:
      continue
    name, _, settings = (s.strip() for s in part.partition(":"))
    if name not in DATASETS:
      raise UserInputError(f"{flag}: unknown reasoning-gym task {name!r}")
    config_cls = DATASETS[name][1]
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    try:
      hints = typing.get_type_hints(config_cls)
    except Exception:  # noqa: BLE001 - unresolvable annotations: fall back to raw ones
      hints = {n: f.type for n, f in fields.items()}
    overrides: dict[str, Any] = {}
    for item in (s.strip() for s in settings.split(",") if settings):
      key, eq, text = (s.strip() for s in item.partition("="))
      if not eq or not key:
        raise UserInputError(f"{flag}: {name}: expected key=value, got {item!r}")
      if key not in fields or key in _RESERVED_TASK_KEYS:
        known = ", ".join(k for k in fields if k not in _RESERVED_TASK_KEYS)
        raise UserInputError(f"{flag}: {name} has no setting {key!r} (settings: {known})")
      try:
        overrides[key] = _coerce(text, hints.get(key, str))
      except ValueError as e:
        raise UserInputError(f"{flag}: {name}: {key}={text!r}: {e}") from None
    try:
      config = config_cls(**overrides)
      if hasattr(config, "validate"):
        config.validate()
    except (AssertionError, ValueError, TypeError) as e:
      raise UserInputError(f"{flag}: {name}: invalid settings ({e or type(e).__name__})") from None
    tasks.append(TaskSpec(name, overrides))
  if not tasks:
    raise UserInputError(f"{flag}: no tasks given")
  return tasks


def _coerce(text: str, annotation: Any) -> Any:
  """`text` as the config field's type; ValueError says what was expected."""
  origin, args = typing.get_origin(annotation), typing.get_args(annotation)
  if annotation is bool:
    if text.lower() in ("true", "1", "yes"):
      return True
    if text.lower() in ("false", "0", "no"):
      return False
    raise ValueError("expected true or false")
  if annotation in (int, float, str):
    try:
      return annotation(text)
    except ValueError:
      raise ValueError(f"expected {annotation.__name__}") from None
  if origin in (typing.Union, types.UnionType):
    if text.lower() == "none" and type(None) in args:
      return None
    for arg in (a for a in args if a is not type(None)):
      try:
        return _coerce(text, arg)
      except ValueError:
        continue   # not this member of the union: try the next
    raise ValueError(f"expected {annotation}")
  if origin is typing.Literal:
    for choice in args:
      if str(choice) == text:
        return choice
    raise ValueError(f"expected one of {', '.join(map(str, args))}")
  if origin in (list, tuple, collections.abc.Sequence):
    item_type = args[0] if args else str
    items = [_coerce(t.strip(), item_type) for t in text.split("|") if t.strip()]
    return tuple(items) if origin is tuple else items
  if annotation is Any:
    return text
  raise ValueError(f"settings of type {annotation} cannot be set from the command line")


def _task_seed(seed: int, task_index: int, split: str) -> int:
  """Far-apart seeds per task and split (reasoning-gym seeds item i with seed + i)."""
  digest = hashlib.sha256(f"{seed}:{task_index}:{split}".encode()).digest()
  return int.from_bytes(digest[:4], "little") >> 1


def gym_records(tasks: Sequence[TaskSpec], num_prompts: int, seed: int, split: str = "train",
                exclude: Iterable[tuple] = ()) -> list[PromptRecord]:
  """`num_prompts` records, tasks interleaved round robin; deterministic in seed and split.

  Prompts whose `PromptRecord.key()` is in `exclude` (the validation set) are drawn again.
  """
  import reasoning_gym
  exclude = set(exclude)
  per_task: list[list[PromptRecord]] = []
  for i, task in enumerate(tasks):
    want = len(range(i, num_prompts, len(tasks)))
    max_draws = 4 * want + 64
    dataset = reasoning_gym.create_dataset(task.name, seed=_task_seed(seed, i, split),
                                           size=max_draws, **task.overrides)
    records: list[PromptRecord] = []
    for index in range(max_draws):
      if len(records) == want:
        break
      record = _gym_record(task, dataset[index], split, index)
      if record.key() not in exclude:
        records.append(record)
    if len(records) < want:
      raise UserInputError(f"--tasks: {task.name} gave only {len(records)} of {want} {split} "
                           "prompts distinct from the validation set; widen its settings")
    per_task.append(records)
  return [per_task[i % len(tasks)][i // len(tasks)] for i in range(num_prompts)]


def gym_prompt(question: str) -> str:
  """The user turn for a reasoning-gym question. RL sends it and drafter warm-up
  (`tasks.build_questions`) trains on it, so the drafter learns the prompts it serves."""
  return question + ANSWER_INSTRUCTION


def _gym_record(task: TaskSpec, entry: dict[str, Any], split: str, index: int) -> PromptRecord:
  entry = json_safe({k: entry.get(k) for k in ("question", "answer", "metadata")})
  return PromptRecord(
      prompt=({"role": "user", "content": gym_prompt(entry["question"])},),
      ground_truth=str(entry["answer"]),
      data_source=task.name,
      extra_info={"entry": entry, "task_config": json_safe(task.overrides), "split": split,
                  "index": index})


# ---- JSONL / parquet files -----------------------------------------------------------


class _BadRow(Exception):
  def __init__(self, field: str, problem: str):
    super().__init__(f"field {field!r} {problem}")


def load_prompt_file(path: str, on_bad_row: str = "fail") -> tuple[list[PromptRecord], int]:
  """(records, rows skipped) from a .jsonl or .parquet file in the common RL schema.

  Row locations in errors: JSONL `line N` (1-based), parquet `row N (0-based)`.
  """
  if on_bad_row not in BAD_ROW_MODES:
    raise UserInputError(f"--on_bad_row: {on_bad_row!r} is not one of {', '.join(BAD_ROW_MODES)}")
  if not os.path.isfile(path):
    raise UserInputError(f"{path}: no such file")
  ext = os.path.splitext(path)[1].lower()
  if ext == ".jsonl":
    rows = _jsonl_rows(path)
  elif ext == ".parquet":
    rows = _parquet_rows(path)
  else:
    raise UserInputError(f"{path}: unknown extension {ext!r} (use .jsonl or .parquet)")
  records, skipped = [], 0
  for where, row in rows:
    try:
      records.append(_file_record(row))
    except _BadRow as e:
      if on_bad_row == "fail":
        raise UserInputError(f"{path}: {where}: {e} (--on_bad_row=skip skips such rows)"
                             ) from None
      skipped += 1
  if not records:
    raise UserInputError(f"{path}: no usable rows ({skipped} bad rows skipped)")
  return records, skipped


def _jsonl_rows(path: str) -> list[tuple[str, Any]]:
  rows = []
  try:
    with open(path, encoding="utf-8") as f:
      for line_no, line in enumerate(f, start=1):
        if not line.strip():
          continue
        try:
          rows.append((f"line {line_no}", json.loads(line)))
        except json.JSONDecodeError as e:
          raise UserInputError(f"{path}: line {line_no}: malformed JSON ({e.msg})") from None
  except (OSError, UnicodeDecodeError) as e:
    raise UserInputError(f"{path}: cannot read ({e})") from None
  return rows


def _parquet_rows(path: str) -> list[tuple[str, Any]]:
  import pyarrow
  import pyarrow.parquet
  try:
    table = pyarrow.parquet.read_table(path)
  except (OSError, pyarrow.ArrowException) as e:
    first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise UserInputError(f"{path}: cannot read parquet ({first_line})") from None
  return [(f"row {i} (0-based)", row) for i, row in enumerate(table.to_pylist())]


def _file_record(row: Any) -> PromptRecord:
  if not isinstance(row, dict):
    raise _BadRow("<row>", f"must be an object, got {type(row).__name__}")
  if row.get("prompt") is None:
    raise _BadRow("prompt", "missing")
  prompt = row["prompt"]
  if not isinstance(prompt, list) or not prompt:
    raise _BadRow("prompt", "must be a non-empty list of {role, content} messages")
  messages = []
  for i, message in enumerate(prompt):
    if not isinstance(message, dict):
      raise _BadRow(f"prompt[{i}]", "must be a {role, content} object")
    for key in ("role", "content"):
      if not isinstance(message.get(key), str):
        raise _BadRow(f"prompt[{i}].{key}", "missing or not a string")
    messages.append({"role": message["role"], "content": message["content"]})
  reward_model = row.get("reward_model")
  if not isinstance(reward_model, dict):
    raise _BadRow("reward_model", "missing or not an object")
  truth = reward_model.get("ground_truth")
  if truth is None:
    raise _BadRow("reward_model.ground_truth", "missing")
  if isinstance(truth, bool) or not isinstance(truth, (str, int, float)):
    raise _BadRow("reward_model.ground_truth", f"must be a string, got {type(truth).__name__}")
  source = row.get("data_source")
  if not isinstance(source, str) or not source:
    raise _BadRow("data_source", "missing or not a non-empty string")
  extra = row.get("extra_info")
  if extra is not None and not isinstance(extra, dict):
    raise _BadRow("extra_info", f"must be an object, got {type(extra).__name__}")
  return PromptRecord(prompt=tuple(messages), ground_truth=str(truth), data_source=source,
                      extra_info=json_safe(extra or {}))

"""The benchmarks' questions: made with reasoning-gym (seeds held out from drafter training), or
read back from a file that `--write_questions` wrote, for a machine without reasoning-gym (the
GPU check, benchmarks/gpu_check.sh).

A part's questions are deterministic in (tasks, seed) and a prefix of any longer list of the
same tasks and seed, so one file serves every benchmark that asks for at most as many.
"""
from __future__ import annotations

import json
import sys

from absl import flags

from experiments import cli
from tlt_jax.errors import UserInputError

QUESTIONS_JSON = flags.DEFINE_string(
    "questions_json", None, "Read the benchmark's questions from this file (written by "
    "--write_questions) instead of generating them with reasoning-gym.")
WRITE_QUESTIONS = flags.DEFINE_string(
    "write_questions", None, "Write the questions the benchmark uses to this file and exit: "
    "for a machine without reasoning-gym (--questions_json there).")

MAIN_TASKS = ["gsm_symbolic", "basic_arithmetic", "chain_sum"]


def load(need: dict[str, tuple[list[str], int, int]]) -> dict[str, list[str]]:
  """part -> its first `count` questions, for need = {part: (tasks, count, seed)}: from
  --questions_json (each part must hold at least `count`), else made with reasoning-gym.
  With --write_questions, writes them there and exits: call it before loading a model."""
  asked = _read(QUESTIONS_JSON.value, need) if QUESTIONS_JSON.value else _make(need)
  if WRITE_QUESTIONS.value:
    cli.write_json_atomic(WRITE_QUESTIONS.value, asked)
    print(f"wrote {WRITE_QUESTIONS.value}", file=sys.stderr)
    sys.exit(0)
  return asked


def _make(need: dict[str, tuple[list[str], int, int]]) -> dict[str, list[str]]:
  from tlt_jax.data.tasks import build_questions
  return {part: [q for _, q in build_questions(tasks, count, seed)] if count else []
          for part, (tasks, count, seed) in need.items()}


def _read(path: str, need: dict[str, tuple[list[str], int, int]]) -> dict[str, list[str]]:
  try:
    with open(path) as f:
      stored = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise UserInputError(f"--questions_json={path}: cannot read ({e})") from None
  out = {}
  for part, (_, count, _) in need.items():
    got = stored.get(part) if isinstance(stored, dict) else None
    if not isinstance(got, list) or not all(isinstance(q, str) for q in got):
      raise UserInputError(f"--questions_json={path}: needs a list of strings under {part!r} "
                           "(write one with --write_questions)")
    if len(got) < count:
      raise UserInputError(f"--questions_json={path}: {len(got)} {part!r} questions, these "
                           f"flags need {count}")
    out[part] = got[:count]
  return out

"""Reasoning and chat prompts made offline: reasoning-gym generators plus chat questions.

Deterministic in the seed, so drafter warm-up, benchmarks and RL runs can hold out or
share prompt sets exactly.
"""
from __future__ import annotations

from tlt_jax.data.rl_sources import gym_prompt
from tlt_jax.errors import UserInputError

CHAT_QUESTIONS = (
    "Why is the sky blue?",
    "Give me three tips for staying focused while studying.",
    "What is the difference between weather and climate?",
    "Explain what a prime number is, with examples.",
    "Write a short poem about the ocean.",
    "How do plants make their food?",
    "What are the main causes of the seasons on Earth?",
    "Summarize the story of Cinderella in a few sentences.",
    "How does a refrigerator keep food cold?",
    "What is a healthy breakfast, and why?",
    "Explain recursion to a beginner programmer.",
    "What should I pack for a weekend hiking trip?",
    "Why do we have leap years?",
    "Describe how a bill becomes a law.",
    "What is the Pythagorean theorem used for?",
    "How can I make my emails more polite?",
)


def validate_tasks(tasks: list[str]) -> None:
  from reasoning_gym.factory import DATASETS
  unknown = [t for t in tasks if t != "chat" and t not in DATASETS]
  if unknown:
    raise UserInputError(f"--tasks: unknown task {unknown[0]!r} (use reasoning-gym dataset "
                         "names or 'chat')")
  if not tasks:
    raise UserInputError("--tasks: empty")


def build_questions(tasks: list[str], num_prompts: int, seed: int) -> list[tuple[str, str]]:
  """(task, prompt) pairs, tasks interleaved round robin; deterministic in `seed`.
  Reasoning-gym questions are worded as RL sends them (`rl_sources.gym_prompt`)."""
  import reasoning_gym

  counts = {t: len(range(i, num_prompts, len(tasks))) for i, t in enumerate(tasks)}
  pools = {}
  for i, task in enumerate(tasks):
    if task == "chat":
      pools[task] = [CHAT_QUESTIONS[k % len(CHAT_QUESTIONS)] for k in range(counts[task])]
    elif counts[task]:
      dataset = reasoning_gym.create_dataset(task, size=counts[task], seed=seed + i)
      pools[task] = [gym_prompt(dataset[k]["question"]) for k in range(counts[task])]
  return [(tasks[i % len(tasks)], pools[tasks[i % len(tasks)]][i // len(tasks)])
          for i in range(num_prompts)]

"""Reward functions for tests/test_rl_rewards.py, importable in spawned reward workers."""
from __future__ import annotations

import os
import time

from tlt_jax.rl.rewards import extract_answer, register_reward


@register_reward("test_scripted")
def scripted_reward(response: str, ground_truth: str, data_source: str,
                    extra_info: dict) -> float:
  """Exact match of the extracted answer, except scripted failures named in the response."""
  if "RAISE" in response:
    raise ValueError("scripted failure")
  if "SLEEP" in response:
    time.sleep(60)
  if "EXIT" in response:
    os._exit(3)
  return 1.0 if extract_answer(response) == ground_truth else 0.0


def length_reward(response: str, ground_truth: str, data_source: str,
                  extra_info: dict) -> float:
  """Unregistered: picked by `--reward=tests.rl_reward_helpers:length_reward`."""
  return float(len(response))


def failing_warmup() -> None:
  raise RuntimeError("scripted warm-up failure")


@register_reward("test_bad_warmup", warmup=failing_warmup)
def bad_warmup_reward(response: str, ground_truth: str, data_source: str,
                      extra_info: dict) -> float:
  return 0.0


def two_arguments(response: str, ground_truth: str) -> float:
  """Not a reward: too few parameters (refused before the run)."""
  return 0.0


def needs_keyword(response: str, ground_truth: str, data_source: str, extra_info: dict, *,
                  scale: float) -> float:
  """Not a reward: a required keyword the pool never passes (refused before the run)."""
  return scale


def takes_anything(*args, **kwargs) -> float:
  """A reward by its signature: any four positional arguments bind."""
  return 0.0

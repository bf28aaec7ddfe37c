"""Module-level pieces for tests/test_rl_sd_equivalence.py: a reward function the spawned
reward workers can import by name, and a character tokenizer for the learner's decode."""
from __future__ import annotations

from typing import Sequence

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"


class CharTokenizer:
  """Token id i <-> ALPHABET[i]: all the learner needs of a tokenizer is `decode`."""

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    return "".join(ALPHABET[int(i)] for i in ids)


def variety_reward(response: str, ground_truth: str, data_source: str,
                   extra_info: dict) -> float:
  """The share of distinct characters in the response (0 when empty): deterministic, it
  varies from sample to sample and moves with the sampling temperature (sharper sampling
  repeats more)."""
  return len(set(response)) / len(response) if response else 0.0

"""A synthetic verifiable task for learning tests: answer with as many copies of one
character as possible. Module-level so spawned reward workers can import it."""
from __future__ import annotations


def letter_share_reward(response: str, ground_truth: str, data_source: str,
                        extra_info: dict) -> float:
  """The share of the response's characters that are `ground_truth` (one character)."""
  return sum(ch == ground_truth for ch in response) / max(len(response), 1)

"""Speculative-decoding strategies: (draft depth, top-k per level, tokens verified)."""
from __future__ import annotations

import dataclasses
import re

from tlt_jax.errors import UserInputError


@dataclasses.dataclass(frozen=True, order=True)
class SpecStrategy:
  """`verify_tokens` counts every token of the verify pass, the pending root included.

  topk=1 is a chain of `depth` drafts (verify_tokens = depth + 1). With topk > 1 the
  drafter grows a tree: each node proposes `topk` children (its top-k when greedy, k draws
  without replacement when sampling), each level keeps the `topk` best nodes by cumulative
  draft log-prob (when sampling, by the row's acceptance rate so far per level and draw
  rank: a shape fixed before the step's draws, as exact rejection sampling needs), and
  the best `verify_tokens - 1` nodes of the tree are verified.
  """
  depth: int
  topk: int
  verify_tokens: int

  def __post_init__(self):
    if self.depth < 1 or self.topk < 1 or self.verify_tokens < 2:
      raise UserInputError(f"strategy {self.name}: need depth >= 1, topk >= 1, verify >= 2")
    if self.verify_tokens > 1 + self.depth * self.topk:
      raise UserInputError(
          f"strategy {self.name}: verify_tokens {self.verify_tokens} exceeds the "
          f"{1 + self.depth * self.topk} tokens a depth-{self.depth}, top-{self.topk} tree has")
    if self.topk == 1 and self.verify_tokens != self.depth + 1:
      raise UserInputError(f"strategy {self.name}: a chain (topk 1) verifies depth + 1 = "
                           f"{self.depth + 1} tokens")

  @property
  def name(self) -> str:
    return f"{self.depth}_{self.topk}_{self.verify_tokens}"

  @property
  def num_nodes(self) -> int:
    return self.depth * self.topk

  @classmethod
  def parse(cls, text: str, flag: str = "--strategy") -> "SpecStrategy":
    match = re.fullmatch(r"(\d+)_(\d+)_(\d+)", text.strip())
    if not match:
      raise UserInputError(f"{flag}={text!r}: expected DEPTH_TOPK_VERIFYTOKENS, e.g. 8_4_16")
    try:
      return cls(*(int(g) for g in match.groups()))
    except UserInputError as e:
      raise UserInputError(f"{flag}={text!r}: {e}") from None

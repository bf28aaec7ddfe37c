"""Speculative-decoding strategies: (draft depth, top-k per level, tokens verified), and
optionally the drafter kind that drafts them, so one bandit pool can hold learned,
model-free and hybrid strategies side by side."""
from __future__ import annotations

import dataclasses
import re

from tlt_jax.errors import UserInputError

DRAFTER_KINDS = ("learned", "ngram", "hybrid")


@dataclasses.dataclass(frozen=True, order=True)
class SpecStrategy:
  """`verify_tokens` counts every token of the verify pass, the pending root included.

  topk=1 is a chain of `depth` drafts (verify_tokens = depth + 1). With topk > 1 the
  drafter grows a tree: each node proposes `topk` children (its top-k when greedy, k draws
  without replacement when sampling), each level keeps the `topk` best nodes by cumulative
  draft log-prob (when sampling, by the row's acceptance rate so far per level and draw
  rank: a shape fixed before the step's draws, as exact rejection sampling needs), and
  the best `verify_tokens - 1` nodes of the tree are verified. A model-free tree holds
  the likeliest paths by the share of the group text's matches (each node matched again
  with its path, a longer match counting more) each child has, `topk` children per node
  (`ngram.propose_tree`); a hybrid's drafts are chains.

  drafter: the kind that drafts (`DRAFTER_KINDS`); None: the rollout's own
  (`SpecConfig.kind_of`). Named as a prefix, e.g. `ngram:4_1_5`.
  """
  depth: int
  topk: int
  verify_tokens: int
  drafter: str | None = None

  def __post_init__(self):
    if self.drafter is not None and self.drafter not in DRAFTER_KINDS:
      raise UserInputError(f"strategy {self.name}: drafter kind must be one of "
                           f"{', '.join(DRAFTER_KINDS)}")
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
    shape = f"{self.depth}_{self.topk}_{self.verify_tokens}"
    return shape if self.drafter is None else f"{self.drafter}:{shape}"

  @property
  def num_nodes(self) -> int:
    return self.depth * self.topk

  @classmethod
  def parse(cls, text: str, flag: str = "--strategy") -> "SpecStrategy":
    match = re.fullmatch(r"(?:(\w+):)?(\d+)_(\d+)_(\d+)", text.strip())
    if not match:
      raise UserInputError(f"{flag}={text!r}: expected [KIND:]DEPTH_TOPK_VERIFYTOKENS, e.g. "
                           "8_4_16 or ngram:4_1_5")
    try:
      return cls(*(int(g) for g in match.groups()[1:]), drafter=match.group(1))
    except UserInputError as e:
      raise UserInputError(f"{flag}={text!r}: {e}") from None

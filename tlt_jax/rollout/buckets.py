"""Static-shape buckets: every jitted program is keyed by a batch bucket and a cache page.

A finite, known set of shapes means a finite, known set of compiled programs (the JAX
analogue of a CUDA-graph pool), and no recompiles once they are warm.
"""
from __future__ import annotations

import dataclasses

from tlt_jax.errors import UserInputError


@dataclasses.dataclass(frozen=True)
class BucketSpec:
  batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
  cache_page: int = 128       # cache lengths are multiples of this
  prompt_page: int = 32       # padded prompt lengths are multiples of this
  # Prompts are prefilled longest first in up to this many groups of equal rows, each
  # padded to its own longest prompt (64 reasoning prompts of 49-170 tokens on a 2-core
  # CPU: 12.1 s in one group, 5.3 s in 4, 4.6 s in 8, 4.2 s in 16).
  prefill_groups: int = 8

  def __post_init__(self):
    if min(self.batch_buckets + (self.cache_page, self.prompt_page, self.prefill_groups)) < 1:
      raise UserInputError(f"{self}: every bucket size and count must be >= 1")

  def capped(self, max_rows: int | None) -> "BucketSpec":
    """The batch buckets of a rollout that holds at most `max_rows` rows at once: those
    below it and max_rows itself (None: unchanged). A cap past the largest bucket is that
    bucket: the budget never widens the batch."""
    if max_rows is None:
      return self
    if max_rows < 1:
      raise UserInputError(f"--rollout_max_rows={max_rows}: must be >= 1")
    top = min(max_rows, self.batch_buckets[-1])
    return dataclasses.replace(self, batch_buckets=tuple(
        b for b in self.batch_buckets if b < top) + (top,))

  def batch_bucket(self, rows: int) -> int:
    for size in self.batch_buckets:
      if size >= rows:
        return size
    raise UserInputError(
        f"batch of {rows} rows exceeds the largest batch bucket {self.batch_buckets[-1]}")

  def cache_length(self, tokens: int) -> int:
    return round_up(tokens, self.cache_page)

  def prompt_length(self, tokens: int) -> int:
    return round_up(tokens, self.prompt_page)

  def prompt_lengths(self, longest: int) -> list[int]:
    """Every padded prompt length up to `longest`'s (a prefill group's can be any)."""
    return list(range(self.prompt_page, self.prompt_length(longest) + 1, self.prompt_page))

  def prefill_group_rows(self, batch: int) -> int:
    groups = min(self.prefill_groups, batch)
    return batch // groups if batch % groups == 0 else batch

  @staticmethod
  def distinct_prompts(count: int, group_rows: int) -> int:
    """Prompts a prefill group runs when its rows hold `count` distinct ones: a power of
    two (repeats pad it), at most the group's rows."""
    return min(group_rows, 1 << (count - 1).bit_length())

  def attention_window(self, tokens: int, cache_length: int) -> int:
    """The cache prefix a decode chunk attends over to reach `tokens`: a page times a power
    of two (so log2(cache pages) programs per cache length at most), capped at the cache."""
    window = self.cache_page
    while window < tokens:
      window *= 2
    return min(window, cache_length)

  def attention_windows(self, min_tokens: int, cache_length: int) -> list[int]:
    """Every window `attention_window` can return for `min_tokens` or more, ascending."""
    windows = [self.attention_window(min_tokens, cache_length)]
    while windows[-1] < cache_length:
      windows.append(min(2 * windows[-1], cache_length))
    return windows


def round_up(n: int, multiple: int) -> int:
  return max(multiple, -(-n // multiple) * multiple)

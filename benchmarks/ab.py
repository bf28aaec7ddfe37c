"""Alternated A/B measurement, the pattern the benchmarks share.

Sides that share a machine are compared by running them in turn, A B A B ..., after an
untimed warm-up round (it compiles their programs and fills caches, so no timed run
compiles): a slow spell of the machine then hits every side alike. Figures are medians
over the timed rounds, and a speedup is the median over rounds of the ratio of the two
sides' runs in the same round (paired): each ratio compares runs made back to back, so a
drift of the machine between rounds cancels in it. A ratio of medians mixes rounds: with
per-round values A = 1.0, 0.5, 1.5 and B = 0.8, 1.0, 1.2, the paired ratios A/B are
1.25, 0.5, 1.25 (median 1.25), while median(A) / median(B) = 1.0.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

T = TypeVar("T")


def alternate(sides: Mapping[str, Callable[[int], T]], repeats: int, *, warmup: int = 1,
              mirror: bool = False) -> list[dict[str, T]]:
  """Runs `warmup` untimed rounds, then `repeats` timed ones; returns the timed rounds.

  Each round runs every side once, in the order of `sides` (with `mirror`, reversed in
  odd rounds: A B, B A, A B ..., so neither side always runs first). `sides` maps a name
  to `run(round)`; rounds are numbered from 0 over warm-up and timed rounds alike (with
  one warm-up round: 0, then 1..repeats), so a run can take its seed from the number.
  Returns one {name: result} per timed round, in order: the pairs of `paired_ratios`.
  """
  if repeats < 1 or warmup < 0:
    raise ValueError(f"alternate: repeats={repeats} (>= 1), warmup={warmup} (>= 0)")
  timed = []
  for number in range(warmup + repeats):
    names = list(sides)
    if mirror and number % 2:
      names.reverse()
    results = {name: sides[name](number) for name in names}
    if number >= warmup:
      timed.append({name: results[name] for name in sides})
  return timed


def side(rounds: Sequence[Mapping[str, T]], name: str) -> list[T]:
  """One side's results over `rounds` (as `alternate` returns them), in round order."""
  return [r[name] for r in rounds]


def paired_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
  """numerators[i] / denominators[i]: the two sides' figures of round i, round by round."""
  if len(numerators) != len(denominators):
    raise ValueError(f"paired_ratios: {len(numerators)} numerators, "
                     f"{len(denominators)} denominators (one of each per round)")
  return [n / d for n, d in zip(numerators, denominators)]


def paired_median(numerators: Sequence[float], denominators: Sequence[float]) -> float:
  """The median over rounds of numerator / denominator (> 1: the numerator's side is
  larger); not the ratio of the medians (see the module docstring)."""
  return statistics.median(paired_ratios(numerators, denominators))

"""benchmarks/ab.py: the alternation order, warm-up rounds left out, and the arithmetic of
paired ratios (a median of per-round ratios, not a ratio of medians)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import ab  # noqa: E402


def _recording(calls):
  return {name: (lambda number, name=name: calls.append((name, number)) or (name, number))
          for name in ("a", "b")}


def test_sides_alternate_after_the_warm_up_round():
  calls = []
  rounds = ab.alternate(_recording(calls), repeats=2)
  assert calls == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]
  assert rounds == [{"a": ("a", 1), "b": ("b", 1)}, {"a": ("a", 2), "b": ("b", 2)}]
  assert ab.side(rounds, "b") == [("b", 1), ("b", 2)]


def test_no_warm_up_and_mirrored_order():
  calls = []
  rounds = ab.alternate(_recording(calls), repeats=3, warmup=0, mirror=True)
  assert calls == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]
  assert [list(r) for r in rounds] == [["a", "b"]] * 3      # results keep the sides' order


@pytest.mark.parametrize("repeats, warmup", [(0, 1), (2, -1)])
def test_bad_counts_are_rejected(repeats, warmup):
  with pytest.raises(ValueError, match="alternate: repeats="):
    ab.alternate(_recording([]), repeats=repeats, warmup=warmup)


def test_paired_median_is_the_median_of_per_round_ratios():
  a, b = [1.0, 0.5, 1.5], [0.8, 1.0, 1.2]
  assert ab.paired_ratios(a, b) == pytest.approx([1.25, 0.5, 1.25])
  assert ab.paired_median(a, b) == pytest.approx(1.25)
  # The ratio of the medians says 1.0: the pairing is what the helper is for.
  assert sorted(a)[1] / sorted(b)[1] == pytest.approx(1.0)
  assert ab.paired_median([3.0, 1.0], [1.0, 1.0]) == 2.0      # even count: mean of the middle


def test_unpaired_lengths_are_an_error():
  with pytest.raises(ValueError, match="2 numerators, 3 denominators"):
    ab.paired_ratios([1.0, 2.0], [1.0, 1.0, 1.0])

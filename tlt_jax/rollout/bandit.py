"""BEG-MAB: a bucketed epsilon-greedy bandit that picks the SD strategy per live batch size.

Which strategy pays depends on the platform and the live batch (on a 2-core CPU a 5-token
chain wins at batch 1 and every tree loses at batch 16; on a GPU deep trees win at small
batch), and on how well the drafter currently tracks the policy. So the engine measures
instead of guessing: live batch sizes fall into buckets (default {1}, {2-4}, {5-20},
{21+}), each bucket keeps a sliding window of rewards per strategy, and before every SD
chunk the bandit plays the strategy with the best median reward, or with probability
epsilon a random one. Untried strategies are played first. The reward is a chunk's
emitted tokens per second of wall time per live row (mean accept length / step time):
throughput grows with the live rows inside a bucket, and the untried strategies are played
in list order while the tail shrinks, so raw tokens per second would favour whichever
strategy came first. Per row, strategies measured at different live rows compare.

The bandit is host-side state that outlives one rollout (it keeps learning across RL
steps); `state_dict` / `from_state_dict` carry it through a checkpoint, RNG included.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Sequence

import numpy as np

from tlt_jax.errors import UserInputError
from tlt_jax.rollout.strategy import SpecStrategy


@dataclasses.dataclass(frozen=True)
class BanditConfig:
  strategies: tuple[SpecStrategy, ...]
  bucket_bounds: tuple[int, ...] = (1, 4, 20)   # upper bounds; a last bucket takes the rest
  epsilon: float = 0.1
  window: int = 300
  seed: int = 0

  def __post_init__(self):
    if not self.strategies:
      raise UserInputError("--strategy: the bandit needs at least one strategy")
    names = [s.name for s in self.strategies]
    if len(set(names)) != len(names):
      raise UserInputError(f"--strategy={','.join(names)}: a strategy is listed twice")
    if not 0.0 <= self.epsilon <= 1.0:
      raise UserInputError(f"--bandit_epsilon={self.epsilon}: must be in [0, 1]")
    if self.window < 1:
      raise UserInputError(f"--bandit_window={self.window}: must be >= 1")
    bounds = self.bucket_bounds
    if not bounds or bounds[0] < 1 or any(b <= a for a, b in zip(bounds, bounds[1:])):
      raise UserInputError(f"bandit bucket bounds {bounds}: need strictly increasing upper "
                           "bounds >= 1")

  def bucket(self, live_rows: int) -> int:
    return int(np.searchsorted(self.bucket_bounds, live_rows))

  def bucket_label(self, bucket: int) -> str:
    lo = 1 if bucket == 0 else self.bucket_bounds[bucket - 1] + 1
    if bucket == len(self.bucket_bounds):
      return f"{lo}+"
    hi = self.bucket_bounds[bucket]
    return str(lo) if lo == hi else f"{lo}-{hi}"


class StrategyBandit:
  """Mutable: `choose` before an SD chunk, `record` its reward after."""

  def __init__(self, config: BanditConfig):
    self.config = config
    self._rng = np.random.default_rng(config.seed)
    num_buckets = len(config.bucket_bounds) + 1
    self._rewards = [[collections.deque(maxlen=config.window) for _ in config.strategies]
                     for _ in range(num_buckets)]
    self._pulls = np.zeros((num_buckets, len(config.strategies)), np.int64)

  @property
  def strategies(self) -> tuple[SpecStrategy, ...]:
    return self.config.strategies

  def choose(self, live_rows: int) -> SpecStrategy:
    rewards = self._rewards[self.config.bucket(live_rows)]
    untried = [i for i, window in enumerate(rewards) if not window]
    if untried:
      arm = untried[0]
    elif self._rng.random() < self.config.epsilon:
      arm = int(self._rng.integers(len(rewards)))
    else:
      arm = int(np.argmax([np.median(window) for window in rewards]))
    return self.config.strategies[arm]

  def record(self, live_rows: int, strategy: SpecStrategy, tokens_per_s: float) -> None:
    """Scores a chunk played at `live_rows` that emitted `tokens_per_s` (all rows)."""
    bucket = self.config.bucket(live_rows)
    arm = self.config.strategies.index(strategy)
    self._rewards[bucket][arm].append(float(tokens_per_s) / live_rows)
    self._pulls[bucket, arm] += 1

  def summary(self) -> dict[str, dict[str, dict[str, float]]]:
    """Per bucket (label) and strategy: pulls and median reward, tried ones only."""
    out = {}
    for bucket, rewards in enumerate(self._rewards):
      arms = {s.name: {"pulls": int(self._pulls[bucket, i]),
                       "median_tokens_per_s_per_row": float(np.median(window))}
              for i, (s, window) in enumerate(zip(self.config.strategies, rewards)) if window}
      if arms:
        out[self.config.bucket_label(bucket)] = arms
    return out

  def state_dict(self) -> dict[str, Any]:
    """JSON-serializable state: rewards, pulls and the RNG, keyed by strategy name. The
    rewards' key names their unit, so a state scored otherwise (tokens/s of all rows) is
    refused rather than compared with per-row rewards."""
    names = [s.name for s in self.config.strategies]
    return {"strategies": names,
            "bucket_bounds": list(self.config.bucket_bounds),
            "rewards_per_row": [[list(window) for window in bucket] for bucket in self._rewards],
            "pulls": self._pulls.tolist(),
            "rng": self._rng.bit_generator.state}

  @classmethod
  def from_state_dict(cls, config: BanditConfig, state: dict[str, Any]) -> "StrategyBandit":
    names = [s.name for s in config.strategies]
    if not isinstance(state, dict):
      raise UserInputError("bandit state: malformed (not a JSON object)")
    if state.get("strategies") != names or state.get("bucket_bounds") != list(
        config.bucket_bounds):
      raise UserInputError(
          f"bandit state: saved for strategies {state.get('strategies')} and buckets "
          f"{state.get('bucket_bounds')}, not {names} and {list(config.bucket_bounds)}")
    bandit = cls(config)
    try:
      rewards, pulls = state["rewards_per_row"], np.asarray(state["pulls"], np.int64)
      if len(rewards) != len(bandit._rewards) or pulls.shape != bandit._pulls.shape or any(
          len(saved) != len(names) for saved in rewards):
        raise ValueError("rewards/pulls do not match the buckets and strategies")
      for bucket, saved in zip(bandit._rewards, rewards):
        for window, values in zip(bucket, saved):
          window.extend(float(v) for v in values)
      bandit._pulls = pulls
      bandit._rng.bit_generator.state = state["rng"]
    except (KeyError, TypeError, ValueError) as e:
      raise UserInputError(f"bandit state: malformed ({e})") from None
    return bandit


def parse_strategies(text: str | Sequence[str], flag: str = "--strategy"
                     ) -> tuple[SpecStrategy, ...]:
  """'4_1_5' or '4_1_5,4_2_6,8_4_16' (or a list of such items) -> strategies."""
  items = text.split(",") if isinstance(text, str) else list(text)
  items = [item.strip() for item in items if item.strip()]
  if not items:
    raise UserInputError(f"{flag}={text!r}: expected one or more DEPTH_TOPK_VERIFYTOKENS")
  return tuple(SpecStrategy.parse(item, flag) for item in items)

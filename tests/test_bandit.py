"""BEG-MAB: per-bucket epsilon-greedy choice of the SD strategy (the engine switching
strategies mid-rollout is tested with the other SD exactness tests, test_speculative)."""
import itertools
import json

import pytest

from tlt_jax.errors import UserInputError
from tlt_jax.rollout.bandit import BanditConfig, StrategyBandit, parse_strategies

POOL = parse_strategies("2_1_3,4_1_5,3_2_5")


def _play(bandit, live_rows, reward_of, rounds):
  chosen = []
  for _ in range(rounds):
    strategy = bandit.choose(live_rows)
    bandit.record(live_rows, strategy, reward_of[strategy.name])
    chosen.append(strategy.name)
  return chosen


def test_tries_every_strategy_then_exploits_the_best():
  bandit = StrategyBandit(BanditConfig(POOL, epsilon=0.0))
  rewards = {"2_1_3": 10.0, "4_1_5": 30.0, "3_2_5": 20.0}
  chosen = _play(bandit, 1, rewards, 20)
  assert chosen[:3] == ["2_1_3", "4_1_5", "3_2_5"]       # untried first, in pool order
  assert set(chosen[3:]) == {"4_1_5"}


def test_fastest_arm_per_row_wins_a_shrinking_tail_from_any_list_position():
  """Inside a bucket a chunk's throughput grows with its live rows, and the untried arms
  are played in list order while the tail shrinks, so the first-listed arm is measured at
  the most rows. Scored per live row, the arm that is fastest per row at every row count
  wins wherever it is listed."""
  # Simulated chunks: a fixed step latency per arm plus a small cost per row.
  accept_len = {"2_1_3": 2.0, "4_1_5": 2.6, "3_2_5": 2.8}
  latency_s = {"2_1_3": 0.030, "4_1_5": 0.045, "3_2_5": 0.035}
  tail = (20, 17, 14, 12, 10, 9, 8, 7, 6, 5)        # live rows per chunk, all in 5-20
  for pool in itertools.permutations(POOL):
    bandit = StrategyBandit(BanditConfig(pool, epsilon=0.0))
    chosen = []
    for rows in tail:
      strategy = bandit.choose(rows)
      step_s = latency_s[strategy.name] + 2e-4 * rows
      bandit.record(rows, strategy, rows * accept_len[strategy.name] / step_s)
      chosen.append(strategy.name)
    assert set(chosen[len(pool):]) == {"3_2_5"}, ([s.name for s in pool], chosen)


def test_epsilon_explores_at_its_rate():
  bandit = StrategyBandit(BanditConfig(POOL, epsilon=0.3, seed=7))
  rewards = {"2_1_3": 10.0, "4_1_5": 30.0, "3_2_5": 20.0}
  chosen = _play(bandit, 1, rewards, 3003)[3:]
  others = sum(name != "4_1_5" for name in chosen) / len(chosen)
  # A random pick lands on one of the two others with probability 2/3: 0.3 * 2/3 = 0.2.
  assert abs(others - 0.2) < 0.03, others


def test_buckets_learn_apart():
  bandit = StrategyBandit(BanditConfig(POOL, epsilon=0.0))
  _play(bandit, 1, {"2_1_3": 1.0, "4_1_5": 9.0, "3_2_5": 5.0}, 10)
  _play(bandit, 12, {"2_1_3": 9.0, "4_1_5": 1.0, "3_2_5": 5.0}, 10)
  assert bandit.choose(1).name == "4_1_5"
  assert bandit.choose(12).name == "2_1_3"
  assert bandit.choose(3).name == "2_1_3"       # bucket 2-4 untried: starts at the first
  summary = bandit.summary()
  assert set(summary) == {"1", "5-20"}
  assert summary["1"]["4_1_5"] == {"pulls": 8, "median_tokens_per_s_per_row": 9.0}


def test_sliding_window_follows_a_changing_drafter():
  """Rewards older than the window are forgotten, so a strategy that becomes best (the
  drafter improves) takes over once its window shows it."""
  bandit = StrategyBandit(BanditConfig(POOL[:2], epsilon=0.0, window=5))
  _play(bandit, 1, {"2_1_3": 10.0, "4_1_5": 5.0}, 8)
  assert bandit.choose(1).name == "2_1_3"
  # 2_1_3 degrades; after enough bad rounds its median falls below 4_1_5's.
  chosen = _play(bandit, 1, {"2_1_3": 1.0, "4_1_5": 5.0}, 8)
  assert chosen[-1] == "4_1_5"


def test_state_round_trip_continues_identically():
  config = BanditConfig(POOL, epsilon=0.5, seed=3)
  rewards = {"2_1_3": 10.0, "4_1_5": 30.0, "3_2_5": 20.0}
  bandit = StrategyBandit(config)
  _play(bandit, 2, rewards, 17)
  state = json.loads(json.dumps(bandit.state_dict()))      # as a checkpoint stores it
  restored = StrategyBandit.from_state_dict(config, state)
  assert _play(bandit, 2, rewards, 40) == _play(restored, 2, rewards, 40)
  with pytest.raises(UserInputError, match="bandit state"):
    StrategyBandit.from_state_dict(BanditConfig(POOL[:2]), state)
  with pytest.raises(UserInputError, match="bandit state: malformed"):
    StrategyBandit.from_state_dict(config, dict(state, pulls=[[1, 2]]))
  with pytest.raises(UserInputError, match="bandit state: malformed"):
    StrategyBandit.from_state_dict(config, {k: v for k, v in state.items() if k != "rng"})
  with pytest.raises(UserInputError, match="bandit state: malformed"):
    StrategyBandit.from_state_dict(config, [1, 2])


@pytest.mark.parametrize("kwargs,match", [
    (dict(strategies=()), "--strategy"),
    (dict(strategies=POOL + POOL[:1]), "listed twice"),
    (dict(strategies=POOL, epsilon=1.5), "--bandit_epsilon"),
    (dict(strategies=POOL, window=0), "--bandit_window"),
    (dict(strategies=POOL, bucket_bounds=(4, 4)), "bucket bounds"),
    (dict(strategies=POOL, bucket_bounds=(0, 4)), "bucket bounds"),
])
def test_bad_bandit_config_is_one_line_error(kwargs, match):
  with pytest.raises(UserInputError, match=match):
    BanditConfig(**kwargs)


@pytest.mark.parametrize("text", ["", "4_1_5,,x", "4_1_5,3_3_99"])
def test_bad_strategy_lists(text):
  with pytest.raises(UserInputError, match="--strategy"):
    parse_strategies(text)


def test_bucket_labels():
  config = BanditConfig(POOL)
  assert [config.bucket_label(config.bucket(n)) for n in (1, 2, 4, 5, 20, 21, 300)] == [
      "1", "2-4", "2-4", "5-20", "5-20", "21+", "21+"]

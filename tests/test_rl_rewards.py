"""Verifiable rewards: answer extraction, math_verify / reasoning-gym scoring, the registry,
and the worker pool's error, timeout and crash handling."""
from __future__ import annotations

import time

import numpy as np
import pytest

from tests import rl_reward_helpers
from tlt_jax.errors import UserInputError
from tlt_jax.rl import rewards
from tlt_jax.rl.rewards import (RewardItem, RewardPool, RewardSpec, extract_answer,
                                format_score, get_reward, register_reward, score_in_process)

ITEM_TIMEOUT_S = 1.5


@pytest.mark.parametrize("response, expected", [
    ("so \\boxed{\\frac{1}{\\sqrt{2}}} is it", "\\frac{1}{\\sqrt{2}}"),
    ("first \\boxed{1}, then $\\boxed{\\boxed{3}}$.", "3"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
    ("<answer> 42 </answer>", "42"),
    ("<answer>7</answer> and later <ANSWER>8</ANSWER>", "8"),
    ("I computed it. The final answer is 12.", "12"),
    ("**Final Answer:** $\\frac12$", "\\frac12"),
    ("Answer: -3", "-3"),
    ("first 3 apples, then 1,250 pears", "1250"),
    ("a truncated \\boxed{5 and then 6", "6"),
    ("no answer here", ""),
    ("", ""),
])
def test_extract_answer(response, expected):
  assert extract_answer(response) == expected


def test_extract_answer_is_linear_on_unclosed_boxes():
  start = time.perf_counter()
  assert extract_answer("\\boxed{" * 20000 + "1") == "1"
  assert time.perf_counter() - start < 2.0


@pytest.mark.parametrize("response, expected", [
    ("work... so \\boxed{4}.", 1.0),
    ("<answer>\\boxed{4}</answer>\n", 1.0),
    ("$$\\boxed{4}$$", 1.0),
    ("\\boxed{4} but wait, maybe 5", 0.0),
    ("\\boxed{}", 0.0),
    ("the final answer is 4", 0.0),
])
def test_format_score(response, expected):
  assert format_score(response) == expected


@pytest.mark.parametrize("response, truth, expected", [
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("so the answer is \\frac{1}{2}", "0.5", 1.0),
    ("<answer>1/2</answer>", "0.5", 1.0),
    ("\\boxed{12}", "12", 1.0),
    ("The final answer is 12.", "$12$", 1.0),
    ("\\boxed{0.6}", "0.5", 0.0),
    ("I do not know", "0.5", 0.0),
])
def test_math_verify(response, truth, expected):
  assert get_reward("math_verify")(response, truth, "", {}) == expected


def test_math_verify_unparseable_ground_truth_raises():
  with pytest.raises(ValueError, match="ground truth"):
    get_reward("math_verify")("\\boxed{1}", "", "", {})


def test_reasoning_gym_basic_arithmetic():
  import reasoning_gym
  dataset = reasoning_gym.create_dataset("basic_arithmetic", size=4, seed=42, min_terms=2,
                                         max_terms=2, min_digits=1, max_digits=2)
  entry = {k: dataset[1][k] for k in ("question", "answer", "metadata")}
  info = {"entry": entry, "task_config": {"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                          "max_digits": 2}}
  reward = get_reward("reasoning_gym")
  truth = entry["answer"]
  assert reward(f"so \\boxed{{{truth}}}", truth, "basic_arithmetic", info) == 1.0
  assert reward(f"<answer>{int(truth) + 1}</answer>", truth, "basic_arithmetic", info) == 0.0
  assert reward("no idea", truth, "basic_arithmetic", info) == 0.0
  with pytest.raises(ValueError, match="entry"):
    reward("\\boxed{1}", truth, "basic_arithmetic", {})


def test_registry_unknown_and_user_functions():
  with pytest.raises(UserInputError, match=r"--reward=nope: unknown reward \(known: .*math_verify"):
    RewardSpec("nope")
  with pytest.raises(UserInputError, match="cannot import"):
    RewardSpec("no_such_module_xyz:fn")
  with pytest.raises(UserInputError, match="has no function"):
    RewardSpec("tests.rl_reward_helpers:missing")
  fn = get_reward("tests.rl_reward_helpers:length_reward")
  assert fn is rl_reward_helpers.length_reward
  assert get_reward("test_scripted") is rl_reward_helpers.scripted_reward
  register_reward("test_lambda")(lambda *args: 0.0)
  with pytest.raises(UserInputError, match="module-level function"):
    RewardSpec("test_lambda")
  with pytest.raises(UserInputError, match="--format_weight"):
    RewardSpec("format", format_weight=-1.0)


@pytest.mark.parametrize("name, why", [
    ("os:system", r"system\(command\) must accept the arguments \(response, ground_truth, "
                  r"data_source, extra_info\) positionally: too many positional arguments"),
    ("tests.rl_reward_helpers:two_arguments", "too many positional arguments"),
    ("tests.rl_reward_helpers:needs_keyword", "missing a required argument: 'scale'"),
])
def test_a_function_that_cannot_take_a_rewards_arguments_is_refused(name, why):
  with pytest.raises(UserInputError, match=f"^--reward={name}: .*{why}$"):
    RewardSpec(name)
  RewardSpec("tests.rl_reward_helpers:takes_anything")


def test_a_batch_where_every_item_raised_is_the_functions_fault():
  spec = RewardSpec("test_scripted")
  failing = [RewardItem("RAISE", "1")] * 3
  with pytest.raises(UserInputError, match=r"^--reward=test_scripted: all 3 responses of a "
                     r"batch failed to score \(3 raised, 0 timed out\); the first: "
                     r"ValueError: scripted failure$"):
    rewards.require_some_scored(score_in_process(spec, failing), spec.name)
  # One item scored, or every fault a timeout (a slow host, not a broken function): counted.
  rewards.require_some_scored(score_in_process(spec, failing + [RewardItem("1", "1")]),
                              spec.name)
  zeros = np.zeros(2, np.float32)
  rewards.require_some_scored(rewards.RewardResult(zeros, zeros, zeros, timeouts=2, errors=0,
                                                   first_error=None), spec.name)
  rewards.require_some_scored(score_in_process(spec, []), spec.name)


def test_pool_arguments_are_checked():
  spec = RewardSpec("format")
  with pytest.raises(UserInputError, match="--reward_workers"):
    RewardPool(spec, num_workers=0)
  with pytest.raises(UserInputError, match="--reward_timeout_s"):
    RewardPool(spec, timeout_s=0)
  with pytest.raises(UserInputError, match="--reward_start_method"):
    RewardPool(spec, start_method="fork")


@pytest.fixture(scope="module")
def scripted_pool():
  with RewardPool(RewardSpec("test_scripted", format_weight=0.5), num_workers=2,
                  timeout_s=ITEM_TIMEOUT_S) as pool:
    yield pool


def test_pool_scores_custom_reward_with_format_weight(scripted_pool):
  items = [RewardItem("\\boxed{3}", "3"), RewardItem("the answer is 3", "3"),
           RewardItem("\\boxed{4}", "3"), RewardItem("nothing", "3")]
  result = scripted_pool.score(items)
  np.testing.assert_array_equal(result.scores, [1, 1, 0, 0])
  np.testing.assert_array_equal(result.format, [1, 0, 1, 0])
  np.testing.assert_array_equal(result.rewards, [1.5, 1.0, 0.5, 0.0])
  assert result.rewards.dtype == np.float32
  assert (result.timeouts, result.errors, result.first_error) == (0, 0, None)
  in_process = score_in_process(scripted_pool.spec, items)
  np.testing.assert_array_equal(in_process.rewards, result.rewards)
  assert scripted_pool.score([]).rewards.shape == (0,)


def test_pool_counts_errors_and_crashes(scripted_pool):
  items = [RewardItem("\\boxed{1}", "1"), RewardItem("RAISE \\boxed{1}", "1"),
           RewardItem("EXIT", "1"), RewardItem("\\boxed{2}", "2")]
  result = scripted_pool.score(items)
  np.testing.assert_array_equal(result.rewards, [1.5, 0, 0, 1.5])
  assert (result.errors, result.timeouts) == (2, 0)
  assert "ValueError: scripted failure" in result.first_error or "exit code 3" in (
      result.first_error)


def test_pool_times_out_a_stuck_item_and_recovers(scripted_pool):
  restarts = scripted_pool.restarts
  items = [RewardItem("SLEEP", "1")] + [RewardItem(f"\\boxed{{{i}}}", str(i)) for i in range(6)]
  start = time.monotonic()
  result = scripted_pool.score(items)
  assert time.monotonic() - start < ITEM_TIMEOUT_S + 10
  assert (result.timeouts, result.errors) == (1, 0)
  np.testing.assert_array_equal(result.rewards, [0] + [1.5] * 6)
  assert scripted_pool.restarts == restarts + 1
  again = scripted_pool.score(items[1:])
  np.testing.assert_array_equal(again.rewards, [1.5] * 6)
  assert again.timeouts == 0


def test_pool_math_verify_batch_is_deterministic():
  items = []
  for i in range(32):
    truth = f"\\frac{{{i}}}{{4}}"
    right = i % 3 != 0
    answer = f"{i / 4:g}" if right else f"{i / 4 + 1:g}"
    items.append(RewardItem(f"Work for {i}. \\boxed{{{answer}}}", truth))
  expected = np.array([1.0 if i % 3 != 0 else 0.0 for i in range(32)], np.float32)
  with RewardPool(RewardSpec("math_verify"), num_workers=2, timeout_s=10) as pool:
    first = pool.score(items)
    start = time.perf_counter()
    second = pool.score(items)
    elapsed = time.perf_counter() - start
  np.testing.assert_array_equal(first.rewards, expected)
  np.testing.assert_array_equal(second.rewards, first.rewards)
  assert (second.errors, second.timeouts) == (0, 0)
  print(f"math_verify: 32 items in {elapsed * 1000:.0f} ms with 2 workers")
  with pytest.raises(RuntimeError, match="closed"):
    pool.score(items)


def test_pool_reports_a_worker_that_fails_to_start():
  with pytest.raises(UserInputError, match="failed to start: RuntimeError: scripted warm-up"):
    RewardPool(RewardSpec("test_bad_warmup"), num_workers=1)

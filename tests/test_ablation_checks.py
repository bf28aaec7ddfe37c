"""experiments/ablation_checks.py on small synthetic histories: each check's figures and
its verdict, both ways."""
import pytest

from experiments import ablation_checks as checks


def _step(n, **fields):
  return {"step": n, **fields}


def test_accept_gain_is_judged_on_the_last_steps_both_drafted():
  accept = [2.0, 0.0, 3.0, 2.6, 2.4]                  # no SD at step 2
  online = [_step(0)] + [_step(s, **{"spec/accept_len": a}) for s, a in enumerate(accept, 1)]
  frozen = [_step(s, **{"spec/accept_len": 2.0}) for s in range(1, 6)]
  gain = checks.accept_gain(online, frozen)
  assert gain["steps"] == [1, 3, 4, 5] and gain["ratio_by_step"] == [1.0, 1.5, 1.3, 1.2]
  assert gain["ratio_last"] == 1.2 and gain["ratio_late_median"] == 1.3 and gain["holds"]
  assert not checks.accept_gain(online[:2], frozen)["holds"]      # 1.0
  assert not checks.accept_gain([], frozen)["holds"]


def test_heldout_gain_compares_deployed_and_shipped_on_the_same_windows():
  scored = lambda s, d, sh: _step(s, **{"drafter/heldout_accept_deployed": d,
                                        "drafter/heldout_accept_shipped": sh})
  online = [_step(0), scored(1, 1.0, 1.0), _step(2), scored(3, 1.6, 1.0), scored(4, 1.4, 1.0),
            scored(5, 1.5, 1.0)]
  gain = checks.heldout_gain(online)
  assert gain["steps"] == [1, 3, 4, 5]                       # step 2: the gate did not score
  assert gain["ratio_by_step"] == pytest.approx([1.0, 1.3, 1.2, 1.25])
  assert gain["ratio_late_median"] == pytest.approx(1.25) and gain["holds"]
  assert not checks.heldout_gain(online[:2])["holds"]
  assert checks.heldout_gain([_step(1)]) is None             # a run without the shipped score


def test_accept_order():
  assert checks.accept_order({"tlt": 2.5, "tlt_frozen": 2.2, "tlt_base": 1.4, "baseline": None})[
      "holds"]
  worse = checks.accept_order({"tlt": 2.1, "tlt_frozen": 2.2})
  assert worse["configs"] == ["tlt", "tlt_frozen"] and not worse["holds"]
  assert checks.accept_order({"tlt": 2.1, "baseline": None}) is None


def test_idle_use_counts_the_steps_process_0_trained_in():
  history = [
      _step(1, **{"drafter/idle_device_s_available": 0.0, "drafter/idle_device_s_used": 0.0}),
      _step(2, **{"drafter/idle_device_s_available": 10.0, "drafter/idle_device_s_used": 9.0,
                  "drafter/train_spans": [[0.1, 3.1], [3.1, 6.1], [6.1, 9.1]],
                  "drafter/preempt_latency_s": 1.0}),
      _step(3, **{"drafter/idle_device_s_available": 10.0, "drafter/idle_device_s_used": 8.0,
                  "drafter/train_spans": [[0.5, 4.5], [4.5, 8.5]],
                  "drafter/preempt_latency_s": 2.0})]
  use = checks.idle_use(history)
  assert use["steps"] == [2, 3] and use["used_frac"] == pytest.approx(0.85)
  assert use["drafter_steps"] == 5 and use["drafter_step_s_median"] == pytest.approx(3.0)
  assert use["drafter_step_s_p99"] == pytest.approx(4.0)
  assert use["preempt_latency_p99_s"] == pytest.approx(1.99) and use["holds"]
  history[2]["drafter/preempt_latency_s"] = 4.5                   # longer than any step
  assert not checks.idle_use(history)["holds"]
  assert not checks.idle_use(history[:1])["holds"]                 # nothing to judge


def _run(rewards, val):
  history = [_step(0, **{"val/accuracy": 0.25, "val/prompts": 16})]
  history += [_step(s, **{"reward/mean": r}) for s, r in enumerate(rewards, 1)]
  history[3].update({"val/accuracy": 0.0, "val/prompts": 16})     # an earlier validation
  history[-1].update({"val/accuracy": val, "val/prompts": 16})   # the last step validates
  return history


def test_losslessness_tests_rewards_and_validation_as_two_samples():
  same = checks.losslessness(_run([0.1, 0.3, 0.2, 0.4, 0.0, 0.3], 0.25),
                             _run([0.2, 0.1, 0.3, 0.3, 0.1, 0.2], 0.3125))
  assert same["steps"] == [1, 2, 3, 4, 5, 6] and same["reward_mannwhitney_p"] > 0.5
  assert same["reward_wilcoxon_p"] > 0.5
  assert same["val_step"] == 6 and same["val_correct"] == [4, 5]   # the last validation only
  assert same["val_prompts"] == [16, 16] and same["val_fisher_p"] == pytest.approx(1.0)
  assert same["val_step0"] == [0.25, 0.25] and same["holds"]
  shifted = checks.losslessness(_run([0.0] * 8, 0.25), _run([0.5 + 0.01 * i for i in range(8)],
                                                            0.25))
  assert shifted["reward_mannwhitney_p"] < 0.01 and not shifted["holds"]
  worse = checks.losslessness(_run([0.1] * 6, 1.0), _run([0.1] * 6, 0.0))
  assert worse["val_fisher_p"] < 0.01 and worse["reward_wilcoxon_p"] is None
  assert not worse["holds"]
  # Too few steps for a rank test, or no step-0 validation on either side: not judged.
  few = checks.losslessness(_run([0.1, 0.2, 0.3, 0.2], 0.25), _run([0.1, 0.2, 0.3, 0.2], 0.25))
  assert few["reward_mannwhitney_p"] is None and not few["holds"]
  unvalidated = [_run([0.1, 0.3, 0.2, 0.4, 0.0, 0.3], 0.25)[1:] for _ in range(2)]
  assert checks.losslessness(*unvalidated)["val_step0"] == [None, None]
  assert not checks.losslessness(*unvalidated)["holds"]


def test_tail_share_uses_the_steps_process_0_was_slowest():
  history = [_step(1, **{"rollout/live_rows_trace": [[1, 4], [2, 2], [5, 1], [6, 0]],
                         "rollout/replica_s": [6.0, 3.0], "timing/step_s": 10.0}),
             _step(2, **{"rollout/live_rows_trace": [[1, 4], [3, 1], [4, 0]],
                         "rollout/replica_s": [4.0, 9.0], "timing/step_s": 20.0}),
             _step(3, **{"rollout/live_rows_trace": [[1, 3], [2, 2], [4, 0]],
                         "rollout/replica_s": [4.0, 1.0], "timing/step_s": 20.0})]
  share = checks.tail_share(history, tail_rows=2)
  assert share == {"steps_used": 2, "share_median": pytest.approx((0.4 + 0.1) / 2)}


def test_rollout_share_of_a_baseline_step_with_and_without_the_updates_padding():
  timed = lambda s, rollouts, train, step, **more: _step(s, **{
      "rollout/replica_s": rollouts, "timing/train_s": train, "timing/step_s": step, **more})
  history = [timed(1, [50.0, 1.0], 9.0, 60.0, **{"train/fill": 0.5}),      # compiles: left out
             timed(2, [6.0, 2.0], 4.0, 10.0, **{"train/fill": 0.5}),       # 0.6; 6 / 8
             timed(3, [1.0, 5.0], 4.0, 10.0, **{"train/fill": 0.75}),      # 0.5; 5 / 9
             timed(4, [4.0, 4.0], 6.0, 10.0, **{"train/fill": 1.0})]       # 0.4; 4 / 10
  share = checks.rollout_share(history)
  assert share["steps"] == 3 and share["share_median"] == pytest.approx(0.5)
  assert share["fill_median"] == 0.75
  assert share["share_unpadded_median"] == pytest.approx(5 / 9)
  assert not share["holds"]
  assert checks.rollout_share(history[:2])["holds"]                        # 0.6
  old = checks.rollout_share([{k: v for k, v in r.items() if k != "train/fill"}
                              for r in history])
  assert old["share_median"] == pytest.approx(0.5) and old["share_unpadded_median"] is None


def test_speed_against_the_amdahl_bound():
  base = [_step(s, **{"timing/step_s": t}) for s, t in ((1, 500.0), (2, 100.0), (3, 200.0))]
  other = [_step(s, **{"timing/step_s": t}) for s, t in ((1, 900.0), (2, 120.0), (3, 220.0))]
  result = checks.speed(base, other, tail=0.5, sd_speedup=0.8)    # step 1 left out
  assert result["steps"] == [2, 3] and result["bound_ratio"] == pytest.approx(1.125)
  assert result["ratio_of_medians"] == pytest.approx(170 / 150)
  assert result["ratio_paired_median"] == pytest.approx((1.2 + 1.1) / 2) and result["holds"]
  assert not checks.speed(base, other, tail=0.5, sd_speedup=2.0)["holds"]   # bound 0.75
  # Two processes costing 1.5x one: the bound carries it.
  slower = checks.speed(base, other, tail=0.5, sd_speedup=2.0, structure=1.5)
  assert slower["bound_ratio"] == pytest.approx(1.125) and slower["holds"]
  one = checks.speed(base[:1], other[:1], tail=0.5, sd_speedup=0.8)   # one step: kept
  assert one["steps"] == [1] and one["ratio_of_medians"] == pytest.approx(1.8)


def test_speed_paired_by_step_against_each_steps_own_bound():
  """A step without a tail (f = 0) is bounded by r alone, one with a long tail by much
  less: the median of per-step ratios against one bound from medians would judge the
  steps together; `step_bounds` gives each its own, on the steps process 0's trace
  measures f (it was the slowest)."""
  traced = lambda s, step_s, trace, replicas: _step(s, **{
      "timing/step_s": step_s, "rollout/live_rows_trace": trace, "rollout/replica_s": replicas})
  twin = [traced(1, 90.0, [[1, 4], [2, 0]], [2.0, 1.0]),
          traced(2, 20.0, [[1, 4], [2, 0]], [2.0, 1.0]),               # f = 0
          traced(3, 20.0, [[1, 4], [2, 2], [12, 0]], [12.0, 1.0]),     # f = 10 / 20
          traced(4, 20.0, [[1, 4], [2, 2], [12, 0]], [1.0, 12.0])]     # process 1 slowest
  best = [_step(s, **{"timing/step_s": t}) for s, t in ((1, 60.0), (2, 10.0), (3, 10.0),
                                                        (4, 10.0))]
  bounds = checks.step_bounds(best, twin, tail_rows=2, sd_speedup=2.0)
  assert bounds == {1: pytest.approx(1.5), 2: pytest.approx(2.0), 3: pytest.approx(1.5)}
  other = [_step(s, **{"timing/step_s": t}) for s, t in ((1, 99.0), (2, 21.0), (3, 16.5),
                                                         (4, 30.0))]
  result = checks.speed(best, other, tail=0.5, sd_speedup=2.0, structure=2.0, bounds=bounds)
  assert result["bounded_steps"] == [2, 3]                  # step 1 compiles; 4 has no f
  assert result["over_step_bound_median"] == pytest.approx((1.05 + 1.1) / 2)
  assert result["holds"]
  # Against the one bound from medians (1.5) the per-step median (2.1, 1.65, 3.0) misses.
  assert result["ratio_paired_median"] == pytest.approx(2.1)
  assert not checks.speed(best, other, tail=0.5, sd_speedup=2.0, structure=2.0)["holds"]
  same = checks.step_bounds(twin, twin, tail_rows=2, sd_speedup=2.0)     # r = 1
  assert same[3] == pytest.approx(0.75)

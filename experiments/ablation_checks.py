"""The TLT issue's checks over the ablation's run histories (experiments.ablate writes them
beside its table): each returns the figures it judged by and whether the goal holds.

- adaptation: `tlt`'s accept length over `tlt_frozen`'s on the same steps (process 0's
  replica; under sampling the runs emit other tokens), the same on the same tokens (the
  deploy gate's held-out estimate of `tlt`'s deployed drafter over the shipped one), and
  the order `tlt` >= `tlt_frozen` >= `tlt_base`;
- idle time: drafter seconds used over the idle seconds available, and the stop's latency
  against one drafter step (every replica's figures, from the steps some replica was
  idle);
- losslessness: `baseline`'s and `tlt`'s rewards per step as two samples (Mann-Whitney U;
  the paired Wilcoxon test beside it, as each step draws the same prompts), their last
  validation accuracies (Fisher's exact test), and step 0's greedy validation, which
  lossless SD leaves equal. A p-value over 0.05 is no proof of equality, only the absence
  of a detected difference at this sample size;
- the workload: the rollout's share of a `baseline` step, and what it would be with the
  update's padding gone (`train/fill`);
- speed: a drafting config's step time over the faster baseline's against the bound from
  the two-process baseline's tail share, the SD speedup measured at the tail's batch and
  (when one process is faster) what two processes cost against one, paired by step
  (`step_bounds`).
"""
from __future__ import annotations

import statistics
from typing import Any, Sequence

import numpy as np
from scipy import stats

ACCEPT_GAIN_GOAL = 1.2      # online over frozen accept length, by the last step
IDLE_USED_GOAL = 0.8        # idle seconds used / available
SIGNIFICANCE = 0.05         # two-sample tests: "the same" unless p is below this
SPEED_SLACK = 1.1           # measured step-time ratio at most 10% over the bound
MIN_STEPS = 5               # fewer steps per side: a rank test cannot reach p < 0.05
LAST_STEPS = 3              # the accept gain's verdict: the median over the last steps
ROLLOUT_SHARE_GOAL = 0.6    # the rollout's share of a baseline step: a long-tailed workload

Records = Sequence[dict[str, Any]]


def _steps(history: Records) -> dict[int, dict[str, Any]]:
  return {r["step"]: r for r in history if r.get("step", 0) >= 1}


def median(values: Sequence[float]) -> float | None:
  return statistics.median(values) if values else None


def slowest_rollout_s(record: dict[str, Any]) -> float:
  """The step's rollout seconds: the slowest replica's (with several), as the step waits
  for it; `timing/rollout_s` is process 0's own."""
  per_replica = record.get("rollout/replica_s")
  return float(max(per_replica)) if per_replica else float(record["timing/rollout_s"])


def step_rollout_share(record: dict[str, Any]) -> float:
  """The slowest replica's rollout seconds over the step's."""
  return slowest_rollout_s(record) / record["timing/step_s"]


def rollout_share(baseline: Records) -> dict[str, Any]:
  """The rollout's share of a `baseline` step (steps after the first, which compiles), and
  the same with the update's padding gone: its seconds scaled by `train/fill`, its cost per
  computed slot kept (the most this trainer reaches here); None where the history
  predates `train/fill`."""
  timed = [r for s, r in sorted(_steps(baseline).items()) if s > 1]
  shares, unpadded, fills = [], [], []
  for r in timed:
    shares.append(step_rollout_share(r))
    if "train/fill" in r:
      fills.append(r["train/fill"])
      unpadded.append(slowest_rollout_s(r) / (r["timing/step_s"]
                                              - r["timing/train_s"] * (1 - r["train/fill"])))
  share = median(shares)
  return {"steps": len(shares), "share_median": share, "fill_median": median(fills),
          "share_unpadded_median": median(unpadded), "goal": ROLLOUT_SHARE_GOAL,
          "holds": share is not None and share >= ROLLOUT_SHARE_GOAL}


def accept_gain(online: Records, frozen: Records) -> dict[str, Any]:
  """Per-step accept length of the online drafter over the frozen one's, on the steps both
  drafted; the goal is judged on the median over the last LAST_STEPS of them."""
  a, b = _steps(online), _steps(frozen)
  common = [s for s in sorted(a.keys() & b.keys())
            if a[s].get("spec/accept_len") and b[s].get("spec/accept_len")]
  ratios = [a[s]["spec/accept_len"] / b[s]["spec/accept_len"] for s in common]
  late = median(ratios[-LAST_STEPS:])
  return {"steps": common, "ratio_by_step": ratios, "ratio_last": ratios[-1] if ratios else None,
          "ratio_late_median": late, "goal": ACCEPT_GAIN_GOAL,
          "holds": late is not None and late >= ACCEPT_GAIN_GOAL}


def heldout_gain(online: Records) -> dict[str, Any] | None:
  """The same question on the same tokens: per step, the deploy gate's held-out estimate
  for the deployed drafter over the shipped one's (both scored on that step's held-out
  windows), as accept lengths (1 + expected accepted drafts); judged as `accept_gain`.
  None where the run logged no shipped score."""
  keys = ("drafter/heldout_accept_deployed", "drafter/heldout_accept_shipped")
  steps = {s: r for s, r in _steps(online).items() if all(k in r for k in keys)}
  if not steps:
    return None
  ratios = [(1 + r[keys[0]]) / (1 + r[keys[1]]) for r in steps.values()]
  late = statistics.median(ratios[-LAST_STEPS:])
  return {"steps": list(steps), "ratio_by_step": ratios, "ratio_late_median": late,
          "goal": ACCEPT_GAIN_GOAL, "holds": late >= ACCEPT_GAIN_GOAL}


def accept_order(accept_len: dict[str, float]) -> dict[str, Any] | None:
  """Whether the median accept lengths fall as drafting loses parts: online, frozen,
  model-free; None with fewer than two of them."""
  order = [c for c in ("tlt", "tlt_frozen", "tlt_base") if accept_len.get(c)]
  if len(order) < 2:
    return None
  return {"configs": order, "accept_len": [accept_len[c] for c in order],
          "holds": all(accept_len[a] >= accept_len[b] for a, b in zip(order, order[1:]))}


def idle_use(history: Records) -> dict[str, Any]:
  """Idle seconds used by drafter training over those available, and the stop's latency
  against one drafter step (the p99 of each: a stop waits for the rest of the step in
  flight), over the steps where a replica finished its rollout before another (every
  replica's seconds: the step's record sums them)."""
  trained = [r for r in _steps(history).values()
             if r.get("drafter/idle_device_s_available", 0) > 0]
  used = sum(r["drafter/idle_device_s_used"] for r in trained)
  available = sum(r["drafter/idle_device_s_available"] for r in trained)
  spans = [end - start for r in trained for start, end in r.get("drafter/train_spans", [])]
  latencies = [r["drafter/preempt_latency_s"] for r in trained
               if "drafter/preempt_latency_s" in r]
  frac = used / available if available else None
  p99 = lambda values: float(np.percentile(values, 99)) if values else None
  latency, step = p99(latencies), p99(spans)
  return {"steps": [r["step"] for r in trained], "used_s": used, "available_s": available,
          "used_frac": frac, "drafter_steps": len(spans),
          "drafter_step_s_median": median(spans),
          "drafter_step_s_p99": step, "preempt_latency_p99_s": latency,
          "holds": (frac is not None and frac >= IDLE_USED_GOAL and latency is not None
                    and latency <= step)}


def losslessness(baseline: Records, tlt: Records) -> dict[str, Any]:
  """Rewards per step and validation accuracies of the two runs as two samples each."""
  a, b = _steps(baseline), _steps(tlt)
  common = sorted(a.keys() & b.keys())
  rewards = [[h[s]["reward/mean"] for s in common] for h in (a, b)]
  judged = len(common) >= MIN_STEPS
  reward_p = float(stats.mannwhitneyu(*rewards, alternative="two-sided").pvalue) if judged \
      else None
  paired_p = (float(stats.wilcoxon(*rewards).pvalue)
              if judged and rewards[0] != rewards[1] else None)
  evals = [{r["step"]: r for r in h if "val/accuracy" in r} for h in (baseline, tlt)]
  last = max((s for s in evals[0].keys() & evals[1].keys() if s > 0), default=None)
  val = [round(e[last]["val/accuracy"] * e[last]["val/prompts"]) for e in evals] if last \
      else None
  prompts = [e[last]["val/prompts"] for e in evals] if last else None
  val_p = (float(stats.fisher_exact([[c, n - c] for c, n in zip(val, prompts)]).pvalue)
           if last else None)
  step0 = [e[0]["val/accuracy"] if 0 in e else None for e in evals]
  return {"steps": common,
          "reward_mean": [statistics.mean(r) for r in rewards] if common else None,
          "reward_mannwhitney_p": reward_p, "reward_wilcoxon_p": paired_p,
          "val_step": last, "val_correct": val, "val_prompts": prompts, "val_fisher_p": val_p,
          "val_step0": step0,
          "holds": (reward_p is not None and reward_p >= SIGNIFICANCE and val_p is not None
                    and val_p >= SIGNIFICANCE and None not in step0 and step0[0] == step0[1])}


def tail_seconds(record: dict[str, Any], tail_rows: int) -> float | None:
  """Seconds process 0's rollout spent with <= tail_rows live rows (where SD would run),
  from its live-rows trace; None without one."""
  trace = record.get("rollout/live_rows_trace")
  if not trace:
    return None
  return trace[-1][0] - next(t for t, live in trace if live <= tail_rows)


def step_tail_shares(history: Records, tail_rows: int) -> dict[int, float]:
  """Per step, the share the slowest replica spends with <= tail_rows live rows: process
  0's trace (`tail_seconds`), on the steps where it was the slowest."""
  shares = {}
  for step, r in _steps(history).items():
    tail, per_replica = tail_seconds(r, tail_rows), r.get("rollout/replica_s", [0])
    if tail is not None and per_replica[0] >= max(per_replica):
      shares[step] = tail / r["timing/step_s"]
  return shares


def tail_share(history: Records, tail_rows: int) -> dict[str, Any]:
  """The median of `step_tail_shares`, and how many steps it is over."""
  shares = list(step_tail_shares(history, tail_rows).values())
  return {"steps_used": len(shares), "share_median": median(shares)}


def step_bounds(best: Records, twin: Records, tail_rows: int, sd_speedup: float
                ) -> dict[int, float]:
  """Each step's own bound r x (1 - f + f / s): r the two-process baseline `twin`'s step
  over the faster baseline `best`'s (1 when they are one), f `twin`'s tail share of that
  step (`step_tail_shares`). Steps differ: one whose rows all end early has no tail for SD
  to win, so its bound is r."""
  a, b = _steps(best), _steps(twin)
  return {s: b[s]["timing/step_s"] / a[s]["timing/step_s"] * (1 - f + f / sd_speedup)
          for s, f in step_tail_shares(twin, tail_rows).items() if s in a}


def step_ratio(baseline: Records, other: Records) -> dict[str, Any]:
  """`other`'s step time over `baseline`'s on their common steps after the first (step 1
  compiles without --precompile; one step is kept if it is all there is): the median of
  per-step ratios (each step draws the same prompts) and the ratio of the medians."""
  a, b = _steps(baseline), _steps(other)
  common = sorted(a.keys() & b.keys())
  common = common[1:] or common
  times = [[h[s]["timing/step_s"] for s in common] for h in (a, b)]
  ratio = statistics.median(times[1]) / statistics.median(times[0]) if common else None
  paired = statistics.median([y / x for x, y in zip(*times)]) if common else None
  return {"steps": common, "ratio_of_medians": ratio, "ratio_paired_median": paired}


def speed(baseline: Records, other: Records, tail: float, sd_speedup: float,
          structure: float = 1.0, bounds: dict[int, float] | None = None) -> dict[str, Any]:
  """`other`'s step time over `baseline`'s (`step_ratio`) against the bound structure x
  (1 - tail + tail / sd_speedup): Amdahl over the tail SD speeds up, times what the
  drafting configs' process layout costs against `baseline`'s (1 when they share it).
  With `bounds` (`step_bounds`) the verdict pairs by step: the median over the steps that
  have one of each step's ratio over its own bound (a median of per-step ratios against
  a bound from medians mixes steps with and without a tail). Under sampling the configs
  draw other responses, so a step's time also carries its lengths: pair at T=0 for a
  clean figure."""
  ratios = step_ratio(baseline, other)
  bound = structure * (1 - tail + tail / sd_speedup)
  paired = ratios["ratio_paired_median"]
  a, b = _steps(baseline), _steps(other)
  steps = [s for s in ratios["steps"] if s in (bounds or {})]
  over = median([b[s]["timing/step_s"] / a[s]["timing/step_s"] / bounds[s] for s in steps])
  judged = over if over is not None else (paired / bound if paired is not None else None)
  return {**ratios, "tail_share": tail, "sd_speedup_at_tail": sd_speedup,
          "structure_ratio": structure, "bound_ratio": bound,
          "bounded_steps": steps, "over_step_bound_median": over,
          "holds": judged is not None and judged <= SPEED_SLACK}

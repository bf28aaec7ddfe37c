"""The TLT issue's checks over the ablation's run histories (experiments.ablate writes them
beside its table): each returns the figures it judged by and whether the goal holds.

- adaptation: `tlt`'s accept length over `tlt_frozen`'s on the same steps;
- idle time: drafter seconds used over the idle seconds available, and the stop's latency
  against one drafter step (process 0's figures, from the steps it finished first);
- losslessness: `baseline`'s and `tlt`'s rewards per step as two samples (Mann-Whitney U),
  their validation accuracies after step 0 (Fisher's exact test on the pooled counts), and
  step 0's greedy validation, which lossless SD leaves equal;
- speed: a drafting config's step time over `baseline`'s against the Amdahl bound from the
  baseline's tail share and the SD speedup measured at the tail's batch.
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

Records = Sequence[dict[str, Any]]


def _steps(history: Records) -> dict[int, dict[str, Any]]:
  return {r["step"]: r for r in history if r.get("step", 0) >= 1}


def accept_gain(online: Records, frozen: Records) -> dict[str, Any]:
  """Per-step accept length of the online drafter over the frozen one's, on the steps both
  drafted; the goal is judged on the last such step."""
  a, b = _steps(online), _steps(frozen)
  common = [s for s in sorted(a.keys() & b.keys())
            if a[s].get("spec/accept_len") and b[s].get("spec/accept_len")]
  ratios = [a[s]["spec/accept_len"] / b[s]["spec/accept_len"] for s in common]
  last = ratios[-1] if ratios else None
  return {"steps": common, "ratio_by_step": ratios, "ratio_last": last,
          "goal": ACCEPT_GAIN_GOAL, "holds": last is not None and last >= ACCEPT_GAIN_GOAL}


def idle_use(history: Records) -> dict[str, Any]:
  """Idle seconds used by drafter training over those available, and the stop's latency
  (p99 over steps) against the median drafter step, over the steps process 0 trained in."""
  trained = [r for r in _steps(history).values()
             if r.get("drafter/idle_device_s_available", 0) > 0]
  used = sum(r["drafter/idle_device_s_used"] for r in trained)
  available = sum(r["drafter/idle_device_s_available"] for r in trained)
  spans = [end - start for r in trained for start, end in r.get("drafter/train_spans", [])]
  latencies = [r["drafter/preempt_latency_s"] for r in trained
               if "drafter/preempt_latency_s" in r]
  frac = used / available if available else None
  drafter_step = statistics.median(spans) if spans else None
  p99 = float(np.percentile(latencies, 99)) if latencies else None
  return {"steps": [r["step"] for r in trained], "used_s": used, "available_s": available,
          "used_frac": frac, "drafter_step_s_median": drafter_step,
          "preempt_latency_p99_s": p99,
          "holds": (frac is not None and frac >= IDLE_USED_GOAL and p99 is not None
                    and p99 <= drafter_step)}


def losslessness(baseline: Records, tlt: Records) -> dict[str, Any]:
  """Rewards per step and validation accuracies of the two runs as two samples each."""
  a, b = _steps(baseline), _steps(tlt)
  common = sorted(a.keys() & b.keys())
  rewards = [[h[s]["reward/mean"] for s in common] for h in (a, b)]
  reward_p = float(stats.mannwhitneyu(*rewards, alternative="two-sided").pvalue)
  evals = [{r["step"]: r for r in h if "val/accuracy" in r} for h in (baseline, tlt)]
  eval_steps = sorted(evals[0].keys() & evals[1].keys())
  counts = [[sum(round(e[s]["val/accuracy"] * e[s]["val/prompts"]) for s in eval_steps if s)
             for e in evals],
            [sum(e[s]["val/prompts"] for s in eval_steps if s) for e in evals]]
  table = [[c, n - c] for c, n in zip(*counts)]
  val_p = float(stats.fisher_exact(table).pvalue) if sum(counts[1]) else None
  step0 = [e[0]["val/accuracy"] if 0 in e else None for e in evals]
  return {"steps": common, "reward_mean": [statistics.mean(r) for r in rewards],
          "reward_mannwhitney_p": reward_p, "val_steps": eval_steps,
          "val_correct": counts[0], "val_prompts": counts[1], "val_fisher_p": val_p,
          "val_step0": step0,
          "holds": (reward_p >= SIGNIFICANCE and (val_p is None or val_p >= SIGNIFICANCE)
                    and step0[0] == step0[1])}


def tail_share(history: Records, tail_rows: int) -> dict[str, Any]:
  """The share of a step the slowest replica spends with <= tail_rows live rows (where SD
  would run): process 0's live-rows trace, over the steps where it was the slowest."""
  shares = []
  for r in _steps(history).values():
    trace, per_replica = r.get("rollout/live_rows_trace"), r.get("rollout/replica_s", [0])
    if not trace or per_replica[0] < max(per_replica):
      continue
    start = next(t for t, live in trace if live <= tail_rows)
    shares.append((trace[-1][0] - start) / r["timing/step_s"])
  return {"steps_used": len(shares),
          "share_median": statistics.median(shares) if shares else None}


def speed(baseline: Records, other: Records, tail: float, sd_speedup: float
          ) -> dict[str, Any]:
  """`other`'s step time over `baseline`'s (medians over the steps after the first, and the
  median of per-step ratios: each step draws the same prompts) against the Amdahl bound
  1 - tail + tail / sd_speedup."""
  a, b = _steps(baseline), _steps(other)
  common = sorted(a.keys() & b.keys())[1:]
  times = [[h[s]["timing/step_s"] for s in common] for h in (a, b)]
  bound = 1 - tail + tail / sd_speedup
  ratio = statistics.median(times[1]) / statistics.median(times[0]) if common else None
  paired = statistics.median([y / x for x, y in zip(*times)]) if common else None
  return {"steps": common, "tail_share": tail, "sd_speedup_at_tail": sd_speedup,
          "bound_ratio": bound, "ratio_of_medians": ratio, "ratio_paired_median": paired,
          "holds": ratio is not None and ratio <= SPEED_SLACK * bound}

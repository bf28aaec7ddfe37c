"""PNG plots of a run, drawn from its metrics history into the run dir."""
from __future__ import annotations

import os
from typing import Any, Sequence

from tlt_jax.files import atomic_file

PLOTS = ("long_tail.png", "reward.png", "response_len.png", "step_time.png",
         "accept_len.png")
_TIME_PARTS = ("timing/rollout_s", "timing/reward_s", "timing/reference_s", "timing/train_s",
               "timing/sync_s", "timing/eval_s", "timing/checkpoint_s")


def _series(history, key):
  points = [(r["step"], r[key]) for r in history if isinstance(r.get(key), (int, float))]
  return [p[0] for p in points], [p[1] for p in points]


def write_plots(run_dir: str, history: Sequence[dict[str, Any]]) -> list[str]:
  """Writes PLOTS; returns their paths. Empty history: nothing to draw."""
  if not history:
    return []
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  paths = []

  def save(fig, name):
    path = os.path.join(run_dir, name)
    fig.tight_layout()
    with atomic_file(path, "wb") as f:
      fig.savefig(f, format="png", dpi=90)
    plt.close(fig)
    paths.append(path)

  last = history[-1]
  fig, ax = plt.subplots(figsize=(6, 3.5))
  trace = last.get("rollout/live_rows_trace") or []
  if trace:
    ax.step([t for t, _ in trace], [n for _, n in trace], where="post")
  ax.set(title=f"live rows during step {last['step']}'s rollout (the long tail)",
         xlabel="seconds into the rollout", ylabel="live rows")
  save(fig, "long_tail.png")

  fig, ax = plt.subplots(figsize=(6, 3.5))
  for key, label in (("reward/mean", "train reward"), ("reward/accuracy", "train accuracy"),
                     ("val/accuracy", "validation accuracy")):
    steps, values = _series(history, key)
    if steps:
      ax.plot(steps, values, marker="o" if key.startswith("val") else None, label=label)
  ax.set(title="reward and validation accuracy", xlabel="step")
  ax.legend()
  save(fig, "reward.png")

  fig, ax = plt.subplots(figsize=(6, 3.5))
  for key in ("response_len/mean", "response_len/max"):
    steps, values = _series(history, key)
    ax.plot(steps, values, label=key)
  ax.set(title="response length", xlabel="step", ylabel="tokens")
  ax.legend()
  save(fig, "response_len.png")

  fig, ax = plt.subplots(figsize=(6, 3.5))
  steps = [r["step"] for r in history]
  bottom = [0.0] * len(steps)
  for key in _TIME_PARTS:
    values = [float(r.get(key, 0.0)) for r in history]
    if any(values):
      ax.bar(steps, values, bottom=bottom, label=key.split("/")[1])
      bottom = [b + v for b, v in zip(bottom, values)]
  ax.set(title="time per step", xlabel="step", ylabel="seconds")
  ax.legend(fontsize="small")
  save(fig, "step_time.png")

  fig, ax = plt.subplots(figsize=(6, 3.5))
  steps, values = _series(history, "spec/accept_len")
  ax.plot(steps, values, marker="o")
  ax.set(title="speculative decoding: tokens per verify step", xlabel="step",
         ylabel="accept length")
  save(fig, "accept_len.png")
  return paths

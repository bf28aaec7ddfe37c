"""Per-step metrics: one JSON record per step in `metrics.jsonl`, TensorBoard scalars, a
progress line with ETA, and the end-of-run summary table.

metrics.jsonl is rewritten from the checkpoint's history on resume, so it always holds
exactly the steps the training state has seen (a step after the last checkpoint that a
crash lost is not left behind).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Sequence

from tlt_jax.files import atomic_file

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
# The summary table's rows: (metric, how the run is summarized).
SUMMARY_KEYS = ("reward/mean", "reward/accuracy", "val/accuracy", "response_len/mean",
                "actor/pg_loss", "actor/kl", "actor/entropy", "spec/accept_len",
                "timing/rollout_s", "timing/train_s", "timing/step_s", "perf/tokens_per_s",
                "mem/peak_rss_gib")


def scalar_items(record: dict[str, Any]) -> list[tuple[str, float]]:
  """The record's finite numeric entries (TensorBoard takes scalars only)."""
  return [(k, float(v)) for k, v in record.items()
          if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]


class MetricsLog:
  """Writes records to the run dir; `history` holds every record so far."""

  def __init__(self, run_dir: str, history: Sequence[dict[str, Any]] = ()):
    from tensorboardX import SummaryWriter

    self.path = os.path.join(run_dir, METRICS_FILE)
    self.history = list(history)
    with atomic_file(self.path) as f:
      for record in self.history:
        f.write(json.dumps(record) + "\n")
    self._writer = SummaryWriter(os.path.join(run_dir, TENSORBOARD_DIR), flush_secs=10)

  def write(self, record: dict[str, Any]) -> None:
    self.history.append(record)
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")
    for key, value in scalar_items(record):
      if key != "step":
        self._writer.add_scalar(key, value, record["step"])

  def close(self) -> None:
    self._writer.close()


class Progress:
  """One line per step on stderr: a bar, the step, the live reward and the ETA."""

  def __init__(self, total_steps: int, first_step: int = 0, width: int = 24):
    self.total, self.first, self.width = total_steps, first_step, width
    self.start = time.perf_counter()

  def update(self, step: int, record: dict[str, Any]) -> None:
    done = step / self.total
    filled = int(round(done * self.width))
    elapsed = time.perf_counter() - self.start
    rate = elapsed / max(step - self.first, 1)
    eta = rate * (self.total - step)
    parts = [f"[{'#' * filled}{'.' * (self.width - filled)}] step {step}/{self.total}",
             f"reward {record.get('reward/mean', float('nan')):.3f}"]
    if "val/accuracy" in record:
      parts.append(f"val acc {record['val/accuracy']:.3f}")
    parts += [f"len {record.get('response_len/mean', 0):.0f}",
              f"{record.get('timing/step_s', 0):.1f} s/step", f"ETA {format_seconds(eta)}"]
    print("  ".join(parts), file=sys.stderr, flush=True)


def format_seconds(seconds: float) -> str:
  minutes, secs = divmod(int(round(seconds)), 60)
  return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def summary_table(history: Sequence[dict[str, Any]]) -> str:
  """first / last / mean of the headline metrics over the run."""
  lines = [f"{'metric':22s} {'first':>10s} {'last':>10s} {'mean':>10s}"]
  for key in SUMMARY_KEYS:
    values = [r[key] for r in history if isinstance(r.get(key), (int, float))]
    if values:
      lines.append(f"{key:22s} {values[0]:10.4g} {values[-1]:10.4g} "
                   f"{sum(values) / len(values):10.4g}")
  return "\n".join(lines)

"""A run's learning curve and whether its held-out accuracy rose significantly.

  python benchmarks/learning_curve.py --run_dir=runs/smollm2_cpu [--output_json=FILE]

Reads the run dir's metrics.jsonl (experiments.run): per-step train reward, response
length and step time, and the greedy validation accuracy at each evaluation. The first
and last evaluations (same held-out prompts) are compared with a two-proportion z-test,
one-sided (did accuracy rise?). One JSON object on stdout.
"""
from __future__ import annotations

import json
import math
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from absl import flags  # noqa: E402

from benchmarks.report import emit  # noqa: E402
from experiments import cli  # noqa: E402
from tlt_jax.errors import UserInputError  # noqa: E402

_RUN_DIR = flags.DEFINE_string("run_dir", None, "An experiments.run run dir.")
_OUTPUT = flags.DEFINE_string("output_json", None, "Also write the JSON here.")
flags.mark_flag_as_required("run_dir")


def two_proportion_test(hits_a: int, hits_b: int, n: int) -> dict:
  """z and one-sided p of 'b's rate > a's', n trials each (pooled standard error)."""
  pooled = (hits_a + hits_b) / (2 * n)
  se = math.sqrt(2 * pooled * (1 - pooled) / n)
  z = (hits_b - hits_a) / n / se if se else 0.0
  return {"z": z, "p_one_sided": 0.5 * math.erfc(z / math.sqrt(2))}


def read_history(run_dir: str) -> list[dict]:
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.isfile(path):
    raise UserInputError(f"--run_dir={run_dir}: no metrics.jsonl")
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def main(argv):
  del argv
  if _OUTPUT.value:
    cli.check_output_file(_OUTPUT.value, "--output_json")
  history = read_history(_RUN_DIR.value)
  evals = [r for r in history if "val/accuracy" in r]
  if len(evals) < 2:
    raise UserInputError(f"--run_dir={_RUN_DIR.value}: fewer than 2 validations")
  first, last = evals[0], evals[-1]
  n = int(first["val/prompts"])
  hits = [round(r["val/accuracy"] * n) for r in (first, last)]
  steps = [r for r in history if r.get("step", 0) > 0]
  emit({
      "run_dir": _RUN_DIR.value,
      "val_prompts": n,
      "val_accuracy": {str(r["step"]): r["val/accuracy"] for r in evals},
      "val_reward": {str(r["step"]): r["val/reward"] for r in evals},
      "accuracy_gain": last["val/accuracy"] - first["val/accuracy"],
      "significance": two_proportion_test(hits[0], hits[1], n),
      "train_reward_per_step": [round(r["reward/mean"], 4) for r in steps],
      "response_len_mean_per_step": [round(r["response_len/mean"], 2) for r in steps],
      "response_clip_frac_per_step": [round(r["response_len/clip_frac"], 4) for r in steps],
      "step_s_per_step": [round(r["timing/step_s"], 1) for r in steps],
      "total_train_s": sum(r["timing/step_s"] for r in steps),
  }, _OUTPUT.value)


if __name__ == "__main__":
  cli.run(main)

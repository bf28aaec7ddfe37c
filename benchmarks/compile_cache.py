"""A run with a cold compilation cache, then the same run with it warm: programs built and
loaded, and seconds from launch to the first step's start.

  python benchmarks/compile_cache.py --output_json=benchmarks/results/compile_cache_cpu.json

Runs `python -m experiments.run --flagfile=FLAGFILE --steps=N` twice, each into a fresh run
dir, both with one fresh --compilation_cache_dir and one fresh tokenizer cache (the first
run converts the GGUF's tokenizer, the second reads it back). The first step starts once
the run has loaded, precompiled (with --precompile) and validated (step 0): the time of
the "training ..." line plus step 0's `timing/eval_s`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from absl import flags  # noqa: E402
from benchmarks.report import emit  # noqa: E402
from experiments import cli  # noqa: E402

_FLAGFILE = flags.DEFINE_string("run_flagfile", "experiments/configs/quickstart.flags",
                                "The run to time, as a flagfile.")
_STEPS = flags.DEFINE_integer("steps", 1, "RL steps per run.", lower_bound=1)
_EXTRA = flags.DEFINE_list("run_flags", [], "More flags for both runs (say --precompile).")
_OUTPUT = flags.DEFINE_string("output_json", None, "Also write the JSON here.")


def timed_run(run_dir: str, cache_dir: str, tokenizer_cache: str) -> dict:
  """One run: wall seconds to each stage, and its first step's compile metrics."""
  command = [sys.executable, "-m", "experiments.run", f"--flagfile={_FLAGFILE.value}",
             f"--steps={_STEPS.value}", f"--run_dir={run_dir}",
             f"--compilation_cache_dir={cache_dir}", *[f"--{f.lstrip('-')}" for f in
                                                         _EXTRA.value]]
  start = time.perf_counter()
  env = dict(os.environ, TLT_JAX_TOKENIZER_CACHE=tokenizer_cache)
  proc = subprocess.Popen(command, cwd=REPO, stderr=subprocess.PIPE, text=True, env=env)
  training_s, precompile_line = None, None
  for line in proc.stderr:
    if line.startswith("training ") and training_s is None:
      training_s = time.perf_counter() - start
    if line.startswith("precompiled "):
      precompile_line = line.strip()
  if proc.wait() != 0:
    raise RuntimeError(f"{' '.join(command)} failed with exit code {proc.returncode}")
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  eval_s = records[0].get("timing/eval_s", 0.0) if records[0]["step"] == 0 else 0.0
  step = next(r for r in records if r["step"] == 1)
  return {"first_step_start_s": round(training_s + eval_s, 1),
          "loaded_s": round(training_s, 1), "step0_eval_s": round(eval_s, 1),
          "step1_s": round(step["timing/step_s"], 1),
          "total_s": round(time.perf_counter() - start, 1), "precompile": precompile_line,
          **{k: v for k, v in step.items() if k.startswith("compile/")}}


def main(argv):
  del argv
  with tempfile.TemporaryDirectory() as root:
    caches = os.path.join(root, "jax_cache"), os.path.join(root, "tokenizers")
    cold = timed_run(os.path.join(root, "cold"), *caches)
    warm = timed_run(os.path.join(root, "warm"), *caches)
  emit({"cold": cold, "warm": warm,
        "first_step_start_speedup": round(cold["first_step_start_s"]
                                          / warm["first_step_start_s"], 2)}, _OUTPUT.value)


if __name__ == "__main__":
  cli.run(main)

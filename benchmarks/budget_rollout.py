"""A rollout under a row budget vs the unbounded engine, on SmolLM2 (CPU).

  python benchmarks/budget_rollout.py --max_rows=32 \
      --output=benchmarks/results/budget_rollout_cpu.json \
      --plot=benchmarks/results/budget_rollout_cpu.png

Prints JSON: --prompts reasoning prompts x --samples each (GRPO groups), up to
--max_new_tokens greedy tokens, once with every row at once and once with at most
--max_rows rows (the rest admitted as rows finish). Both sides' programs are compiled
first (`precompile`; or an untimed warm-up round), then the sides alternate (A B A B, `ab.alternate`): wall time
medians and the paired ratio, the KV cache each side holds, whether the greedy tokens are
identical, and the admission waves. --plot draws live rows (and prompts waiting) over time
of the last round of each side.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import ab, questions  # noqa: E402
from benchmarks.report import emit  # noqa: E402
from absl import flags  # noqa: E402
from experiments import cli  # noqa: E402

_MODEL = flags.DEFINE_string("model", "smollm2", "Target: `smollm2` or a model path.")
_PROMPTS = flags.DEFINE_integer("prompts", 64, "Distinct prompts.", lower_bound=1)
_SAMPLES = flags.DEFINE_integer("samples", 4, "Rows per prompt (a GRPO group).", lower_bound=1)
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 256, "Tokens per row at most.",
                                lower_bound=1)
_MAX_ROWS = flags.DEFINE_integer("max_rows", 32, "The budget side's row budget.",
                                 lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 2, "Alternated rounds (A B per round).",
                                lower_bound=1)
_PRECOMPILE = flags.DEFINE_bool(
    "precompile", True, "Compile both sides' program pools first; off: an untimed warm-up "
    "round instead (greedy rounds dispatch the same programs), which holds one rollout's "
    "memory at a time rather than the pool builder's states of every batch bucket.")
_SEED = flags.DEFINE_integer("seed", 12345, "Prompt seed (held out from drafter training).")
_OUTPUT = flags.DEFINE_string("output", None, "Also write the JSON here.")
_PLOT = flags.DEFINE_string("plot", None, "Write the live-rows PNG here.")


def log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def plot(traces: dict[str, dict], path: str, title: str) -> None:
  """Live rows (solid) and prompts waiting (dashed) over time, one colour per side."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(9, 4.5))
  for (name, stats), colour in zip(traces.items(), ("tab:blue", "tab:orange")):
    seconds, live = zip(*stats["rollout/live_rows"])
    ax.step(seconds, live, where="post", color=colour, label=f"{name}: live rows")
    if any(n for _, n in stats["rollout/queued"]):
      seconds, queued = zip(*stats["rollout/queued"])
      ax.step(seconds, queued, where="post", color=colour, linestyle="--",
              label=f"{name}: prompts waiting")
  ax.set_xlabel("seconds into the rollout")
  ax.set_ylabel("rows")
  ax.set_title(title)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv):
  del argv
  for path, flag in ((_OUTPUT.value, "--output"), (_PLOT.value, "--plot")):
    if path:
      cli.check_output_file(path, flag)
  import jax.numpy as jnp

  from tlt_jax.models.loading import load_model
  from tlt_jax.rollout.engine import generate
  from tlt_jax.rollout.precompile import precompile
  from tlt_jax.rollout.sampling import SamplingParams
  from tlt_jax.rollout.weights import rollout_layout

  asked = questions.load({"main": (questions.MAIN_TASKS, _PROMPTS.value, _SEED.value)})
  model = load_model(_MODEL.value, dtype=jnp.float32)
  params = rollout_layout(model.params)
  tokenizer = model.tokenizer
  rows = [tokenizer.chat_prompt(q) for q in asked["main"] for _ in range(_SAMPLES.value)]
  settings = dict(max_new_tokens=_MAX_NEW.value, sampling=SamplingParams(temperature=0.0),
                  eos_ids=tuple(tokenizer.eos_token_ids))
  sides = {"unbounded": None, "budget": _MAX_ROWS.value}
  start = time.perf_counter()
  compiled = {name: precompile(params, model.config, rows, max_rows=max_rows, **settings)
              for name, max_rows in sides.items()} if _PRECOMPILE.value else None
  log(f"precompiled {compiled} programs in {time.perf_counter() - start:.0f} s")

  def run(max_rows, number):
    start = time.perf_counter()
    result = generate(params, model.config, rows, max_rows=max_rows, seed=number, **settings)
    seconds = time.perf_counter() - start
    log(f"round {number}, max_rows={max_rows}: {seconds:.1f} s")
    return seconds, result

  rounds = ab.alternate({name: (lambda number, m=max_rows: run(m, number))
                         for name, max_rows in sides.items()}, _REPEATS.value,
                        warmup=0 if _PRECOMPILE.value else 1)
  seconds = {name: [s for s, _ in ab.side(rounds, name)] for name in sides}
  results = {name: [r for _, r in ab.side(rounds, name)] for name in sides}
  tokens = lambda result: [o.token_ids for o in result.outputs]
  reference = tokens(results["unbounded"][0])
  last = {name: results[name][-1].stats for name in sides}
  keep = ("rollout/max_rows", "rollout/peak_rows", "rollout/admission_waves",
          "rollout/kv_cache_bytes", "cache_length", "generated_tokens", "rollout/tail_s",
          "compile/new_programs")
  report = {
      "setting": {"model": _MODEL.value, "prompts": _PROMPTS.value,
                  "samples": _SAMPLES.value, "rows": len(rows),
                  "max_new_tokens": _MAX_NEW.value, "temperature": 0.0,
                  "max_rows": _MAX_ROWS.value, "repeats": _REPEATS.value, "order": "A B A B"},
      "precompiled_programs": compiled,
      "wall_s": seconds,
      "wall_s_median": {name: statistics.median(s) for name, s in seconds.items()},
      "budget_over_unbounded_paired": ab.paired_ratios(seconds["budget"],
                                                       seconds["unbounded"]),
      "greedy_tokens_identical": all(tokens(r) == reference for side in results.values()
                                     for r in side),
      "stats": {name: {k: stats[k] for k in keep} for name, stats in last.items()},
  }
  report["budget_over_unbounded_paired_median"] = statistics.median(
      report["budget_over_unbounded_paired"])
  emit(report, _OUTPUT.value)
  if _PLOT.value:
    plot(last, _PLOT.value, f"SmolLM2 greedy rollout, {len(rows)} rows x <= {_MAX_NEW.value} "
         f"tokens: unbounded vs --rollout_max_rows={_MAX_ROWS.value}")


if __name__ == "__main__":
  cli.run(main)

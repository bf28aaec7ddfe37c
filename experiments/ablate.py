"""The TLT ablation in one command: each config's `experiments.run`, then one table.

  python -m experiments.ablate --configs=baseline,tlt_base,tlt_frozen,tlt,tlt_hybrid \
      --steps=10 [--run_root=runs/ablation] [--read_only] [--out=benchmarks/results/ablation_cpu]
      [--set=--FLAG=VALUE ...]

A config NAME is the flagfile experiments/configs/ablation/NAME.flags (every one includes the
shared workload, base.flags). Its run dir is RUN_ROOT/NAME: a run that exists is continued
(`--resume=auto`). Each finished run's metrics history is kept beside the table, in
OUT_runs/NAME.jsonl with the flags its flagfile set (OUT_runs/NAME.flags.json): run dirs stay
on the machine that made them, the kept histories go with the results, so the table can be
built over several sessions and machines. A config whose kept history reaches --steps is not
run again; one kept with other flags than its flagfile sets now is refused (delete the kept
files to run it again). With --read_only nothing runs. Every input is checked (config
names, the flagfiles parsed by experiments.run's own flags, the histories) before any run
starts.

Writes OUT.json and OUT.md (one row per config: median step, rollout and tail seconds,
accept length, drafter train steps, idle seconds used / available, reward and validation
accuracy at the last step, steps done; below it the TLT issue's checks, from
experiments/ablation_checks.py) and OUT_step_time.png, OUT_accept_len.png (one line per
config). The speed check's SD speedup at the tail's batch comes from --sd_speedup_json:
  python benchmarks/rollout.py --batches=1,2 --temperatures=1 \
      --strategies=3_1_4,4_1_5,6_1_7 --tail_rows=0 --accept_prompts=0 --output=FILE
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Sequence

from absl import flags

from experiments import ablation_checks, cli
from experiments.ablation_checks import median
from tlt_jax.errors import UserInputError
from tlt_jax.files import atomic_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_DIR = os.path.join("experiments", "configs", "ablation")   # relative to REPO
CONFIGS = ("baseline", "baseline_one_process", "tlt_base", "tlt_frozen", "tlt", "tlt_hybrid")
BASELINES = ("baseline", "baseline_one_process")   # no SD: two pinned processes, or one
METRICS_FILE = "metrics.jsonl"   # tlt_jax.rl.metrics.METRICS_FILE, without importing jax's rl

_CONFIGS = flags.DEFINE_list("configs", ",".join(CONFIGS), f"Configs to run, in order: any "
                             f"of {', '.join(CONFIGS)}.")
_STEPS = flags.DEFINE_integer("steps", 10, "RL steps per config.")
_RUN_ROOT = flags.DEFINE_string("run_root", os.path.join("runs", "ablation"),
                                "Run dirs: RUN_ROOT/CONFIG.")
_READ_ONLY = flags.DEFINE_bool("read_only", False, "Run nothing: build the table from the "
                               "kept histories (and run dirs newer than them).")
_SD_SPEEDUP_JSON = flags.DEFINE_string(
    "sd_speedup_json", os.path.join("benchmarks", "results", "rollout_tail_batch_cpu.json"),
    "benchmarks/rollout.py's JSON at the tail's batches: its paired SD speedup at batches <= "
    "the SD threshold, at the workload's temperature, bounds the step time (the speed "
    "check); a missing file skips that check, saying so.")
_SET = flags.DEFINE_multi_string(
    "set", [], "A flag added to every config's command line after its flagfile, e.g. "
    "--set=--temperature=0: the ablation on a variant of the workload (give it its own "
    "--run_root and --out).")
_OUT = flags.DEFINE_string("out", os.path.join("benchmarks", "results", "ablation_cpu"),
                           "Output path prefix: OUT.json, OUT.md, OUT_*.png.")


def flagfile(config: str) -> str:
  return os.path.join(CONFIG_DIR, f"{config}.flags")


# Run in a subprocess (experiments.run's flags share names with this module's): parses each
# flagfile with absl and experiments.run's flags; prints, per file, the project's flags it
# sets or the first line of absl's error.
_PARSE = r"""
import json, sys
from absl import flags
import experiments.run
out = {}
extra = json.loads(sys.argv[1])
for path in sys.argv[2:]:
  try:
    flags.FLAGS(["run", "--flagfile=" + path, *extra])
    out[path] = {"flags": {f.name: f.value for m in flags.FLAGS.flags_by_module_dict()
                           if m.startswith("experiments.")
                           for f in flags.FLAGS.get_flags_for_module(m) if f.present}}
  except flags.Error as e:
    out[path] = {"error": str(e).splitlines()[0]}
  flags.FLAGS.unparse_flags()
print(json.dumps(out))
"""


def parse_flagfiles(paths: Sequence[str], extra: Sequence[str] = ()
                    ) -> dict[str, dict[str, Any]]:
  """Each flagfile parsed by experiments.run's own flags (absl), with `extra` flags after
  it: path -> {"flags": the experiments flags they set} or {"error": absl's message (an
  unknown flag, a bad value, a missing included file)}. Paths relative to the repo root,
  as runs use them."""
  result = subprocess.run([sys.executable, "-c", _PARSE, json.dumps(list(extra)), *paths],
                          cwd=REPO, capture_output=True, text=True, check=False)
  if result.returncode != 0:
    raise RuntimeError(f"parsing the flagfiles failed:\n{result.stderr[-2000:]}")
  return json.loads(result.stdout)


def check_inputs(configs: Sequence[str], steps: int, run_root: str, out: str,
                 read_only: bool, extra: Sequence[str] = ()) -> dict[str, Any]:
  """Every input checked before anything runs: one UserInputError naming the first bad one.
  Returns, from one parse of the flagfiles, the SD settings the checks judge by
  (`sd_settings`, under "sd") and each config's flags (under "flags")."""
  if not configs:
    raise UserInputError("--configs: no config given")
  unknown = [c for c in configs if c not in CONFIGS]
  if unknown:
    raise UserInputError(f"--configs: unknown config {unknown[0]!r} (known: "
                         f"{', '.join(CONFIGS)})")
  if len(set(configs)) < len(configs):
    raise UserInputError("--configs: a config is named twice")
  if steps < 1:
    raise UserInputError(f"--steps={steps}: must be >= 1")
  paths = [flagfile(c) for c in configs]
  paths += [flagfile("tlt_frozen")] * (flagfile("tlt_frozen") not in paths)
  parsed = parse_flagfiles(paths, extra)
  for path in paths:
    if "error" in parsed[path]:
      raise UserInputError(f"{path}{' with --set' if extra else ''}: {parsed[path]['error']}")
  for config in configs:
    check_kept(config, out, parsed[flagfile(config)]["flags"])
    run_history = os.path.join(run_root, config, METRICS_FILE)
    if read_only and not (os.path.isfile(kept_path(out, config))
                          or os.path.isfile(run_history)):
      raise UserInputError(f"--read_only: no run of {config!r}: neither "
                           f"{kept_path(out, config)} nor {run_history} exists")
  return {"sd": sd_settings(parsed[flagfile("tlt_frozen")]["flags"]),
          "flags": {c: parsed[flagfile(c)]["flags"] for c in configs}}


def kept_path(out: str, config: str) -> str:
  return os.path.join(f"{out}_runs", f"{config}.jsonl")


def _kept_flags_path(out: str, config: str) -> str:
  return os.path.join(f"{out}_runs", f"{config}.flags.json")


def check_kept(config: str, out: str, flags_now: dict[str, Any]) -> None:
  """A kept history must come from the flags the config's flagfile sets now."""
  path = _kept_flags_path(out, config)
  if not os.path.isfile(kept_path(out, config)):
    return
  if not os.path.isfile(path):
    raise UserInputError(f"{kept_path(out, config)}: kept without {path} (the flags it ran "
                         f"with); delete it to run {config!r} again")
  with open(path) as f:
    kept = json.load(f)
  differ = sorted(k for k in kept.keys() | flags_now.keys() if kept.get(k) != flags_now.get(k))
  if differ:
    k = differ[0]
    raise UserInputError(f"{kept_path(out, config)}: run with --{k}={kept.get(k)}, "
                         f"{flagfile(config)} now sets {flags_now.get(k)}; delete it and "
                         f"{path} to run {config!r} again")


def keep(config: str, run_root: str, out: str, flags_set: dict[str, Any]) -> None:
  """Copies the run dir's history to OUT_runs/ when it has more steps than the kept one."""
  source = os.path.join(run_root, config, METRICS_FILE)
  if not os.path.isfile(source) or steps_done(source) <= steps_done(kept_path(out, config)):
    return
  os.makedirs(f"{out}_runs", exist_ok=True)
  with open(source) as f, atomic_file(kept_path(out, config)) as g:
    g.write(f.read())
  with atomic_file(_kept_flags_path(out, config)) as g:
    json.dump(flags_set, g, indent=1, sort_keys=True)


def read_history(path: str) -> list[dict[str, Any]]:
  """A run's metrics records (step 0 holds the first validation only)."""
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def steps_done(path: str) -> int:
  if not os.path.isfile(path):
    return 0
  return max((r["step"] for r in read_history(path)), default=0)


def run_command(config: str, run_dir: str, steps: int, extra: Sequence[str] = ()
                ) -> list[str]:
  return [sys.executable, "-m", "experiments.run", f"--flagfile={flagfile(config)}", *extra,
          f"--run_dir={run_dir}", f"--steps={steps}", "--resume=auto"]


def run_configs(configs: Sequence[str], steps: int, run_root: str, out: str,
                flags_set: dict[str, dict[str, Any]], extra: Sequence[str] = ()) -> None:
  """Each config's run to `steps` steps, in order, its output passed through; each
  finished run's history kept (`keep`; run dirs already there were kept before)."""
  for i, config in enumerate(configs, 1):
    run_dir = os.path.abspath(os.path.join(run_root, config))
    done = steps_done(kept_path(out, config))
    head = f"ablate [{i}/{len(configs)}] {config}:"
    if done >= steps:
      print(f"{head} already at step {done} of {steps} ({kept_path(out, config)})",
            file=sys.stderr)
      continue
    print(f"{head} steps {done + 1}..{steps} -> {run_dir}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    code = subprocess.run(run_command(config, run_dir, steps, extra), cwd=REPO,
                          check=False).returncode
    if code != 0:
      print(f"error: {config}: experiments.run exited with code {code} (its output is "
            "above); rerun to continue from its last checkpoint", file=sys.stderr)
      sys.exit(code)
    keep(config, run_root, out, flags_set[config])
    print(f"{head} done in {(time.perf_counter() - start) / 60:.1f} min", file=sys.stderr)


def _values(records, key) -> list[float]:
  return [float(r[key]) for r in records if isinstance(r.get(key), (int, float))]


def summarize(history: Sequence[dict[str, Any]], tail_rows: int) -> dict[str, Any]:
  """One config's table row. Times are medians over the steps after the first (step 1
  compiles) when there are several; counts and idle seconds are sums over all steps; tail
  seconds are process 0's with <= tail_rows live rows (the SD threshold)."""
  steps = [r for r in history if r.get("step", 0) >= 1]
  if not steps:
    return {"steps_done": 0}
  timed = steps[1:] or steps
  used, available = (sum(_values(steps, f"drafter/idle_device_s_{k}"))
                     for k in ("used", "available"))
  evals = [r for r in history if "val/accuracy" in r]
  rollouts = [ablation_checks.slowest_rollout_s(r) for r in timed]
  return {
      "steps_done": steps[-1]["step"],
      "step_s": median(_values(timed, "timing/step_s")),
      "rollout_s": median(rollouts),
      "rollout_frac": median([ablation_checks.step_rollout_share(r) for r in timed]),
      "tail_s": median([t for r in timed
                        if (t := ablation_checks.tail_seconds(r, tail_rows)) is not None]),
      "accept_len": median([v for v in _values(steps, "spec/accept_len") if v > 0]),
      "accept_len_last": steps[-1].get("spec/accept_len"),
      "drafter_train_steps": int(sum(_values(steps, "drafter/train_steps"))),
      "idle_s_used": used, "idle_s_available": available,
      "idle_used_frac": used / available if available else None,
      "reward_last": steps[-1].get("reward/mean"),
      "val_accuracy_last": evals[-1]["val/accuracy"] if evals else None,
      "val_step_last": evals[-1]["step"] if evals else None,
      "response_len_p50": median(_values(steps, "response_len/p50")),
      "response_len_p90": median(_values(steps, "response_len/p90")),
      "response_len_max": max(_values(steps, "response_len/max"), default=None),
  }


# (column title, how a row's cell is written)
_COLUMNS = (
    ("config", lambda r: r["config"]),
    ("steps", lambda r: str(r["steps_done"])),
    ("step s", lambda r: _num(r.get("step_s"), ".1f")),
    ("rollout s (share)", lambda r: f"{_num(r.get('rollout_s'), '.1f')} "
                                    f"({_num(r.get('rollout_frac'), '.2f')})"),
    ("tail s", lambda r: _num(r.get("tail_s"), ".1f")),
    ("accept len (last)", lambda r: f"{_num(r.get('accept_len'), '.2f')} "
                                    f"({_num(r.get('accept_len_last'), '.2f')})"),
    ("drafter steps", lambda r: str(r.get("drafter_train_steps", 0))),
    ("idle s used / available", lambda r: f"{_num(r.get('idle_s_used'), '.0f')} / "
                                          f"{_num(r.get('idle_s_available'), '.0f')}"),
    ("reward (last)", lambda r: _num(r.get("reward_last"), ".3f")),
    ("val acc (step)", lambda r: f"{_num(r.get('val_accuracy_last'), '.3f')} "
                                 f"({_num(r.get('val_step_last'), 'd')})"),
    ("len p50 / p90 / max", lambda r: " / ".join(_num(r.get(f"response_len_{k}"), ".0f")
                                                 for k in ("p50", "p90", "max"))),
)


def _num(value, spec: str) -> str:
  return "-" if value is None else format(value, spec)


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
  """The rows as a markdown table, with a line saying how the figures were taken."""
  lines = ["| " + " | ".join(title for title, _ in _COLUMNS) + " |",
           "|" + "---|" * len(_COLUMNS)]
  lines += ["| " + " | ".join(cell(row) for _, cell in _COLUMNS) + " |" for row in rows]
  lines.append("")
  lines.append("Seconds: medians over the steps after the first (step 1 compiles); rollout s "
               "is the slowest replica's, its share of the step's seconds in brackets; tail s "
               "(seconds with at most the SD threshold's live rows) are process 0's, idle "
               "seconds every replica's. Accept len: median over the steps where SD "
               "ran. Drafter steps and idle seconds: sums over the steps. Lengths: medians of "
               "the steps' p50 and p90, and the longest response.")
  return "\n".join(lines) + "\n"


def per_step(history: Sequence[dict[str, Any]]) -> dict[str, list]:
  """The plotted series: step, step seconds, accept length (None where SD did not run)."""
  steps = [r for r in history if r.get("step", 0) >= 1]
  return {"step": [r["step"] for r in steps],
          "step_s": [r.get("timing/step_s") for r in steps],
          "accept_len": [r.get("spec/accept_len") or None for r in steps]}


def write_plots(series: dict[str, dict[str, list]], out: str) -> list[str]:
  """OUT_step_time.png and OUT_accept_len.png, one line per config."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.ticker import MaxNLocator

  paths = []
  for key, name, ylabel in (("step_s", "step_time", "seconds per step"),
                            ("accept_len", "accept_len", "tokens per verify step")):
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for config, s in series.items():
      points = [(x, y) for x, y in zip(s["step"], s[key]) if y is not None]
      if points:
        ax.plot(*zip(*points), marker="o", label=config)
    ax.set(title=f"ablation: {ylabel}", xlabel="RL step", ylabel=ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize="small")
    fig.tight_layout()
    path = f"{out}_{name}.png"
    with atomic_file(path, "wb") as f:
      fig.savefig(f, format="png", dpi=90)
    plt.close(fig)
    paths.append(path)
  return paths


def sd_settings(frozen_flags: dict[str, Any]) -> dict[str, Any]:
  """The learned drafting configs' SD settings and the workload's temperature, from the
  tlt_frozen flagfile as it is now (the runs read are assumed made with it)."""
  return {k: frozen_flags[k] for k in ("sd_threshold", "temperature", "drafter", "strategy")}


def tail_sd_speedup(path: str, sd: dict[str, Any]) -> float | None:
  """benchmarks/rollout.py's paired SD speedup at the tail: per batch of <= the SD threshold
  rows at the workload's temperature, the best of the configs' strategies (the bandit's
  pick, once it has learned), the median over those batches; None without the file."""
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    result = json.load(f)
  if result.get("drafter") != sd["drafter"]:
    raise UserInputError(f"--sd_speedup_json={path}: measured with drafter "
                         f"{result.get('drafter')!r}, the ablation drafts with {sd['drafter']!r}")
  best: dict[int, float] = {}
  for s in result.get("fixed", []):
    if (s["batch"] <= sd["sd_threshold"] and s["temperature"] == sd["temperature"]
        and s["strategy"] in sd["strategy"].split(",")):
      best[s["batch"]] = max(best.get(s["batch"], 0.0), s["speedup_paired_median"])
  if not best:
    raise UserInputError(f"--sd_speedup_json={path}: no fixed batch of <= "
                         f"{sd['sd_threshold']} rows at temperature {sd['temperature']} with a "
                         f"strategy of {sd['strategy']}")
  return statistics.median(best.values())


def run_checks(histories: dict[str, Any], rows: Sequence[dict[str, Any]], tail_rows: int,
               sd_speedup: float | None) -> dict[str, Any]:
  """The issue's checks (experiments/ablation_checks.py) that the configs present allow;
  the speed check, when it cannot be judged, says why under `speed_skipped`."""
  h, checks = histories, {}
  if {"tlt", "tlt_frozen"} <= h.keys():
    checks["accept_gain"] = ablation_checks.accept_gain(h["tlt"], h["tlt_frozen"])
  if "tlt" in h:
    checks["idle_use"] = ablation_checks.idle_use(h["tlt"])
    if (paired := ablation_checks.heldout_gain(h["tlt"])) is not None:
      checks["heldout_gain"] = paired
  if "baseline" in h:
    checks["rollout_share"] = ablation_checks.rollout_share(h["baseline"])
  if {"baseline", "tlt"} <= h.keys():
    checks["losslessness"] = ablation_checks.losslessness(h["baseline"], h["tlt"])
  order = ablation_checks.accept_order({r["config"]: r.get("accept_len") for r in rows})
  if order is not None:
    checks["accept_order"] = order
  # The bound's SD speedup is the learned drafter's, so only the learned-only configs; they
  # are judged against the faster baseline (median step), with that baseline's tail share.
  learned = [c for c in ("tlt_frozen", "tlt") if c in h]
  step_s = {r["config"]: r.get("step_s") for r in rows}
  baselines = [c for c in BASELINES if step_s.get(c) is not None]
  if not baselines or not learned:
    return checks
  best = checks["best_baseline"] = min(baselines, key=step_s.get)
  checks["baseline_step_s"] = {c: step_s[c] for c in baselines}
  # SD speeds up the tail of the drafting configs' layout: two processes, as `baseline`.
  twin = "baseline" if "baseline" in baselines else best
  structure = 1.0
  if twin != best:
    checks["structure"] = ablation_checks.step_ratio(h[best], h[twin])
    structure = checks["structure"]["ratio_paired_median"]
  tail = checks["tail_share"] = ablation_checks.tail_share(h[twin], tail_rows)
  if sd_speedup is None:
    checks["speed_skipped"] = f"no {_SD_SPEEDUP_JSON.value} (benchmarks/rollout.py's JSON)"
  elif tail["share_median"] is None:
    checks["speed_skipped"] = f"no {twin} step where process 0 was the slowest replica"
  else:
    bounds = ablation_checks.step_bounds(h[best], h[twin], tail_rows, sd_speedup)
    checks["speed"] = {c: ablation_checks.speed(h[best], h[c], tail["share_median"],
                                                sd_speedup, structure, bounds) for c in learned}
  return checks


def _late_ratios(c: dict[str, Any]) -> str:
  """An adaptation check's per-step ratios and the median it is judged on."""
  return (f"{', '.join(f'{r:.2f}' for r in c['ratio_by_step'])}; median of the last "
          f"{ablation_checks.LAST_STEPS} {_num(c['ratio_late_median'], '.2f')} (goal >= "
          f"{c['goal']})")


def checks_markdown(checks: dict[str, Any]) -> str:
  """One line per check, with its figures and whether its goal holds."""
  verdict = lambda c: "holds" if c["holds"] else "DOES NOT HOLD"
  lines = []
  if "accept_gain" in checks:
    c = checks["accept_gain"]
    # Under sampling the two runs emit other tokens: with the same-token figure at hand,
    # this one is context, not the verdict.
    judged = ("reported, not judged: the runs sampled other tokens; the same tokens below"
              if "heldout_gain" in checks else verdict(c))
    lines.append(f"- accept length, tlt over tlt_frozen (process 0) on steps {c['steps']}: "
                 f"{_late_ratios(c)}: {judged}")
  if "heldout_gain" in checks:
    c = checks["heldout_gain"]
    lines.append(f"- the same on the same tokens: tlt's deployed drafter over the shipped one, "
                 f"the deploy gate's held-out accept-length estimate, on steps {c['steps']}: "
                 f"{_late_ratios(c)}: {verdict(c)}")
  if "idle_use" in checks:
    c = checks["idle_use"]
    lines.append(f"- idle seconds used by drafter training and gate scoring: {c['used_s']:.0f} / "
                 f"{c['available_s']:.0f} = {_num(c['used_frac'], '.2f')} (goal >= 0.8; "
                 f"all replicas, steps {c['steps']}); stop latency p99 "
                 f"{_num(c['preempt_latency_p99_s'], '.2f')} s against a drafter step's "
                 f"{_num(c['drafter_step_s_p99'], '.2f')} s (median "
                 f"{_num(c['drafter_step_s_median'], '.2f')} s, {c['drafter_steps']} steps): "
                 f"{verdict(c)}")
  if "losslessness" in checks:
    c = checks["losslessness"]
    means = " / ".join(f"{m:.3f}" for m in c["reward_mean"] or [])
    lines.append(f"- baseline vs tlt over steps {c['steps']}: rewards per step (means {means}) "
                 f"Mann-Whitney U p = {_num(c['reward_mannwhitney_p'], '.2f')} (paired "
                 f"Wilcoxon p = {_num(c['reward_wilcoxon_p'], '.2f')}); validation at step "
                 f"{c['val_step']}: {c['val_correct']} of {c['val_prompts']} correct, Fisher "
                 f"p = {_num(c['val_fisher_p'], '.2f')}; step 0 (greedy) {c['val_step0']}: "
                 f"{verdict(c)}")
  if "rollout_share" in checks:
    c = checks["rollout_share"]
    lines.append(f"- rollout share of a baseline step (the slowest replica's; median of "
                 f"{c['steps']} steps): {_num(c['share_median'], '.2f')} (goal >= "
                 f"{c['goal']}); the update's computed slots "
                 f"{_num(c['fill_median'], '.2f')} filled, with none padded "
                 f"{_num(c['share_unpadded_median'], '.2f')}: {verdict(c)}")
  if "accept_order" in checks:
    c = checks["accept_order"]
    lines.append(f"- accept length order {' >= '.join(c['configs'])}: "
                 f"{' / '.join(f'{v:.2f}' for v in c['accept_len'])}: {verdict(c)}")
  lines += _speed_lines(checks, verdict)
  return "\n".join(["## Checks", "", *lines, ""]) if lines else ""


def _speed_lines(checks: dict[str, Any], verdict) -> list[str]:
  """checks_markdown's lines for the speed check and the figures its bound is made of."""
  lines = []
  if "tail_share" in checks:
    c = checks["tail_share"]
    others = [f"{b} {_num(step_s, '.1f')} s" for b, step_s in checks["baseline_step_s"].items()]
    lines.append(f"- the faster baseline by median step: {checks['best_baseline']} "
                 f"({', '.join(others)}); the tail share f of the two-process steps (<= the "
                 f"SD threshold's live rows): {_num(c['share_median'], '.2f')} "
                 f"({c['steps_used']} steps)")
  if "structure" in checks:
    c = checks["structure"]
    lines.append(f"- two processes against one, without SD (baseline's step over "
                 f"{checks['best_baseline']}'s), median of per-step ratios: r = "
                 f"{_num(c['ratio_paired_median'], '.2f')} (ratio of the medians "
                 f"{_num(c['ratio_of_medians'], '.2f')})")
  if "speed_skipped" in checks:
    lines.append(f"- speed: not judged ({checks['speed_skipped']})")
  for config, c in checks.get("speed", {}).items():
    lines.append(f"- step time of {config} over {checks['best_baseline']}'s, median of "
                 f"per-step ratios: "
                 f"{_num(c['ratio_paired_median'], '.2f')} (ratio of the medians "
                 f"{_num(c['ratio_of_medians'], '.2f')}) against the bound "
                 f"{c['bound_ratio']:.2f} = r x (1 - f + f / s), r {c['structure_ratio']:.2f}, "
                 f"SD speedup at the tail's batch s {c['sd_speedup_at_tail']:.2f}; paired "
                 f"by step (each step's own r and f, steps {c['bounded_steps']}): "
                 f"{_num(c['over_step_bound_median'], '.2f')} of its bound, median: "
                 f"{verdict(c)} (within 10%)")
  return lines


def write_table(configs: Sequence[str], steps: int, out: str, sd: dict[str, Any],
                sd_speedup: float | None) -> dict[str, Any]:
  """Reads every config's kept history; writes OUT.json, OUT.md and the plots; returns the
  JSON."""
  from benchmarks.report import provenance

  histories = {c: read_history(kept_path(out, c)) for c in configs}
  rows = [{"config": c, **summarize(h, sd["sd_threshold"])} for c, h in histories.items()]
  series = {c: per_step(h) for c, h in histories.items()}
  checks = run_checks(histories, rows, sd["sd_threshold"], sd_speedup)
  result = {**provenance(), "command": " ".join(["python -m experiments.ablate", *sys.argv[1:]]),
            "steps_requested": steps, "histories": f"{out}_runs",
            "flagfiles": {c: flagfile(c) for c in configs}, "rows": rows, "per_step": series,
            "sd": {**sd, "speedup_at_tail": sd_speedup,
                   "speedup_source": _SD_SPEEDUP_JSON.value}, "checks": checks}
  with atomic_file(f"{out}.json") as f:
    json.dump(result, f, indent=1)
  with atomic_file(f"{out}.md") as f:
    f.write(markdown_table(rows) + "\n" + checks_markdown(checks))
  write_plots(series, out)
  return result


def main(argv):
  del argv
  configs, steps, run_root = _CONFIGS.value, _STEPS.value, _RUN_ROOT.value
  inputs = check_inputs(configs, steps, run_root, _OUT.value, _READ_ONLY.value, _SET.value)
  sd, flags_set = inputs["sd"], inputs["flags"]
  cli.check_output_file(f"{_OUT.value}.json", "--out")
  sd_speedup = tail_sd_speedup(_SD_SPEEDUP_JSON.value, sd)
  for config in configs:     # run dirs newer than their kept histories
    keep(config, run_root, _OUT.value, flags_set[config])
  if not _READ_ONLY.value:
    run_configs(configs, steps, run_root, _OUT.value, flags_set, _SET.value)
  result = write_table(configs, steps, _OUT.value, sd, sd_speedup)
  print(f"{markdown_table(result['rows'])}\n{checks_markdown(result['checks'])}\n"
        f"written: {_OUT.value}.json, {_OUT.value}.md, "
        f"{_OUT.value}_step_time.png, {_OUT.value}_accept_len.png", file=sys.stderr)


if __name__ == "__main__":
  cli.run(main)

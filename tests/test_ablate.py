"""`python -m experiments.ablate`: the ablation flagfiles parse with experiments.run's flags
and differ only where the ablation means them to; the table and plots from synthetic run
dirs (small metrics.jsonl files, nothing trained) and from the histories kept beside it;
bad input is one line before any run. The real ablation runs are never started here."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from experiments import ablate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_ablate(*args):
  return subprocess.run([sys.executable, "-m", "experiments.ablate", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def parsed():
  return ablate.parse_flagfiles([ablate.flagfile(c) for c in ablate.CONFIGS])


def test_every_config_parses_and_differs_only_as_the_ablation_means(parsed):
  errors = {path: p["error"] for path, p in parsed.items() if "error" in p}
  assert not errors, errors
  sets = {c: parsed[ablate.flagfile(c)]["flags"] for c in ablate.CONFIGS}
  base = sets["baseline"]
  assert base["replicas"] == 2 and base["max_new_tokens"] >= 512 and "drafter" not in base
  assert sets["baseline_one_process"] == {**base, "replicas": 1}
  for config, values in sets.items():   # one shared workload
    assert {k: values[k] for k in base if k != "replicas"} == {
        k: v for k, v in base.items() if k != "replicas"}, config
  drafters = {c: (v.get("drafter"), v.get("drafter_train", "off"), v.get("hybrid", False))
              for c, v in sets.items()}
  shipped = "assets/drafter_smollm2"
  assert drafters == {"baseline": (None, "off", False),
                      "baseline_one_process": (None, "off", False),
                      "tlt_base": ("ngram", "off", False),
                      "tlt_frozen": (shipped, "off", False), "tlt": (shipped, "always", False),
                      "tlt_hybrid": (shipped, "always", True)}
  assert os.path.isfile(os.path.join(REPO, shipped, "drafter.safetensors"))
  # Every drafting config decodes the tail with the same SD settings and strategy pool.
  sd_keys = ("strategy", "sd_threshold", "sd_patience")
  drafting = [c for c in ablate.CONFIGS if c not in ablate.BASELINES]
  assert len({tuple(str(sets[c][k]) for k in sd_keys) for c in drafting}) == 1
  assert all(sets[c]["replicas"] == 2 for c in drafting)


def test_the_accelerator_workload_applies_to_every_config_and_fits_two_80_gib_gpus():
  scale = "--flagfile=experiments/configs/ablation/accelerator.flags"
  scaled = ablate.parse_flagfiles([ablate.flagfile(c) for c in ablate.CONFIGS], [scale])
  for config in ablate.CONFIGS:
    values = scaled[ablate.flagfile(config)]
    assert "error" not in values, values
    assert values["flags"]["max_new_tokens"] == 2048, config
    assert values["flags"]["prompts_per_step"] * values["flags"]["group_size"] == 512, config
  plan = subprocess.run([sys.executable, "-m", "experiments.plan",
                         f"--flagfile={ablate.flagfile('tlt')}", scale], cwd=REPO,
                        capture_output=True, text=True, timeout=300)
  assert plan.returncode == 0 and plan.stdout.rstrip().endswith("fits"), plan.stderr[-2000:]
  assert "2 rollout replicas" in plan.stdout and "256 rows" in plan.stdout


def test_an_unknown_flag_in_a_flagfile_is_named(tmp_path):
  path = tmp_path / "typo.flags"
  path.write_text("--flagfile=experiments/configs/ablation/base.flags\n--drafter_trian=always\n")
  (result,) = ablate.parse_flagfiles([str(path)]).values()
  assert "drafter_trian" in result["error"], result


def write_run(run_dir, records):
  os.makedirs(run_dir)
  with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)


def step(n, step_s, rollout, accept=None, idle=(0.0, 0.0), train_steps=0, **extra):
  record = {"step": n, "timing/step_s": step_s, "timing/rollout_s": rollout[0],
            "rollout/replica_s": list(rollout),
            "reward/mean": 0.1 * n, "response_len/p50": 40.0 + n, "response_len/p90": 300.0,
            "response_len/max": 500 + n, "drafter/idle_device_s_used": idle[0],
            "drafter/idle_device_s_available": idle[1], "drafter/train_steps": train_steps}
  if accept is not None:
    record["spec/accept_len"] = accept
  return {**record, **extra}


@pytest.fixture
def synthetic_runs(tmp_path):
  root = tmp_path / "runs"
  trace = {"rollout/live_rows_trace": [[5.0, 4], [15.0, 2], [45.0, 0]]}   # a tail of 30 s
  write_run(root / "baseline", [{"step": 0, "val/accuracy": 0.25, "val/prompts": 4},
                                step(1, 100.0, (60.0, 70.0)), step(2, 50.0, (30.0, 40.0)),
                                step(3, 60.0, (45.0, 30.0), **trace,
                                     **{"val/accuracy": 0.5, "val/prompts": 4})])
  write_run(root / "tlt", [{"step": 0, "val/accuracy": 0.25, "val/prompts": 4},
                           step(1, 90.0, (50.0, 60.0), accept=2.0, idle=(5.0, 10.0),
                                train_steps=3),
                           step(2, 40.0, (20.0, 32.0), accept=0.0),    # SD never switched on
                           step(3, 44.0, (35.0, 11.0), accept=3.0, idle=(8.0, 10.0),
                                train_steps=4,   # 4 s with <= 2 live rows (the SD threshold)
                                **{"rollout/live_rows_trace": [[2.0, 4], [10.0, 1], [14.0, 0]]})])
  return root


def test_table_from_synthetic_run_dirs(synthetic_runs, tmp_path):
  out = str(tmp_path / "results" / "ablation")
  os.makedirs(os.path.dirname(out))
  speedup = tmp_path / "rollout.json"    # benchmarks/rollout.py's shape: the best of batch 1
  fixed = lambda batch, t, strategy, x: {"batch": batch, "temperature": t, "strategy": strategy,
                                         "speedup_paired_median": x}
  speedup.write_text(json.dumps({"drafter": "assets/drafter_smollm2", "fixed": [
      fixed(1, 1.0, "3_1_4", 0.5), fixed(1, 1.0, "4_1_5", 0.7), fixed(2, 1.0, "6_1_7", 0.9),
      fixed(1, 1.0, "8_8_32", 3.0),                  # not in the configs' pool
      fixed(2, 0.0, "4_1_5", 3.0), fixed(4, 1.0, "4_1_5", 3.0)]}))   # other T, batch
  proc = run_ablate("--configs=baseline,tlt", "--steps=3", f"--run_root={synthetic_runs}",
                    "--read_only", f"--out={out}", f"--sd_speedup_json={speedup}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.load(open(out + ".json"))
  rows = {r["config"]: r for r in result["rows"]}
  # Times: medians over steps 2 and 3; rollout is the slowest replica's.
  assert rows["baseline"]["step_s"] == 55.0 and rows["baseline"]["rollout_s"] == 42.5
  assert rows["baseline"]["rollout_frac"] == pytest.approx((40 / 50 + 45 / 60) / 2)
  assert rows["baseline"]["accept_len"] is None and rows["baseline"]["idle_used_frac"] is None
  assert rows["baseline"]["val_accuracy_last"] == 0.5 and rows["baseline"]["val_step_last"] == 3
  assert rows["baseline"]["response_len_max"] == 503
  tlt = rows["tlt"]
  assert tlt["steps_done"] == 3 and tlt["step_s"] == 42.0 and tlt["rollout_s"] == 33.5
  assert tlt["tail_s"] == 4.0
  assert tlt["accept_len"] == 2.5 and tlt["accept_len_last"] == 3.0   # steps with SD only
  assert tlt["drafter_train_steps"] == 7 and tlt["idle_used_frac"] == pytest.approx(13 / 20)
  assert tlt["reward_last"] == pytest.approx(0.3) and tlt["val_accuracy_last"] == 0.25
  assert result["per_step"]["tlt"]["accept_len"] == [2.0, None, 3.0]
  assert result["command"].startswith("python -m experiments.ablate --configs=baseline,tlt")
  table = open(out + ".md").read()
  assert "| tlt | 3 | 42.0 | 33.5 (0.80) | 4.0 | 2.50 (3.00) | 7 | 13 / 20 |" in table, table
  for name in ("step_time", "accept_len"):
    assert os.path.getsize(f"{out}_{name}.png") > 1000
  # The checks the two configs allow (each check's own tests: tests/test_ablation_checks.py).
  checks = result["checks"]
  assert set(checks) == {"idle_use", "losslessness", "best_baseline", "baseline_step_s",
                         "tail_share", "speed", "rollout_share"}
  assert checks["best_baseline"] == "baseline" and checks["baseline_step_s"] == {
      "baseline": 55.0}
  assert result["sd"] == {"sd_threshold": 2, "temperature": 1.0, "speedup_at_tail": 0.8,
                          "drafter": "assets/drafter_smollm2",
                          "strategy": "3_1_4,4_1_5,6_1_7", "speedup_source": str(speedup)}
  assert checks["tail_share"] == {"steps_used": 1, "share_median": pytest.approx(0.5)}
  assert checks["speed"]["tlt"]["bound_ratio"] == pytest.approx(0.5 + 0.5 / 0.8)
  assert checks["losslessness"]["val_step0"] == [0.25, 0.25]
  assert ("- step time of tlt over baseline's, median of per-step ratios: 0.77 (ratio of the "
          "medians 0.76)") in table


def test_finished_runs_are_not_run_again(synthetic_runs, tmp_path):
  out = str(tmp_path / "ablation")
  proc = run_ablate("--configs=tlt", "--steps=3", f"--run_root={synthetic_runs}",
                    f"--out={out}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"ablate [1/1] tlt: already at step 3 of 3 ({out}_runs/tlt.jsonl)" in proc.stderr
  assert ablate.run_command("tlt", "/r/tlt", 12, ["--temperature=0"])[1:] == [
      "-m", "experiments.run", "--flagfile=experiments/configs/ablation/tlt.flags",
      "--temperature=0", "--run_dir=/r/tlt", "--steps=12", "--resume=auto"]
  # A variant (--set) keeps its flags with its history, and is judged by them.
  proc = run_ablate("--configs=tlt", "--steps=3", f"--run_root={synthetic_runs}",
                    f"--out={out}_t0", "--set=--temperature=0", "--read_only",
                    f"--sd_speedup_json={tmp_path / 'none.json'}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert json.load(open(f"{out}_t0_runs/tlt.flags.json"))["temperature"] == 0.0


@pytest.mark.parametrize("args, message", [
    (("--configs=baseline,tlt_fast",), "--configs: unknown config 'tlt_fast' (known: "
     "baseline, baseline_one_process, tlt_base, tlt_frozen, tlt, tlt_hybrid)"),
    (("--configs=tlt,tlt",), "--configs: a config is named twice"),
    (("--steps=0",), "--steps=0: must be >= 1"),
    (("--configs=tlt", "--set=--temperature=zero"), "experiments/configs/ablation/tlt.flags "
     "with --set: flag --temperature=zero: could not convert string to float: 'zero'"),
    (("--configs=baseline,tlt_hybrid", "--read_only"), "--read_only: no run of 'tlt_hybrid': "
     "neither {out}_runs/tlt_hybrid.jsonl nor {root}/tlt_hybrid/metrics.jsonl exists"),
])
def test_bad_input_is_one_line_before_any_run(synthetic_runs, tmp_path, args, message):
  out = str(tmp_path / "ablation")
  proc = run_ablate(*args, f"--run_root={synthetic_runs}", f"--out={out}")
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines() == [
      "error: " + message.format(root=synthetic_runs, out=out)], proc.stderr
  assert not os.path.exists(out + ".json")


def test_the_speed_check_says_why_it_is_not_judged(synthetic_runs, tmp_path):
  out = str(tmp_path / "ablation")
  missing = tmp_path / "none.json"
  proc = run_ablate("--configs=baseline,tlt", "--steps=3", f"--run_root={synthetic_runs}",
                    "--read_only", f"--out={out}", f"--sd_speedup_json={missing}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert (f"- speed: not judged (no {missing} (benchmarks/rollout.py's JSON))"
          in open(out + ".md").read())
  other = tmp_path / "ngram.json"     # measured with another drafter: refused before anything
  other.write_text(json.dumps({"drafter": "ngram", "fixed": []}))
  proc = run_ablate("--configs=baseline,tlt", "--steps=3", f"--run_root={synthetic_runs}",
                    "--read_only", f"--out={out}2", f"--sd_speedup_json={other}")
  assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
      f"error: --sd_speedup_json={other}: measured with drafter 'ngram', the ablation drafts "
      "with 'assets/drafter_smollm2'"], proc.stderr
  assert not os.path.exists(out + "2.json")


def test_the_table_is_rebuilt_from_kept_histories_alone(synthetic_runs, tmp_path, parsed):
  """Run dirs stay on the machine that made them; the kept histories make the same table."""
  out = str(tmp_path / "ablation")
  args = ("--configs=baseline,tlt", "--steps=3", "--read_only", f"--out={out}")
  assert run_ablate(*args, f"--run_root={synthetic_runs}").returncode == 0
  first = json.load(open(out + ".json"))
  assert sorted(os.listdir(out + "_runs")) == ["baseline.flags.json", "baseline.jsonl",
                                               "tlt.flags.json", "tlt.jsonl"]
  kept_flags = json.load(open(out + "_runs/tlt.flags.json"))
  assert kept_flags["drafter_train"] == "always" and kept_flags["replicas"] == 2
  proc = run_ablate(*args, f"--run_root={tmp_path / 'elsewhere'}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  again = json.load(open(out + ".json"))
  assert again["rows"] == first["rows"] and again["checks"] == first["checks"]
  # A kept history made with other flags than its flagfile sets now is refused.
  kept_flags["lr"] = 1.0
  with open(out + "_runs/tlt.flags.json", "w") as f:
    json.dump(kept_flags, f)
  proc = run_ablate(*args, f"--run_root={synthetic_runs}")
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines() == [
      f"error: {out}_runs/tlt.jsonl: run with --lr=1.0, experiments/configs/ablation/tlt.flags "
      f"now sets {parsed[ablate.flagfile('tlt')]['flags']['lr']}; delete it and {out}_runs/tlt.flags.json to run 'tlt' again"]


def test_speed_is_judged_against_the_faster_baseline(synthetic_runs, tmp_path):
  one = {"rollout/live_rows_trace": [[1.0, 8], [9.0, 2], [11.0, 0]]}    # a tail of 2 s
  write_run(synthetic_runs / "baseline_one_process",
            [{"step": 0, "val/accuracy": 0.25, "val/prompts": 4},
             step(1, 80.0, (50.0,)), step(2, 40.0, (30.0,), **one), step(3, 40.0, (20.0,), **one)])
  out = str(tmp_path / "ablation")
  speedup = tmp_path / "rollout.json"
  speedup.write_text(json.dumps({"drafter": "assets/drafter_smollm2", "fixed": [
      {"batch": 1, "temperature": 1.0, "strategy": "3_1_4", "speedup_paired_median": 0.8}]}))
  proc = run_ablate("--configs=baseline,baseline_one_process,tlt", "--steps=3", "--read_only",
                    f"--run_root={synthetic_runs}", f"--out={out}",
                    f"--sd_speedup_json={speedup}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  checks = json.load(open(out + ".json"))["checks"]
  assert checks["best_baseline"] == "baseline_one_process"
  assert checks["baseline_step_s"] == {"baseline": 55.0, "baseline_one_process": 40.0}
  # The tail SD speeds up is the two-process one (baseline's); two processes cost 1.375x
  # one (steps 2 and 3: 50 / 40 and 60 / 40, median), which the bound carries.
  assert checks["tail_share"] == {"steps_used": 1, "share_median": pytest.approx(0.5)}
  assert checks["structure"]["ratio_paired_median"] == pytest.approx(1.375)
  assert checks["speed"]["tlt"]["bound_ratio"] == pytest.approx(1.375 * (0.5 + 0.5 / 0.8))
  table = open(out + ".md").read()
  assert ("- the faster baseline by median step: baseline_one_process (baseline 55.0 s, "
          "baseline_one_process 40.0 s)") in table
  assert "- two processes against one, without SD (baseline's step over " in table


def test_adaptation_is_judged_on_the_same_tokens_when_the_run_has_them(tmp_path):
  scored = {"drafter/heldout_accept_deployed": 1.0, "drafter/heldout_accept_shipped": 1.0}
  root = tmp_path / "runs"
  write_run(root / "tlt_frozen", [step(n, 10.0, (5.0, 4.0), accept=2.0) for n in (1, 2, 3)])
  write_run(root / "tlt", [step(n, 10.0, (5.0, 4.0), accept=3.0, **scored) for n in (1, 2, 3)])
  out = str(tmp_path / "ablation")
  proc = run_ablate("--configs=tlt_frozen,tlt", "--steps=3", "--read_only", f"--run_root={root}",
                    f"--out={out}", f"--sd_speedup_json={tmp_path / 'none.json'}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  table = open(out + ".md").read()
  # Other tokens in each run: 1.5x is context; on the same windows the drafters tie.
  assert ("median of the last 3 1.50 (goal >= 1.2): reported, not judged: the runs sampled "
          "other tokens; the same tokens below") in table, table
  assert "median of the last 3 1.00 (goal >= 1.2): DOES NOT HOLD" in table

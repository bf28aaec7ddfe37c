"""`python -m experiments.run` end to end on a tiny model: the run dir's contents, the HF
export (loaded by transformers, greedy tokens equal to our generate CLI), and resume after
SIGKILL (mid-step and mid-save) reaching bitwise the uninterrupted run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = "basic_arithmetic:min_terms=2,max_terms=2,min_digits=1,max_digits=1"
# Fields that measure the machine (time, memory, compile counts), not the training.
_MACHINE_PREFIXES = ("timing/", "perf/tokens_per_s", "mem/", "compile/",
                     "rollout/live_rows_trace", "rollout/tail_s", "rollout/tokens_per_s")


def run_cli(run_dir, model_dir, *extra, env_extra=None, check=True, tasks=TASKS, cache=""):
  """`experiments.run` on the test task; cache: a compilation cache dir (the
  `compile_cache` fixture) for runs that repeat a setting, "" for none."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache, **(env_extra or {}))
  cmd = [sys.executable, "-m", "experiments.run", f"--model={model_dir}",
         *([f"--tasks={tasks}"] if tasks else []), "--num_train=32", "--num_val=4", "--max_prompt_len=96", "--max_new_tokens=12",
         "--prompts_per_step=2", "--group_size=4", "--micro_batch_rows=2", "--lr=1e-3",
         "--kl_coef=0.04", "--eval_every=2", "--reward_workers=1", f"--run_dir={run_dir}",
         *extra]
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  if check:
    assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def training_fields(path):
  records = [json.loads(line) for line in open(path)]
  return [{k: v for k, v in r.items() if not k.startswith(_MACHINE_PREFIXES)} for r in records]


@pytest.fixture(scope="module")
def finished_run(tiny_hf_dirs, tmp_path_factory, compile_cache):
  run_dir = str(tmp_path_factory.mktemp("rl") / "run")
  proc = run_cli(run_dir, tiny_hf_dirs["qwen2"], "--steps=4", "--checkpoint_every=2",
                 "--precompile", cache=compile_cache)
  return run_dir, proc


def test_run_dir_holds_every_artifact(finished_run):
  run_dir, proc = finished_run
  for name in ("metrics.jsonl", "long_tail.png", "reward.png", "response_len.png",
               "step_time.png", "accept_len.png", "hf_export/config.json",
               "hf_export/model.safetensors", "hf_export/tokenizer.json"):
    assert os.path.isfile(os.path.join(run_dir, name)), name
  assert os.listdir(os.path.join(run_dir, "tensorboard"))
  assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["2", "4"]
  records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
  for key in ("reward/mean", "reward/accuracy", "response_len/mean", "response_len/max",
              "response_len/clip_frac", "actor/pg_loss", "actor/kl", "actor/entropy",
              "actor/clip_frac", "actor/grad_norm", "actor/lr", "timing/rollout_s",
              "timing/reward_s", "timing/train_s", "timing/sync_s", "timing/step_s",
              "perf/tokens_per_s", "mem/peak_rss_gib", "rollout/logprob_diff_max",
              "rollout/logprob_diff_mean"):
    assert key in records[1], key
  assert "val/accuracy" in records[0] and "val/accuracy" in records[2]
  # --precompile built every rollout and update program before step 1, whatever a step's
  # prompts and response lengths.
  assert [r["compile/rollout_new_programs"] for r in records[1:]] == [0] * 4
  assert [r["compile/new_programs"] for r in records[1:]] == [0] * 4
  assert "precompiled" in proc.stderr
  # One update per step: the ratio's old side is the rollout's log-probs, which the
  # trainer reproduces up to rounding.
  assert records[1]["rollout/logprob_diff_max"] < 1e-3
  assert "reward/mean" in proc.stderr and "step 4/4" in proc.stderr


def test_hf_export_generates_like_our_cli(finished_run, tmp_path):
  import torch
  import transformers

  run_dir, _ = finished_run
  export = os.path.join(run_dir, "hf_export")
  prompts = [[5, 17, 33, 40, 9], [70, 12, 3]]
  prompts_json = tmp_path / "prompts.json"
  prompts_json.write_text(json.dumps(prompts))
  out_json = tmp_path / "out.json"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  subprocess.run([sys.executable, "-m", "experiments.generate", f"--model={export}",
                  f"--prompts_json={prompts_json}", "--max_new_tokens=8", "--temperature=0",
                  f"--output_json={out_json}"], cwd=REPO, env=dict(env, JAX_PLATFORMS="cpu"),
                 check=True, capture_output=True, timeout=300)
  ours = [o["token_ids"] for o in json.loads(out_json.read_text())["outputs"]]
  model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
  for prompt, tokens in zip(prompts, ours):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=len(tokens), do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    assert out[0, len(prompt):].tolist() == tokens


@pytest.mark.parametrize("fault", ["step:3", "save:2"])
def test_resume_after_sigkill_is_bitwise(finished_run, tiny_hf_dirs, tmp_path, fault,
                                        compile_cache):
  reference_dir, _ = finished_run
  run_dir = str(tmp_path / "run")
  killed = run_cli(run_dir, tiny_hf_dirs["qwen2"], "--steps=4", "--checkpoint_every=2",
                   env_extra={"TLT_JAX_KILL_AT": fault}, check=False, cache=compile_cache)
  assert killed.returncode == -signal.SIGKILL
  finished = sorted(int(d) for d in os.listdir(os.path.join(run_dir, "checkpoints"))
                    if d.isdigit())
  # Killed mid-save: step 2 never became a checkpoint; mid-step 3: step 2 did.
  assert finished == ([] if fault == "save:2" else [2])
  run_cli(run_dir, tiny_hf_dirs["qwen2"], "--steps=4", "--checkpoint_every=2", "--resume=auto",
          cache=compile_cache)
  assert (training_fields(os.path.join(run_dir, "metrics.jsonl"))
          == training_fields(os.path.join(reference_dir, "metrics.jsonl")))
  from safetensors.numpy import load_file
  ours = load_file(os.path.join(run_dir, "hf_export", "model.safetensors"))
  reference = load_file(os.path.join(reference_dir, "hf_export", "model.safetensors"))
  assert ours.keys() == reference.keys()
  for name in ours:
    np.testing.assert_array_equal(ours[name], reference[name], err_msg=name)


@pytest.mark.parametrize("name", ["quickstart", "smollm2_cpu", "qwen2_5_1_5b_gpu",
                                  "qwen2_5_7b_gpu", "r1_distill_qwen_7b_gpu"])
def test_flagfiles_are_valid(name, tmp_path):
  """Every flag of every shipped flagfile parses and validates; then the run stops at a
  missing input named in one line: GPU flagfiles' placeholder checkpoint path, or a model
  path given here to CPU ones."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  extra = [] if name.endswith("_gpu") else ["--model=/nonexistent/model"]
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.run",
       f"--flagfile=experiments/configs/{name}.flags", f"--run_dir={tmp_path / 'run'}",
       *extra], cwd=REPO, env=dict(env, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
      timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  last = proc.stderr.strip().splitlines()[-1]
  missing = "--model=checkpoints/" if name.endswith("_gpu") else "/nonexistent"
  assert last.startswith("error: ") and missing in last and "Traceback" not in proc.stderr, last


@pytest.mark.parametrize("argv, expected", [
    (["run", "--flagfile=experiments/configs/quickstart.flags"], "runs/quickstart"),
    (["run", "--flagfile", "a/b/smollm2_cpu.flags", "--steps=2"], "runs/smollm2_cpu"),
    (["run", "-flagfile=x.flags", "--flagfile=y/late.flags"], "runs/late"),
    (["run", "--steps=2"], "runs/default"),
])
def test_run_dir_defaults_to_the_flagfile_name(argv, expected):
  from experiments.run import default_run_dir
  assert default_run_dir(argv) == expected

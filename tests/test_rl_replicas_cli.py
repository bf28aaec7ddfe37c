"""`python -m experiments.run --replicas=2`: two processes, one rollout replica each, on a
tiny model. At temperature 0 their steps equal a one-process run's (same rollouts, rewards
and losses, so the same trained policy); only process 0 writes the run dir; a run resumes
from its checkpoint, and trains from a converted (orbax) checkpoint; with --tp=2 inside
each of two-device replicas it still equals one process; a replica killed mid-run ends the
run with one line from the survivor, soon; and a faked Slurm job (two local processes found
by JAX's environment detection) initializes and runs a step."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.test_rl_run_cli import REPO, TASKS, run_cli, training_fields
from tlt_jax.runtime.processes import EXIT_REPLICA_FAILED, free_local_port

# Greedy, no KL, validation at step 2: the fewest programs that still cover every stage.
FLAGS = ("--temperature=0", "--kl_coef=0", "--checkpoint_every=1")
# Each replica's own: its seconds, and the row budget's figures of its batch (half the rows).
REPLICA_ONLY = ("rollout/replica_s", "rollout/replica_idle_s", "rollout/max_rows",
                "rollout/peak_rows", "rollout/admission_waves", "rollout/kv_cache_bytes")


def records(run_dir):
  return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


@pytest.fixture(scope="module")
def runs(tiny_hf_dirs, tmp_path_factory, compile_cache):
  root = tmp_path_factory.mktemp("replicas")
  one, two = str(root / "one"), str(root / "two")
  run_cli(one, tiny_hf_dirs["qwen2"], "--steps=2", *FLAGS, cache=compile_cache)
  start = time.perf_counter()
  proc = run_cli(two, tiny_hf_dirs["qwen2"], "--steps=2", "--replicas=2", *FLAGS,
                 cache=compile_cache)
  return one, two, proc, time.perf_counter() - start


def test_two_replicas_equal_one_process_at_temperature_0(runs):
  one, two, proc, _ = runs
  ours, reference = training_fields(os.path.join(two, "metrics.jsonl")), training_fields(
      os.path.join(one, "metrics.jsonl"))
  assert [r["step"] for r in ours] == [0, 1, 2]
  for got, want in zip(ours, reference):
    got, want = ({k: v for k, v in r.items() if k not in REPLICA_ONLY} for r in (got, want))
    assert got.keys() == want.keys()
    for key, value in want.items():
      if isinstance(value, float):   # the update's all-reduce sums in another order
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
      else:
        assert got[key] == value, key
  # Each replica sampled half of every step's groups.
  assert all(len(r["rollout/replica_s"]) == 2 for r in records(two)[1:])
  from safetensors.numpy import load_file
  a = load_file(os.path.join(two, "hf_export", "model.safetensors"))
  b = load_file(os.path.join(one, "hf_export", "model.safetensors"))
  for name in b:
    np.testing.assert_allclose(a[name], b[name], rtol=0, atol=1e-5, err_msg=name)
  assert "on 2 replicas" in proc.stderr
  # Process 0 alone writes: one progress line per step, one summary.
  assert proc.stderr.count("step 2/2") == 1 and proc.stderr.count("HF export:") == 1


def test_tensor_parallel_inside_each_replica_equals_one_process(tiny_hf_dirs, tmp_path,
                                                                compile_cache):
  """Two replicas of two devices each with --tp=2 inside each (an 8-GPU host's layout in
  miniature): each process takes its own copy of the tp-split policy for its rollout, and
  the run equals one process's on two devices. The entropy bonus moves the policy even
  where every reward is equal."""
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  flags = ("--steps=2", "--micro_batch_rows=4", "--entropy_coef=0.05", "--lr=1e-2",
           "--eval_every=0", *FLAGS)
  one, two = str(tmp_path / "one"), str(tmp_path / "two")
  run_cli(one, tiny_hf_dirs["qwen2"], "--tp=2", "--fsdp=1", *flags, env_extra=env,
          cache=compile_cache)
  run_cli(two, tiny_hf_dirs["qwen2"], "--tp=2", "--replicas=2", *flags, env_extra=env,
          cache=compile_cache)
  for got, want in zip(records(two)[1:], records(one)[1:]):
    assert got["rollout/generated_tokens"] == want["rollout/generated_tokens"]
    assert want["actor/grad_norm"] > 0
    for key in ("actor/loss", "actor/grad_norm", "actor/entropy"):
      assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
  from safetensors.numpy import load_file
  a = load_file(os.path.join(two, "hf_export", "model.safetensors"))
  b = load_file(os.path.join(one, "hf_export", "model.safetensors"))
  for name in b:
    np.testing.assert_allclose(a[name], b[name], rtol=0, atol=1e-5, err_msg=name)


def test_resume_with_replicas(runs, tiny_hf_dirs, tmp_path, compile_cache):
  _, two, _, _ = runs
  run_dir = str(tmp_path / "run")
  shutil.copytree(two, run_dir)
  proc = run_cli(run_dir, tiny_hf_dirs["qwen2"], "--steps=3", "--replicas=2", "--resume=auto",
                 *FLAGS, cache=compile_cache)
  assert "resumed" in proc.stderr
  assert [r["step"] for r in records(run_dir)] == [0, 1, 2, 3]
  assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["2", "3"]


def test_replicas_train_from_a_converted_checkpoint(tiny_hf_dirs, tmp_path, compile_cache):
  """Every process restores the orbax checkpoint onto its own device (not process 0's)."""
  converted = str(tmp_path / "converted")
  subprocess.run([sys.executable, "-m", "experiments.convert_hf",
                  f"--hf_dir={tiny_hf_dirs['qwen2']}", f"--out={converted}"], cwd=REPO,
                 check=True, capture_output=True, timeout=300)
  run_dir = str(tmp_path / "run")
  run_cli(run_dir, converted, "--steps=1", "--replicas=2", "--eval_every=0", *FLAGS,
          cache=compile_cache)
  assert [r["step"] for r in records(run_dir)] == [1]


def test_a_dead_replica_ends_the_run_in_one_line(tiny_hf_dirs, tmp_path, compile_cache):
  start = time.perf_counter()
  proc = run_cli(str(tmp_path / "run"), tiny_hf_dirs["qwen2"], "--steps=3", "--replicas=2",
                 "--eval_every=0", *FLAGS, env_extra={"TLT_JAX_KILL_AT": "step:2@1"},
                 check=False, cache=compile_cache)
  assert proc.returncode == EXIT_REPLICA_FAILED, proc.stderr[-3000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert errors[0].startswith("error: replica 1 (pid ") and "killed by signal 9" in errors[0]
  assert time.perf_counter() - start < 300
  # Process 0 had started step 1's save before step 2 could run; the failed run lets it
  # (and step 2's, if started) commit: no half-written step is left.
  saved = sorted(os.listdir(os.path.join(tmp_path, "run", "checkpoints")))
  assert saved in (["1"], ["1", "2"]), saved


def test_faked_slurm_job_initializes_and_runs_a_step(tiny_hf_dirs, tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu", SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="127.0.0.1",
             SLURM_NTASKS="2", JAX_COORDINATOR_PORT=str(free_local_port()))
  cmd = [sys.executable, "-m", "experiments.run", f"--model={tiny_hf_dirs['qwen2']}",
         f"--tasks={TASKS}", "--num_train=32", "--num_val=4", "--max_prompt_len=96",
         "--max_new_tokens=12", "--prompts_per_step=2", "--group_size=4",
         "--micro_batch_rows=2", "--eval_every=0", "--reward_workers=1", "--steps=1",
         "--cluster=auto", *FLAGS, f"--run_dir={tmp_path / 'run'}"]
  procs = [subprocess.Popen(cmd, cwd=REPO, env=dict(env, SLURM_PROCID=str(i),
                                                     SLURM_LOCALID=str(i)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  outs = [p.communicate(timeout=600) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  assert "on 2 replicas" in outs[0][1]
  assert [r["step"] for r in records(str(tmp_path / "run"))] == [1]

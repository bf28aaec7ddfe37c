"""`experiments.run --replicas=2 --drafter=DIR --drafter_train=always`: the TLT step on a
tiny model. Replica 1 is made the straggler (TLT_JAX_STRAGGLER), so replica 0 finishes
first and trains the drafter while replica 1 is still busy; at the step end both hold the
same drafter bits, and the deploy gate has scored deployed and candidate drafters. SD
stays off in the rollout (its threshold is never met): the drafter trains from the hidden
states of plain decoding, and the run compiles few programs. A resumed run continues each
replica's drafter checkpoint and SD memory."""
from __future__ import annotations

import json
import os

import pytest

from tests.test_rl_run_cli import run_cli
from tests.test_rl_run_sd_cli import drafter_dir  # noqa: F401 - a fixture

ONLINE = ("--eval_every=0", "--num_val=0", "--sd_threshold=1", "--sd_patience=1000",
          "--replicas=2", "--drafter_train=always", "--drafter_seq_len=32",
          "--drafter_batch_rows=2", "--drafter_heldout_fraction=0.25", "--drafter_lr=1e-3",
          "--strategy=3_1_4", "--temperature=1.0")


def test_the_first_replica_trains_the_drafter_while_the_straggler_decodes(
    tiny_hf_dirs, drafter_dir, tmp_path, compile_cache):  # noqa: F811 - the fixture
  run_dir = str(tmp_path / "run")
  proc = run_cli(run_dir, tiny_hf_dirs["qwen2"], "--steps=2", f"--drafter={drafter_dir}",
                 *ONLINE, env_extra={"TLT_JAX_STRAGGLER": "1:5.0"}, cache=compile_cache)
  records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  assert [r["step"] for r in records] == [1, 2], proc.stderr[-3000:]
  assert all(r["drafter/replicas_identical"] == 1 for r in records)
  # Step 1 compiles, each replica at its own pace; by step 2 replica 1's 5 s decide: process
  # 0 (whose metrics these are) finished first and trained until replica 1's increment
  # announced the end of the rollout.
  record = records[1]
  assert record["drafter/train_steps"] > 0, record
  used, available = record["drafter/idle_device_s_used"], record[
      "drafter/idle_device_s_available"]
  assert available >= 2.0 and 0 < used <= available, record
  starts = [start for start, _ in record["drafter/train_spans"]]
  assert starts == sorted(starts) and starts[-1] < available   # every step began before
  # A stop waits for the drafter step in flight at most (the steps were compiled up front).
  assert record["drafter/preempt_latency_s"] < max(end - start for start, end in
                                                   record["drafter/train_spans"]) + 0.5
  assert record["drafter/candidate_steps"] >= record["drafter/train_steps"]
  assert record["drafter/heldout_accept_candidate"] >= 0 and record["drafter/deployed"] in (0, 1)
  # The buffer holds both steps' responses.
  assert record["drafter/buffer_bytes"] > records[0]["drafter/buffer_bytes"] > 0

  # Resume: each replica continues its own drafter checkpoint of step 2 (the candidate's
  # optimizer step count goes on from step 2's instead of starting over).
  for replica in (0, 1):
    assert os.listdir(os.path.join(run_dir, "drafter", f"replica_{replica}")) == [
        "step_00000002"]
  # What SD learned is kept per replica (each replica's bandit sees its own rollouts).
  with open(os.path.join(run_dir, "checkpoints", "2", "meta", "metadata")) as f:
    assert len(json.load(f)["spec"]) == 2
  proc = run_cli(run_dir, tiny_hf_dirs["qwen2"], "--steps=3", "--resume=auto",
                 f"--drafter={drafter_dir}", *ONLINE, env_extra={"TLT_JAX_STRAGGLER": "1:5.0"},
                 cache=compile_cache)
  assert "resumed" in proc.stderr
  resumed = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))][-1]
  assert resumed["step"] == 3 and resumed["drafter/replicas_identical"] == 1
  assert resumed["drafter/candidate_steps"] >= record["drafter/candidate_steps"] > 0


def test_online_drafter_flags_are_checked_before_loading(tiny_hf_dirs, tmp_path):
  proc = run_cli(str(tmp_path / "a"), tiny_hf_dirs["qwen2"], "--steps=1",
                 "--drafter_train=always", check=False)
  assert proc.returncode != 0
  assert proc.stderr.strip().splitlines()[-1].endswith(
      "--drafter_train=always needs a learned drafter: --drafter=DIR (with or without "
      "--hybrid)")
  proc = run_cli(str(tmp_path / "b"), tiny_hf_dirs["qwen2"], "--steps=1",
                 "--drafter_lr=1e-3", check=False)
  assert proc.returncode != 0 and "--drafter_lr needs --drafter_train" in proc.stderr

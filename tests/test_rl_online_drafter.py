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

# The drafter fixture is barely trained: it learns in many passes over a replica's few
# responses (no warm-up, a high rate, no epoch cap), which a warm drafter must not.
ONLINE = ("--eval_every=0", "--num_val=0", "--sd_threshold=1", "--sd_patience=1000",
          "--replicas=2", "--drafter_train=always", "--drafter_seq_len=32",
          "--drafter_batch_rows=2", "--drafter_heldout_fraction=0.25", "--drafter_lr=1e-3",
          "--drafter_warmup_steps=0", "--drafter_max_epochs=100",
          "--strategy=3_1_4", "--temperature=1.0")


def test_the_first_replica_trains_the_drafter_while_the_straggler_decodes(
    tiny_hf_dirs, drafter_dir, tmp_path, compile_cache):  # noqa: F811 - the fixture
  run_dir = str(tmp_path / "run")
  # With validation at step 0: its answers are the first data a replica's buffer holds.
  online = (*ONLINE, "--num_val=2", "--eval_every=2", "--drafter_replay_steps=2")
  proc = run_cli(run_dir, tiny_hf_dirs["qwen2"], "--steps=2", f"--drafter={drafter_dir}",
                 *online, env_extra={"TLT_JAX_STRAGGLER": "1:5.0"}, cache=compile_cache)
  records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  assert [r["step"] for r in records] == [0, 1, 2], proc.stderr[-3000:]
  records = records[1:]
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
  # The buffer holds both steps' responses, and the other replica's long ones.
  assert record["drafter/buffer_bytes"] > records[0]["drafter/buffer_bytes"] > 0
  assert all(r["drafter/shared_sequences"] > 0 and r["drafter/shared_bytes"] > 0
             for r in records), records

  # Resume: each replica continues its own drafter checkpoint of step 2 (the candidate's
  # optimizer step count goes on from step 2's instead of starting over).
  for replica in (0, 1):
    saved = os.path.join(run_dir, "drafter", f"replica_{replica}")
    assert os.listdir(saved) == ["step_00000002"]
    # Each replica buffered its own validation answer of step 0, and step 2's.
    with open(os.path.join(saved, "step_00000002", "buffer.json")) as f:
      added = json.load(f)["added"]
    assert added["0"] == 1 and added["2"] >= 1, added
  # What SD learned is kept per replica (each replica's bandit sees its own rollouts).
  with open(os.path.join(run_dir, "checkpoints", "2", "meta", "metadata")) as f:
    assert len(json.load(f)["spec"]) == 2
  proc = run_cli(run_dir, tiny_hf_dirs["qwen2"], "--steps=3", "--resume=auto",
                 f"--drafter={drafter_dir}", *online, env_extra={"TLT_JAX_STRAGGLER": "1:5.0"},
                 cache=compile_cache)
  assert "resumed" in proc.stderr
  resumed = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))][-1]
  assert resumed["step"] == 3 and resumed["drafter/replicas_identical"] == 1
  assert resumed["drafter/candidate_steps"] >= record["drafter/candidate_steps"] > 0


def test_online_drafter_flags_are_checked_before_loading(tiny_hf_dirs, drafter_dir,
                                                         tmp_path):  # noqa: F811 - the fixture
  proc = run_cli(str(tmp_path / "a"), tiny_hf_dirs["qwen2"], "--steps=1",
                 "--drafter_train=always", check=False)
  assert proc.returncode != 0
  assert proc.stderr.strip().splitlines()[-1].endswith(
      "--drafter_train=always needs a learned drafter: --drafter=DIR (with or without "
      "--hybrid)")
  proc = run_cli(str(tmp_path / "b"), tiny_hf_dirs["qwen2"], "--steps=1",
                 "--drafter_lr=1e-3", check=False)
  assert proc.returncode != 0 and "--drafter_lr needs --drafter_train" in proc.stderr
  # 2 prompts x 4 over 2 replicas: 4 responses each a step, of which 5% holds out none.
  proc = run_cli(str(tmp_path / "c"), tiny_hf_dirs["qwen2"], "--steps=1",
                 f"--drafter={drafter_dir}", *ONLINE, "--drafter_heldout_fraction=0.05",
                 check=False)
  assert proc.returncode != 0
  assert ("error: --drafter_heldout_fraction=0.05: holds out none of a replica's 4 responses a "
          "step, so the deploy gate could never deploy a trained drafter; use >= 0.25"
          in proc.stderr), proc.stderr[-2000:]


def test_greedy_rollouts_are_the_same_with_and_without_the_online_drafter(
    tiny_hf_dirs, drafter_dir, tmp_path, compile_cache):  # noqa: F811 - the fixture
  """T=0, two replicas, three steps: SD from the first decode step with the drafter replica 0
  trains while replica 1 decodes (the gate judges step 1's candidate on step 2's held-out
  windows, and step 3 drafts with it) against no SD at all. Greedy rows of a group are equal,
  so advantages are 0 and the update moves the policy by the KL and weight-decay terms of the
  rollout's tokens: the same rollouts give the same rewards, update metrics and final policy,
  bit for bit."""
  common = ("--steps=3", "--replicas=2", "--temperature=0", "--eval_every=0", "--num_val=0",
            "--checkpoint_every=2")
  runs = {}
  for name, extra in (("plain", ()), ("online", (f"--drafter={drafter_dir}", *ONLINE,
                                                 "--temperature=0", "--sd_threshold=8",
                                                 "--sd_patience=0"))):
    run_dir = str(tmp_path / name)
    proc = run_cli(run_dir, tiny_hf_dirs["qwen2"], *common, *extra,
                   env_extra={"TLT_JAX_STRAGGLER": "1:5.0"}, cache=compile_cache)
    runs[name] = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["step"] for r in runs[name]] == [1, 2, 3], proc.stderr[-3000:]
  plain, online = runs["plain"], runs["online"]
  assert all(r["spec/verify_steps"] > 0 for r in online)            # SD drafted every step
  # Process 0's metrics: it trained in a step it finished first (replica 1 is held back),
  # and the gate deployed what was trained, so a later rollout drafted with new weights.
  assert any(r.get("drafter/train_steps", 0) > 0 for r in online), online
  assert online[1].get("drafter/deployed") == 1, online[1]
  for a, b in zip(plain, online):
    compared = [k for k in a if k.startswith(("actor/", "reward/", "response_len/", "data/"))
                and k != "actor/ratio_mean"]   # it carries the rollout log-probs' rounding
    assert {"reward/mean", "response_len/mean", "actor/loss", "actor/grad_norm"} <= set(
        compared)
    assert {k: a[k] for k in compared} == {k: b[k] for k in compared}
  exported = [open(os.path.join(tmp_path, name, "hf_export", "model.safetensors"), "rb").read()
              for name in ("plain", "online")]
  assert exported[0] == exported[1]

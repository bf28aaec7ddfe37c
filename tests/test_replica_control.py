"""The replicas' control plane (tlt_jax/distributed) with two local processes joined by
jax.distributed: replica states per step, the atomic finished-count whose second increment
publishes rollout-done, the watcher that stops a replica "training" while the other still
decodes, key cleanup, and the host collectives (allgather, local copies of replicated
arrays). Each process runs tests/replica_control_worker.py and prints what it saw. Also
the process flags' checks and how a step's groups are split across replicas."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tlt_jax.errors import UserInputError
from tlt_jax.runtime.processes import ProcessPlan, free_local_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def reports():
  port = free_local_port()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu")
  procs = [subprocess.Popen([sys.executable, "-m", "tests.replica_control_worker", str(port),
                             str(i)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for i in range(2)]
  outs = [p.communicate(timeout=120) for p in procs]
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


@pytest.mark.parametrize("step, first", [("1", 1), ("2", 0)])
def test_first_finisher_trains_until_the_last_publishes(reports, step, first):
  early, late = reports[first]["steps"][step], reports[1 - first]["steps"][step]
  for report in reports:
    assert report["steps"][step]["busy"] == ["BUSY"] * 2
    assert report["steps"][step]["done"] is True
    assert report["steps"][step]["final"] == ["DONE"] * 2
    assert report["steps"][step]["cleared"] is True
  assert early["count"] == 1 and late["count"] == 2
  # The late replica saw the early one training while it still decoded.
  assert late["other_state"] == "TRAINING"
  # Training steps ran during the other's decoding (~1 s of 20 ms steps) and stopped
  # promptly once rollout-done was published (the watcher, not a poll of the store).
  assert early["trained"] >= 10
  assert early["train_started"] < late["published_at"] <= early["stopped_at"]
  assert early["stopped_at"] - late["published_at"] < 0.5


def test_host_collectives(reports):
  for report in reports:
    assert report["gather_a"] == [[0, 0, 0], [1, 1, 1]]
    assert report["gather_b"] == [0.5, 1.5]
    assert report["gather_json"] == [{"replica": 0, "counts": []},
                                     {"replica": 1, "counts": [0, 1, 2, 3, 4]}]
    assert report["local_copy"] == [[0.0, 1.0, 2.0, 3.0], True]
    assert report["late_try_get"] is None


@pytest.mark.parametrize("plan, message", [
    (ProcessPlan(process_id=1), "--process_id: also pass --coordinator_address and "
                                "--num_processes"),
    (ProcessPlan(replicas=0), "--replicas=0: must be >= 1"),
    (ProcessPlan(coordinator_address="h:1", num_processes=2, process_id=2),
     "--process_id=2: must be in [0, --num_processes=2)"),
    (ProcessPlan(replicas=3, coordinator_address="h:1", num_processes=2, process_id=0),
     "--replicas=3: the job has --num_processes=2"),
    (ProcessPlan(coordinator_address="h:1", num_processes=2, process_id=0, cluster="auto"),
     "--cluster=auto: the process flags already say how to join"),
])
def test_bad_process_flags_are_one_line(plan, message):
  with pytest.raises(UserInputError) as error:
    plan.check()
  assert str(error.value).startswith(message), str(error.value)


def test_modes():
  assert ProcessPlan().mode == "single"
  assert ProcessPlan(replicas=2).mode == "launch"
  assert ProcessPlan(cluster="auto").mode == "join"
  assert ProcessPlan(coordinator_address="h:1", num_processes=2, process_id=1).mode == "join"


@pytest.mark.parametrize("groups, count", [(8, 2), (7, 3), (3, 3), (5, 4)])
def test_replica_blocks_cover_the_groups_once(groups, count):
  from tlt_jax.rl.replicas import Replicas
  blocks = [Replicas(r, count).block(groups) for r in range(count)]
  covered = [g for b in blocks for g in range(groups)[b]]
  assert covered == list(range(groups))                  # whole groups, in order, once
  sizes = [b.stop - b.start for b in blocks]
  assert max(sizes) - min(sizes) <= 1 and max(sizes) == Replicas(0, count).max_block(groups)


def test_replica_seeds():
  from tlt_jax.rl.replicas import Replicas
  assert Replicas(0, 1).seed(1234) == Replicas(0, 2).seed(1234) == 1234
  assert len({Replicas(r, 4).seed(1234) for r in range(4)}) == 4

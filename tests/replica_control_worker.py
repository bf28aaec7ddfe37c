"""One process of tests/test_replica_control.py's two-process job (`python -m
tests.replica_control_worker PORT PROCESS_ID`): the control plane through two steps in which
each replica in turn finishes first and "trains" until rollout-done, plus the host
collectives. Prints one JSON line of what it saw."""
import json
import sys
import time


def state(control, step: int, replica: int) -> str | None:
  value = control.state_of(step, replica)
  return None if value is None else value.value


def main(port: int, me: int) -> dict:
  import jax
  jax.distributed.initialize(f"127.0.0.1:{port}", 2, me)
  import numpy as np

  from tlt_jax.distributed.collectives import allgather, allgather_json, local_copy
  from tlt_jax.distributed.control import ReplicaControl, ReplicaState
  from tlt_jax.distributed.kv_store import KeyValueStore

  store = KeyValueStore(timeout_s=60)
  control = ReplicaControl(store, num_replicas=2, replica=me)
  report: dict = {"steps": {}}
  for step, first in ((1, 1), (2, 0)):
    control.set_state(step, ReplicaState.BUSY)
    store.barrier(f"test/start/{step}")
    seen = {"busy": [state(control, step, r) for r in range(2)]}
    store.barrier(f"test/seen_busy/{step}")
    if me == first:                  # finishes first: idle, then trains until preempted
      seen["count"] = control.finish_rollout(step)
      control.set_state(step, ReplicaState.IDLE)
      watch = control.watch_rollout_done(step)
      control.set_state(step, ReplicaState.TRAINING)
      trained, started = 0, time.time()
      while not watch.event.is_set():
        time.sleep(0.02)             # one "drafter step"
        trained += 1
      seen.update(trained=trained, stopped_at=time.time(), train_started=started)
      watch.stop()
    else:                            # decodes on, finishes last, announces the end
      time.sleep(1.0)
      seen["other_state"] = state(control, step, first)
      seen["count"] = control.finish_rollout(step)
      seen["published_at"] = time.time()
    control.set_state(step, ReplicaState.DONE)
    seen["done"] = control.rollout_done(step)
    store.barrier(f"test/end/{step}")
    seen["final"] = [state(control, step, r) for r in range(2)]
    store.barrier(f"test/read/{step}")
    if me == 0:
      control.clear(step)
    store.barrier(f"test/cleared/{step}")
    seen["cleared"] = control.state_of(step, 0) is None and not control.rollout_done(step)
    report["steps"][step] = seen
  got = allgather({"a": np.full((3,), me, np.int32), "b": np.float32(me + 0.5)})
  report["gather_a"] = got["a"].tolist()
  report["gather_b"] = got["b"].tolist()
  # Different lengths per process: the shorter is padded and cut back.
  report["gather_json"] = allgather_json({"replica": me, "counts": list(range(me * 5))})
  mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
  replicated = jax.device_put(np.arange(4.0), jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec()))
  copy = local_copy(replicated)
  report["local_copy"] = [np.asarray(copy).tolist(), copy.is_fully_addressable]
  report["late_try_get"] = store.try_get("test/never-set")
  return report


if __name__ == "__main__":
  print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2]))), flush=True)

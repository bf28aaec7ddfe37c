"""The flags that say how this process joins a run of several (one rollout replica per
process), and the call that acts on them before jax is imported (`start_processes`).
A run may resume with other process flags: they are not among the flags a checkpoint
records (`rl_flags.run_flags`)."""
from __future__ import annotations

from absl import flags

from tlt_jax.runtime.processes import ProcessPlan, Processes

_REPLICAS = flags.DEFINE_integer("replicas", 1, "Rollout replicas, one process each. On one "
                                 "host, process 0 launches the others and joins them, each "
                                 "on its own core (CPU) or an even share of the host's GPUs; "
                                 "in a multi-host job it must equal the job's process count "
                                 "(or stay 1).")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "Multi-host: host:port of "
                                   "process 0's coordination service (with --num_processes "
                                   "and --process_id).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Multi-host: processes in the "
                                      "job.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "Multi-host: this process's index, "
                                   "0 .. --num_processes - 1.")
_CLUSTER = flags.DEFINE_enum("cluster", "none", ["none", "auto"], "auto: join the job that "
                             "JAX finds in the environment (Slurm, Open MPI, Kubernetes, "
                             "TPU) instead of the process flags.")
_EXIT_TIMEOUT = flags.DEFINE_float("replica_exit_timeout_s", 60.0, "Local launch: how long "
                                   "process 0 waits for the others to end after the run.")

def start_processes() -> Processes:
  """Launches, pins and joins this run's processes (a no-op for one process)."""
  plan = ProcessPlan(replicas=_REPLICAS.value, coordinator_address=_COORDINATOR.value,
                     num_processes=_NUM_PROCESSES.value, process_id=_PROCESS_ID.value,
                     cluster=_CLUSTER.value, exit_timeout_s=_EXIT_TIMEOUT.value)
  return Processes(plan).start()


def planned_replicas() -> int:
  """The rollout replicas a run of these flags has, before any process starts (for
  experiments.plan): --replicas, or a joined job's --num_processes."""
  return _NUM_PROCESSES.value or _REPLICAS.value

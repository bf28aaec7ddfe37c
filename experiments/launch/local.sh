#!/usr/bin/env bash
# Two rollout replicas on this machine, one process each (on CPU each pinned to a core, on
# a GPU host each with half its GPUs). Process 0 launches the other, joins it through
# jax.distributed on 127.0.0.1, and alone writes the run dir. The same with explicit
# processes, e.g. to run them under a debugger (on a GPU host JAX_LOCAL_DEVICE_IDS=0 and =1
# give each its GPU):
#   python -m experiments.run ... --coordinator_address=127.0.0.1:8476 --num_processes=2 --process_id=0 &
#   python -m experiments.run ... --coordinator_address=127.0.0.1:8476 --num_processes=2 --process_id=1
set -euo pipefail
cd "$(dirname "$0")/../.."
REPLICAS="${REPLICAS:-2}"
exec python -m experiments.run --flagfile=experiments/configs/quickstart.flags \
  --replicas="$REPLICAS" --run_dir="${RUN_DIR:-runs/quickstart_replicas}" "$@"

"""Whether a run fits its devices, before anything loads: per-device memory of each part.

  python -m experiments.plan --flagfile=experiments/configs/qwen2_5_7b_gpu.flags

Reads experiments.run's flags (a run's flagfile as it is) and the model's config only (its
config.json, GGUF metadata, or a table of known architectures when the path is not here:
`models.known_configs`), and prints per device: params, optimizer state, reference model,
drafter and its optimizer, the rollout's copy of the layers, its KV cache at the row budget
(--rollout_max_rows or --kv_cache_memory_fraction), the update's gradients and activations
(with and without remat), both phases' peaks, and the rollout's rows and admission waves.
A run that cannot fit is refused with one line naming the flag to change (exit 2);
experiments.run makes the same check at its start. Device memory: what JAX reports on a
GPU or TPU, else --device_memory_gib (the GPU flagfiles name their hardware's). With
--replicas (or a joined job's --num_processes) the plan is one replica's: its block of the
rows on its share of the devices, beside a data-parallel update.
"""
from __future__ import annotations

from experiments import cli, replica_flags
from experiments import run as _run_flags  # noqa: F401  (a run's flags, so its flagfiles parse)
from experiments.rl_flags import memory_plan


def main(argv):
  del argv
  from tlt_jax.rl.memory_plan import check, describe

  plan, sources = memory_plan(replica_flags.planned_replicas())
  for name, source in sources.items():
    print(f"{name}: {source}")
  print("\n".join(describe(plan)))
  check(plan)
  print("fits")


if __name__ == "__main__":
  cli.run(main)

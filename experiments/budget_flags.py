"""The rollout's memory budget and the device memory it is taken from, shared by
experiments.run, experiments.generate and experiments.plan."""
from __future__ import annotations

import os

from absl import flags

from tlt_jax.errors import UserInputError

MAX_ROWS = flags.DEFINE_integer(
    "rollout_max_rows", 0, "Most rows a rollout holds at once (the KV cache's batch); "
    "prompts beyond it wait and are prefilled into rows that finish. 0: every row at once, "
    "or as --kv_cache_memory_fraction gives.", lower_bound=0)
KV_FRACTION = flags.DEFINE_float(
    "kv_cache_memory_fraction", 0.0, "Sets --rollout_max_rows to the rows this share of a "
    "device's memory holds, of what the run's resident state leaves (params; in "
    "experiments.run also the optimizer state, the reference model, the drafter and the "
    "rollout's copy of the layers). 0: off.", lower_bound=0.0, upper_bound=1.0)
DEVICE_MEMORY_GIB = flags.DEFINE_float(
    "device_memory_gib", 0.0, "Memory of one device, GiB, where JAX reports none "
    "(jax.devices()[0].memory_stats(): a CPU, or planning on a machine without the "
    "accelerator); 0: the host's memory split over its CPU devices.", lower_bound=0.0)


def check_budget_flags() -> None:
  if MAX_ROWS.value and KV_FRACTION.value:
    raise UserInputError(f"--rollout_max_rows={MAX_ROWS.value} and "
                         f"--kv_cache_memory_fraction={KV_FRACTION.value}: set one of them")


def device_memory() -> tuple[int, str]:
  """(bytes of one device, where the figure came from): what JAX reports (memory_stats'
  bytes_limit, on GPU and TPU), else --device_memory_gib, else the host's memory over its
  CPU devices. This process's own devices: another process's report no stats here."""
  import jax

  devices = jax.local_devices()
  stats = devices[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return int(stats["bytes_limit"]), f"{devices[0].device_kind} memory_stats"
  if DEVICE_MEMORY_GIB.value:
    return int(DEVICE_MEMORY_GIB.value * 2**30), "--device_memory_gib"
  host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  return host // len(devices), f"host memory over {len(devices)} CPU device(s)"

"""A faulty reward for tests/test_rl_bad_input.py, importable by the spawned reward workers
(`--reward=tests.rl_bad_reward_helpers:stalls_once_then_raises`, repo root as cwd)."""
import os
import time

# A file path; the item that creates it stalls.
STALL_MARKER_ENV = "TLT_JAX_TEST_STALL_MARKER"


def stalls_once_then_raises(response, ground_truth, data_source, extra_info):
  """One item overruns any --reward_timeout_s, every other raises: both faults in one run,
  with exactly one timeout (the marker file makes the stall happen once per test)."""
  try:
    os.close(os.open(os.environ[STALL_MARKER_ENV], os.O_CREAT | os.O_EXCL))
  except FileExistsError:
    raise RuntimeError("reward bug on purpose") from None
  time.sleep(600)
  return 0.0

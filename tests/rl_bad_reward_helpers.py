"""Faulty rewards for tests/test_rl_bad_input.py, importable by the spawned reward workers
(`--reward=tests.rl_bad_reward_helpers:NAME`, repo root as cwd)."""
import os
import time

# A file path; the item that creates it stalls.
STALL_MARKER_ENV = "TLT_JAX_TEST_STALL_MARKER"
_calls = 0  # this worker's items since it started


def stalls_once_then_fails_every_other(response, ground_truth, data_source, extra_info):
  """One item overruns any --reward_timeout_s; after it, a worker raises on every other
  item it scores (its 2nd, 4th, ...) and scores the rest 0: both per-item faults in one
  run, exactly one timeout, and some items scored in every step (the marker file makes the
  stall happen once per test; with one worker, step 1's 7 other items raise 3 times)."""
  global _calls
  try:
    os.close(os.open(os.environ[STALL_MARKER_ENV], os.O_CREAT | os.O_EXCL))
  except FileExistsError:
    _calls += 1
    if _calls % 2 == 0:
      raise RuntimeError("reward bug on purpose") from None
    return 0.0
  time.sleep(600)
  return 0.0


def always_raises(response, ground_truth, data_source, extra_info):
  """A reward whose every item fails: the run must stop, not train on zeros."""
  raise KeyError("extra_info has no 'answer'")

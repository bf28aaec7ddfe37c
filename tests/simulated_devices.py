"""Runs a test module's check in a child process with 8 simulated CPU devices: the device
count is fixed before jax starts, so a sharded check cannot run in the pytest process. The
module prints its result as one JSON line (`python -m tests.NAME`)."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_on_8_devices(module: str) -> dict:
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-m", module], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])

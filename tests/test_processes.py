"""A local launch's claim on the host's devices (`runtime.processes`): a core per replica on
CPU, an even group of the host's GPUs per replica on a GPU host, checked before any child
starts. The GPU side runs here with the platform and the visible GPUs faked, and stops at
`jax.distributed.initialize`, whose arguments it checks."""
from __future__ import annotations

import os
import types

import jax
import pytest

from tlt_jax.errors import UserInputError
from tlt_jax.runtime import processes
from tlt_jax.runtime.processes import (LAUNCHER_FD_ENV, ProcessPlan, Processes,
                                       accelerator_platform, device_group, local_gpu_count)


class _Initialized(Exception):
  """Raised by the faked jax.distributed.initialize, with its arguments."""


@pytest.fixture
def faked_start(monkeypatch):
  """start() up to jax.distributed.initialize, recording the children it launches and
  restoring the JAX config it sets."""
  launched: list[str] = []
  monkeypatch.setattr(Processes, "_launch_children", lambda self, address:
                      launched.append(address))
  def initialize(**kwargs):
    raise _Initialized(kwargs)
  monkeypatch.setattr(jax.distributed, "initialize", initialize)
  recoverable = jax.config.jax_enable_recoverability
  yield launched
  jax.config.update("jax_enable_recoverability", recoverable)


def test_gpus_split_evenly_in_order():
  assert device_group(0, 2, 8) == [0, 1, 2, 3]
  assert device_group(1, 2, 8) == [4, 5, 6, 7]
  assert [device_group(i, 4, 4) for i in range(4)] == [[0], [1], [2], [3]]
  for gpus in (3, 1, 0):
    with pytest.raises(UserInputError, match=r"--replicas=2: .* do not split evenly"):
      device_group(0, 2, gpus)


def test_visible_gpus_are_counted_without_starting_the_gpu_runtime(monkeypatch):
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,3,5")
  assert local_gpu_count() == 3
  for visible, count in (("", 0), ("-1", 0), ("1,0,-1,2", 2)):   # the runtime stops there
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert local_gpu_count() == count, visible
  monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
  monkeypatch.setattr(processes.glob, "glob", lambda pattern: [
      "/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm"])
  assert local_gpu_count() == 2
  monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0,1,2,3")
  assert local_gpu_count("rocm") == 4
  monkeypatch.delenv("HIP_VISIBLE_DEVICES")
  monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "1")
  assert local_gpu_count("rocm") == 1


def test_the_platform_is_read_before_jax_starts(monkeypatch):
  plugins = []
  monkeypatch.setattr(processes.importlib.metadata, "entry_points",
                      lambda group: plugins if group == "jax_plugins" else [])
  for value, platform in (("cuda", "cuda"), ("gpu", "cuda"), ("rocm,cpu", "rocm"),
                          ("cpu", "cpu"), ("tpu", "tpu")):
    monkeypatch.setenv("JAX_PLATFORMS", value)
    assert accelerator_platform() == platform
  monkeypatch.delenv("JAX_PLATFORMS")
  # Unset: an installed plugin counts only where the host has its devices.
  monkeypatch.setattr(processes.importlib.util, "find_spec", lambda name: None)
  plugins.append(types.SimpleNamespace(name="xla_cuda12", value="jax_cuda12_plugin"))
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
  assert accelerator_platform() == "cuda"
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
  assert accelerator_platform() == "cpu"        # JAX falls back to the CPU
  devices: list[str] = []
  monkeypatch.setattr(processes.glob, "glob", lambda pattern: [
      d for d in devices if d.startswith(pattern.rstrip("*[0-9]"))])
  monkeypatch.setattr(processes.importlib.util, "find_spec", lambda name: object())
  assert accelerator_platform() == "cpu"        # libtpu installed, no TPU here
  devices.append("/dev/accel0")
  assert accelerator_platform() == "tpu"


def test_each_launched_replica_gets_its_own_gpus(monkeypatch, faked_start, capsys):
  monkeypatch.setenv("JAX_PLATFORMS", "cuda")
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
  monkeypatch.delenv(LAUNCHER_FD_ENV, raising=False)
  with pytest.raises(_Initialized) as launcher:
    Processes(ProcessPlan(replicas=2)).start()
  assert launcher.value.args[0]["local_device_ids"] == [0, 1]
  assert launcher.value.args[0]["process_id"] == 0
  assert len(faked_start) == 1
  assert "2 processes on 4 GPUs, one group each: [[0, 1], [2, 3]]" in capsys.readouterr().out
  # The launched child: explicit process flags and the launcher's pipe in its environment.
  monkeypatch.setenv(LAUNCHER_FD_ENV, "-1")
  with pytest.raises(_Initialized) as child:
    Processes(ProcessPlan(replicas=2, coordinator_address="127.0.0.1:1", num_processes=2,
                          process_id=1)).start()
  assert child.value.args[0]["local_device_ids"] == [2, 3]
  assert len(faked_start) == 1
  assert LAUNCHER_FD_ENV not in os.environ     # not passed on to what the child starts


def test_a_cpu_replica_is_pinned_after_its_children_start(monkeypatch, faked_start):
  order = []
  monkeypatch.setattr(Processes, "_launch_children", lambda self, address:
                      order.append("launch"))
  monkeypatch.setattr(processes, "pin_to_core", lambda index: order.append(f"pin {index}"))
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.delenv(LAUNCHER_FD_ENV, raising=False)
  with pytest.raises(_Initialized) as launcher:
    Processes(ProcessPlan(replicas=2)).start()
  assert order == ["launch", "pin 0"]     # a child would inherit the launcher's pinning
  assert "local_device_ids" not in launcher.value.args[0]
  monkeypatch.setenv(LAUNCHER_FD_ENV, "-1")
  with pytest.raises(_Initialized):
    Processes(ProcessPlan(replicas=2, coordinator_address="127.0.0.1:1", num_processes=2,
                          process_id=1)).start()
  assert order == ["launch", "pin 0", "pin 1"]


def test_an_uneven_split_fails_before_any_child_starts(monkeypatch, faked_start):
  monkeypatch.setenv("JAX_PLATFORMS", "cuda")
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
  monkeypatch.delenv(LAUNCHER_FD_ENV, raising=False)
  with pytest.raises(UserInputError, match=r"--replicas=2: this host's 3 GPU\(s\)"):
    Processes(ProcessPlan(replicas=2)).start()
  monkeypatch.setenv("JAX_PLATFORMS", "tpu")
  with pytest.raises(UserInputError, match=r"--replicas=2 on one tpu host"):
    Processes(ProcessPlan(replicas=2)).start()
  assert faked_start == []


def test_a_joined_job_keeps_jax_own_device_choice(monkeypatch, faked_start):
  """Explicit process flags without a launcher (a multi-host job): no group is imposed."""
  monkeypatch.setenv("JAX_PLATFORMS", "cuda")
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
  monkeypatch.delenv(LAUNCHER_FD_ENV, raising=False)
  with pytest.raises(_Initialized) as joined:
    Processes(ProcessPlan(replicas=2, coordinator_address="10.0.0.1:1", num_processes=2,
                          process_id=1)).start()
  assert "local_device_ids" not in joined.value.args[0]
  # A process that inherited a launcher's variable but joins through the environment.
  monkeypatch.setenv(LAUNCHER_FD_ENV, "-1")
  with pytest.raises(_Initialized) as found:
    Processes(ProcessPlan(cluster="auto")).start()
  assert found.value.args[0] == {}

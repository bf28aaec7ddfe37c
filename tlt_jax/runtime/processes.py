"""One process per rollout replica: start the job's processes, join them with
`jax.distributed`, and end the run cleanly when one of them dies.

Three ways to start (`ProcessPlan.mode`):
  single  one process, no jax.distributed (today's runs, unchanged);
  launch  `--replicas=N` on one host: process 0 starts N-1 copies of its own command line
          (plus --process_id/--num_processes/--coordinator_address on 127.0.0.1 and a free
          port) and supervises them;
  join    a multi-host job: --coordinator_address/--num_processes/--process_id given, or
          found in the environment by JAX (`--cluster=auto`: Slurm, Open MPI, Kubernetes,
          TPU).

Faults. In a local launch every process watches the others: process 0 waits on each child,
and each child holds the read end of a pipe from process 0 (end of file: process 0 is
gone; a line: process 0's report of another child's death). The first to learn of a death
prints one line and leaves with `EXIT_REPLICA_FAILED` (no traceback, no wait on a peer that
will never answer). The coordination service runs in recoverable mode there, so that JAX's
own fatal abort of every survivor (a page of logs) does not race the supervisor's line. A
joined multi-host job keeps JAX's defaults: a dead peer ends the others through the
service's heartbeats (bounded by its timeout).

Devices. On CPU each launched process is pinned to one core (`os.sched_setaffinity`) before
jax is imported, so replicas do not contend for cores through their thread pools. On a GPU
host each launched process gets its own group of the host's GPUs (`jax.distributed`'s
`local_device_ids`), the GPUs split evenly in order: without it every process would claim
every GPU. A joined job says its own (JAX's Slurm and Open MPI detection gives each task the
GPU of its local rank when every task sees all the node's GPUs; explicit processes on one
host: JAX_LOCAL_DEVICE_IDS).
"""
from __future__ import annotations

import dataclasses
import glob
import importlib.metadata
import importlib.util
import os
import pathlib
import re
import socket
import subprocess
import sys
import threading
import time
from typing import Callable

from tlt_jax.errors import UserInputError

EXIT_REPLICA_FAILED = 3
LAUNCHER_FD_ENV = "TLT_JAX_LAUNCHER_FD"
DONE = b"done\n"


@dataclasses.dataclass(frozen=True)
class ProcessPlan:
  """How this process joins the job, from the entry point's flags."""
  replicas: int = 1
  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  cluster: str = "none"            # "auto": JAX's environment detection
  exit_timeout_s: float = 60.0     # how long process 0 waits for children at the end
  settle_timeout_s: float = 120.0  # how long a failed run waits for work in flight

  @property
  def explicit(self) -> bool:
    return None not in (self.coordinator_address, self.num_processes, self.process_id)

  @property
  def mode(self) -> str:
    if self.explicit or self.cluster == "auto":
      return "join"
    return "launch" if self.replicas > 1 else "single"

  def check(self) -> None:
    """One line per bad combination, before any process starts."""
    given = [n for n in ("coordinator_address", "num_processes", "process_id")
             if getattr(self, n) is not None]
    if given and len(given) < 3:
      missing = sorted({"coordinator_address", "num_processes", "process_id"} - set(given))
      raise UserInputError(f"--{given[0]}: also pass --{' and --'.join(missing)}")
    if self.replicas < 1:
      raise UserInputError(f"--replicas={self.replicas}: must be >= 1")
    if self.explicit and not 0 <= self.process_id < self.num_processes:
      raise UserInputError(f"--process_id={self.process_id}: must be in [0, "
                           f"--num_processes={self.num_processes})")
    if self.explicit and self.replicas not in (1, self.num_processes):
      raise UserInputError(f"--replicas={self.replicas}: the job has --num_processes="
                           f"{self.num_processes} processes (one replica each)")
    if self.explicit and self.cluster == "auto":
      raise UserInputError("--cluster=auto: the process flags already say how to join; "
                           "pass one or the other")


def free_local_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# The variable that picks the GPUs a process may use, by GPU platform.
GPU_VISIBLE_ENV = {"cuda": "CUDA_VISIBLE_DEVICES", "rocm": "HIP_VISIBLE_DEVICES"}


def accelerator_platform() -> str:
  """"cpu", "cuda", "rocm" or "tpu" (or another JAX_PLATFORMS name): what JAX will pick,
  decided before jax is imported, when pinning and device groups must be set.
  JAX_PLATFORMS's first entry when set; else an installed plugin whose devices this host
  has (without them JAX falls back to the CPU)."""
  plugins = " ".join(f"{p.name} {p.value}" for p in importlib.metadata.entry_points(
      group="jax_plugins")).lower()
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms:
    first = platforms.split(",")[0].strip().lower()
    if first == "gpu":
      return "rocm" if "rocm" in plugins and "cuda" not in plugins else "cuda"
    return first
  if (importlib.util.find_spec("libtpu") is not None
      and (glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))):
    return "tpu"
  for platform in GPU_VISIBLE_ENV:
    if platform in plugins and local_gpu_count(platform):
      return platform
  return "cpu"


def local_gpu_count(platform: str = "cuda") -> int:
  """The GPUs this host lets this process use, counted without starting the GPU runtime:
  the entries of the platform's visibility variable (up to the first invalid one, where
  the runtime stops reading), or else its device files."""
  visible = os.environ.get(GPU_VISIBLE_ENV[platform])
  if platform == "rocm" and visible is None:
    visible = os.environ.get("ROCR_VISIBLE_DEVICES")
  if visible is not None:
    entries = [d.strip() for d in visible.split(",")]
    return next((i for i, d in enumerate(entries) if not d or d.startswith("-")),
                len(entries))
  if platform == "cuda":
    return len([f for f in glob.glob("/dev/nvidia*") if re.fullmatch(r".*/nvidia\d+", f)])
  # ROCm: the kernel driver's topology lists every agent; GPUs have a nonzero gpu_id.
  return sum(pathlib.Path(f).read_text().strip() not in ("", "0")
             for f in glob.glob("/sys/class/kfd/kfd/topology/nodes/*/gpu_id"))


def device_group(index: int, replicas: int, gpus: int, platform: str = "cuda") -> list[int]:
  """Replica `index`'s GPUs (ordinals among the visible ones, in the runtime's order, which
  may differ from nvidia-smi's) when `replicas` processes on one host split its `gpus`
  GPUs evenly, in order."""
  if gpus < replicas or gpus % replicas:
    raise UserInputError(f"--replicas={replicas}: this host's {gpus} GPU(s) do not split "
                         f"evenly into one group per replica ({GPU_VISIBLE_ENV[platform]} "
                         f"picks which GPUs the run may use)")
  size = gpus // replicas
  return list(range(index * size, (index + 1) * size))


def pin_to_core(index: int) -> int:
  """Pins this process to one core of those it may use (the index-th, cyclically)."""
  cores = sorted(os.sched_getaffinity(0))
  core = cores[index % len(cores)]
  os.sched_setaffinity(0, {core})
  return core


def describe_exit(code: int) -> str:
  if code < 0:
    return f"was killed by signal {-code}"
  return f"exited with code {code}"


class Processes:
  """This process's place in the job and its watch over the others."""

  def __init__(self, plan: ProcessPlan):
    self.plan = plan
    self.index, self.count = 0, 1
    self._children: list[tuple[int, subprocess.Popen, int]] = []   # (replica, proc, fd)
    self._ending = threading.Event()
    self._failed = threading.Lock()
    self._settle: list[tuple[str, Callable[[], None]]] = []

  @property
  def primary(self) -> bool:
    return self.index == 0

  # ---- start ----------------------------------------------------------------------------

  def start(self) -> "Processes":
    """Launches the children (launch mode), claims this process's local devices (a core on
    CPU, a group of GPUs), and joins jax.distributed; call before anything imports jax."""
    plan = self.plan
    plan.check()
    if plan.mode == "single":
      return self
    # A launched child's pipe from process 0; not passed on to any process it starts.
    launcher_fd = os.environ.pop(LAUNCHER_FD_ENV, None) if plan.explicit else None
    local = plan.mode == "launch" or launcher_fd is not None
    if plan.mode == "launch":
      kwargs = dict(coordinator_address=f"127.0.0.1:{free_local_port()}",
                    num_processes=plan.replicas, process_id=0)
    elif plan.explicit:
      kwargs = dict(coordinator_address=plan.coordinator_address,
                    num_processes=plan.num_processes, process_id=plan.process_id)
    else:
      kwargs = {}
    platform = accelerator_platform() if local else None
    if platform in GPU_VISIBLE_ENV:   # before any child starts, so a bad split fails once
      kwargs["local_device_ids"] = self._gpu_group(kwargs["process_id"],
                                                   kwargs["num_processes"], platform)
    elif platform not in (None, "cpu"):
      raise UserInputError(f"--replicas={kwargs['num_processes']} on one {platform} host: "
                           f"launch one process per host instead (--cluster=auto, or the "
                           f"process flags)")
    if plan.mode == "launch":
      self._launch_children(kwargs["coordinator_address"])
    if platform == "cpu":   # after the launch: children would inherit the pinning
      pin_to_core(kwargs["process_id"])
    import jax
    if local:   # a local launch: the supervisor, not JAX's abort, reports a dead replica
      jax.config.update("jax_enable_recoverability", True)
    try:
      jax.distributed.initialize(**kwargs)
    except (ValueError, RuntimeError) as e:
      raise UserInputError(f"jax.distributed.initialize: {str(e).splitlines()[0]}") from None
    self.index, self.count = jax.process_index(), jax.process_count()
    if plan.replicas not in (1, self.count):
      raise UserInputError(f"--replicas={plan.replicas}: the job has {self.count} processes")
    if launcher_fd is not None:
      self._watch_launcher(int(launcher_fd))
    return self

  @staticmethod
  def _gpu_group(index: int, count: int, platform: str) -> list[int]:
    """A local launch on a GPU host: this process's group of its GPUs (process 0 says
    every replica's)."""
    gpus = local_gpu_count(platform)
    groups = [device_group(i, count, gpus, platform) for i in range(count)]
    if index == 0:
      print(f"replicas: {count} processes on {gpus} GPUs, one group each: {groups}",
            flush=True)
    return groups[index]

  def _launch_children(self, address: str) -> None:
    argv = [sys.executable, *sys.orig_argv[1:]]
    for replica in range(1, self.plan.replicas):
      read_fd, write_fd = os.pipe()
      env = dict(os.environ, **{LAUNCHER_FD_ENV: str(read_fd)})
      proc = subprocess.Popen(
          [*argv, f"--process_id={replica}", f"--num_processes={self.plan.replicas}",
           f"--coordinator_address={address}"], env=env, pass_fds=(read_fd,))
      os.close(read_fd)
      self._children.append((replica, proc, write_fd))
    for replica, proc, _ in self._children:
      threading.Thread(target=self._watch_child, args=(replica, proc), daemon=True,
                       name=f"watch-replica-{replica}").start()

  # ---- watch ----------------------------------------------------------------------------

  def _watch_child(self, replica: int, proc: subprocess.Popen) -> None:
    code = proc.wait()
    if code != 0 and not self._ending.is_set():
      self.fail(f"replica {replica} (pid {proc.pid}) {describe_exit(code)}")

  def _watch_launcher(self, fd: int) -> None:
    def watch():
      with os.fdopen(fd, "rb") as pipe:
        line = pipe.readline()
      if line == DONE or self._ending.is_set():
        return
      self.fail(line.decode().strip() or "replica 0 (the launcher) ended before the run did")
    threading.Thread(target=watch, daemon=True, name="watch-launcher").start()

  def settle_before_exit(self, what: str, settle: Callable[[], None]) -> None:
    """`settle()` runs (bounded by `plan.settle_timeout_s`) before a failed run exits, so
    work in flight (a checkpoint being written) is not cut short."""
    self._settle.append((what, settle))

  def fail(self, reason: str) -> None:
    """Reports a dead replica in one line, settles, and leaves (from any thread): the
    first report wins; the others of this process wait for the exit."""
    if not self._failed.acquire(blocking=False):
      time.sleep(3600)
    for _, proc, fd in self._children:
      if proc.poll() is None:
        try:
          os.write(fd, f"{reason}\n".encode())
        except OSError:
          pass
    print(f"error: {reason}; ending the run (replica {self.index} of {self.count})",
          file=sys.stderr, flush=True)
    for what, settle in self._settle:
      worker = threading.Thread(target=settle, daemon=True, name=f"settle-{what}")
      worker.start()
      worker.join(self.plan.settle_timeout_s)
      if worker.is_alive():
        print(f"warning: {what} did not finish within {self.plan.settle_timeout_s:.0f} s; "
              "left as it is", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_REPLICA_FAILED)

  def wait_for_failure(self, timeout_s: float) -> None:
    """Gives a watcher `timeout_s` to report a dead replica (a collective that failed in
    this process is most often the echo of one); returns if none did."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
      if self._failed.locked():
        time.sleep(3600)
      time.sleep(0.05)

  # ---- end ------------------------------------------------------------------------------

  def finish(self) -> int:
    """The run is over here: stop watching, tell the children, and (process 0) wait for
    them; returns the exit code (nonzero when a child failed)."""
    self._ending.set()
    code = 0
    for replica, proc, fd in self._children:
      try:
        os.write(fd, DONE)
        os.close(fd)
      except OSError:
        pass
    deadline = time.monotonic() + self.plan.exit_timeout_s
    for replica, proc, _ in self._children:
      try:
        child = proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
      except subprocess.TimeoutExpired:
        proc.kill()
        child = proc.wait()
        print(f"error: replica {replica} (pid {proc.pid}) did not end within "
              f"{self.plan.exit_timeout_s:.0f} s of the run; killed", file=sys.stderr)
      if child != 0:
        print(f"error: replica {replica} (pid {proc.pid}) {describe_exit(child)}",
              file=sys.stderr)
        code = EXIT_REPLICA_FAILED
    return code

  def abandon(self) -> None:
    """This process is leaving on an error of its own: its children learn it through
    their pipes (end of file) and end too; nothing is reported twice."""
    self._ending.set()

"""benchmarks/gpu_check.sh fails when the kernel tests fail (its benchmarks still run).

The script runs in a copy of its folder layout with `python3`, `sha256sum` and
`nvidia-smi` stubbed on PATH; no GPU and nothing from the bundle are needed."""
import os
import pathlib
import stat
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def _stub(bin_dir: pathlib.Path, name: str, body: str) -> None:
  path = bin_dir / name
  path.write_text(f"#!/usr/bin/env bash\n{body}\n")
  path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _run_check(tmp_path, pytest_exit: int) -> subprocess.CompletedProcess:
  root = tmp_path / "repo"
  (root / "benchmarks").mkdir(parents=True)
  (root / "benchmarks" / "gpu_check.sh").write_text(
      (REPO / "benchmarks" / "gpu_check.sh").read_text())
  bundle = root / "gpu_bundle" / "part2"
  (bundle / "wheels").mkdir(parents=True)
  (bundle / "smollm2.gguf.part").write_text("b")
  (bundle / "wheels" / "stub.whl").write_text("")
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  calls = tmp_path / "calls.log"
  # pytest fails (or not); pip, the benchmarks and the version probe succeed.
  _stub(bin_dir, "python3", f'echo "$*" >> {calls}\n'
        f'case "$*" in *pytest*) exit {pytest_exit};; esac\nexit 0')
  _stub(bin_dir, "sha256sum", "exit 0")
  _stub(bin_dir, "nvidia-smi", "exit 0")
  part1 = pathlib.Path("/tmp/smollm2.gguf.part1")   # what the `stage` call leaves
  if not part1.exists():
    part1.write_text("a")
  out = tmp_path / "out"
  out.mkdir()
  env = dict(os.environ, OUT=str(out), PATH=f"{bin_dir}:{os.environ['PATH']}")
  proc = subprocess.run(["bash", str(root / "benchmarks" / "gpu_check.sh"), "run"],
                        env=env, capture_output=True, text=True, timeout=60)
  proc.calls = calls.read_text()
  return proc


@pytest.mark.parametrize("pytest_exit", [0, 1])
def test_failing_kernel_tests_fail_the_check(tmp_path, pytest_exit):
  proc = _run_check(tmp_path, pytest_exit)
  assert "benchmarks/rollout.py" in proc.calls, proc.calls   # the benchmarks still ran
  if pytest_exit:
    assert proc.returncode == 1, proc.stderr
    assert "FAILED: kernel tests" in proc.stderr
  else:
    assert proc.returncode == 0, proc.stderr

"""benchmarks/gpu_check.sh runs every step of a call and fails when any step failed.

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


def _run_check(tmp_path, phase: str, failing: str, slow: str = "nothing-is-slow",
               **limits: str) -> subprocess.CompletedProcess:
  """Runs `gpu_check.sh phase` with every python3 call succeeding at once except those whose
  arguments contain `failing` (exit 1) or `slow` (run for a minute); `limits` set the
  script's per-step limits (e.g. FIXED_S="1")."""
  root = tmp_path / "repo"
  (root / "benchmarks").mkdir(parents=True)
  (root / "benchmarks" / "gpu_check.sh").write_text(
      (REPO / "benchmarks" / "gpu_check.sh").read_text())
  for part, payload in (("part1", "a"), ("part2", "b")):
    (root / "gpu_bundle" / part / "wheels").mkdir(parents=True)
    (root / "gpu_bundle" / part / "smollm2.gguf.part").write_text(payload)
    (root / "gpu_bundle" / part / "wheels" / "stub.whl").write_text("")
  (root / "gpu_bundle" / "part2" / "smollm2.gguf.sha256").write_text("0" * 64)
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  calls = tmp_path / "calls.log"
  _stub(bin_dir, "python3", f'echo "$*" >> {calls}\n'
        f'case "$*" in *"{failing}"*) exit 1;; *"{slow}"*) exec sleep 60;; esac\nexit 0')
  _stub(bin_dir, "sha256sum", "cat >/dev/null")     # reads the expected hash, agrees
  _stub(bin_dir, "nvidia-smi", "exit 0")
  stage = tmp_path / "stage"
  stage.mkdir()
  (stage / "smollm2.gguf.part1").write_text("a")   # what the stage call leaves
  out = tmp_path / "out"
  out.mkdir()
  env = dict(os.environ, OUT=str(out), STAGE=str(stage),
             PATH=f"{bin_dir}:{os.environ['PATH']}", **limits)
  proc = subprocess.run(["bash", str(root / "benchmarks" / "gpu_check.sh"), phase],
                        env=env, capture_output=True, text=True, timeout=60)
  proc.calls = calls.read_text()
  return proc


@pytest.mark.parametrize("failing", ["nothing-fails", "-m pytest"])
def test_stage_runs_the_kernel_benchmark_after_failing_tests(tmp_path, failing):
  proc = _run_check(tmp_path, "stage", failing)
  assert "-m pytest" in proc.calls and "benchmarks/tree_attention.py" in proc.calls, proc.calls
  if failing == "-m pytest":
    assert proc.returncode == 1, proc.stderr
    assert "FAILED: kernel and exactness tests" in proc.stderr
  else:
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("failing", ["nothing-fails", "--tail_rows=0", "model_free.py"])
def test_run_runs_every_benchmark_and_reports_the_failed_one(tmp_path, failing):
  proc = _run_check(tmp_path, "run", failing)
  for script in ("benchmarks/rollout.py", "benchmarks/model_free.py"):
    assert script in proc.calls, proc.calls
  assert f"--model={tmp_path}/stage/smollm2.gguf" in proc.calls
  assert (tmp_path / "stage" / "smollm2.gguf").read_text() == "ab"
  if failing == "nothing-fails":
    assert proc.returncode == 0, proc.stderr
  else:
    assert proc.returncode == 1, proc.stderr
    name = {"--tail_rows=0": "rollout_fixed", "model_free.py": "model_free"}[failing]
    assert f"FAILED: {name} (exit 1)" in proc.stderr, proc.stderr
    # Each step's output lands in its log under $OUT.
    assert (tmp_path / "out" / f"{name}_gpu.log").exists()


def test_a_step_past_its_limit_is_stopped_and_the_next_one_runs(tmp_path):
  proc = _run_check(tmp_path, "run", "nothing-fails", slow="--tail_rows=0", FIXED_S="1")
  assert proc.returncode == 1, proc.stderr
  assert "FAILED: rollout_fixed (exit 124)" in proc.stderr, proc.stderr
  assert "benchmarks/model_free.py" in proc.calls

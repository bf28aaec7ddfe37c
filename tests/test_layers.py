"""The import layers declared in pyproject.toml (`[tool.importlinter]`) hold, and a forbidden
import breaks them: a lower layer reaching up (even from inside a function) and model code
reaching a kernel past the seam (`tlt_jax.ops`)."""
from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("tlt_jax", "experiments")
RUN_LINTER = "from importlinter.cli import lint_imports_command; lint_imports_command()"


def _lint(root: pathlib.Path) -> subprocess.CompletedProcess:
  """`lint-imports` over the packages under `root`, with the contracts of its pyproject.toml
  (no cache: nothing is written into the tree)."""
  return subprocess.run([sys.executable, "-c", RUN_LINTER, "--no-cache"], cwd=root,
                        capture_output=True, text=True, timeout=300,
                        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)})


def test_the_layers_hold():
  result = _lint(REPO)
  assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
  assert "0 broken" in result.stdout


def _copy_sources(dest: pathlib.Path) -> None:
  """The packages' Python files and pyproject.toml, enough for the linter's graph."""
  for package in PACKAGES:
    for path in (REPO / package).rglob("*.py"):
      target = dest / path.relative_to(REPO)
      target.parent.mkdir(parents=True, exist_ok=True)
      shutil.copy(path, target)
  shutil.copy(REPO / "pyproject.toml", dest / "pyproject.toml")


def _append(path: pathlib.Path, code: str) -> None:
  path.write_text(path.read_text() + "\n\n" + code + "\n")


def test_a_forbidden_import_breaks_them(tmp_path):
  _copy_sources(tmp_path)
  # The models reach up into the RL layer, lazily inside a function.
  _append(tmp_path / "tlt_jax/models/transformer.py",
          "def _uses_rl():\n  from tlt_jax.rl import losses\n  return losses")
  # The RL trainer calls a CPU kernel directly instead of through the seam.
  _append(tmp_path / "tlt_jax/rl/logprobs.py", "from tlt_jax.cpu import token_logprobs")
  result = _lint(tmp_path)
  assert result.returncode == 1, result.stdout[-4000:] + result.stderr[-2000:]
  assert "tlt_jax.models is not allowed to import tlt_jax.rl" in result.stdout
  assert "tlt_jax.models.transformer -> tlt_jax.rl.losses" in result.stdout
  assert "tlt_jax.rl.logprobs -> tlt_jax.cpu.token_logprobs" in result.stdout
  assert "2 broken" in result.stdout

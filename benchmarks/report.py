"""Shared output for benchmark scripts: JSON on stdout, optionally also to a file, stamped
with the command and the commit that produced it (benchmarks/results/ keeps one current
figure set per benchmark; its history is git's)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def provenance() -> dict:
  """The command line as run from the repo root, and the commit (with `+uncommitted` when
  tracked code differs from it)."""
  git = lambda *args: subprocess.run(["git", *args], cwd=REPO, capture_output=True,
                                     text=True).stdout.strip()
  script = os.path.relpath(os.path.abspath(sys.argv[0]), REPO)
  dirty = git("status", "--porcelain", "--untracked-files=no", "--", "tlt_jax", "experiments",
              "benchmarks")
  return {"command": " ".join(["python", script, *sys.argv[1:]]),
          "commit": git("rev-parse", "--short", "HEAD") + ("+uncommitted" if dirty else "")}


def emit(result: Any, output: str | None) -> None:
  if isinstance(result, dict):
    result = {**provenance(), **result}   # a script's own command/commit keys win
  text = json.dumps(result, indent=1)
  print(text)
  if output:
    with open(output, "w") as f:
      f.write(text + "\n")

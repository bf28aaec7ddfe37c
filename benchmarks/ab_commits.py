"""One benchmark, two commits, alternated in one run: is the working tree faster than --base?

  python benchmarks/ab_commits.py --base=COMMIT --fields=PATH[,PATH...] [--pairs=3]
      [--output_json=FILE] --script="benchmarks/SCRIPT.py [ITS FLAGS...]"

The script runs as a fresh process in a detached worktree of --base (made here, removed at
the end) and in this checkout, in turn: base, head, base, head ... (--pairs of each), with
`--output=F` appended (the benchmark scripts' JSON file flag; --output_flag renames it).
Each PATH names a number in the script's JSON by keys and list indices joined with dots,
e.g. `fixed.0.sd.tokens_per_s_median`. Per path: both sides' values, medians, and the
median over pairs of head / base (> 1: head is larger). Prints one JSON object.
"""
from __future__ import annotations

import functools
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from absl import flags  # noqa: E402

from benchmarks import ab  # noqa: E402
from benchmarks.report import emit  # noqa: E402
from experiments import cli  # noqa: E402
from tlt_jax.errors import UserInputError  # noqa: E402

_BASE = flags.DEFINE_string("base", None, "Commit to compare the working tree against.")
_SCRIPT = flags.DEFINE_string("script", None, "The benchmark and its flags, one string, "
                              "relative to the repo root.")
_FIELDS = flags.DEFINE_list("fields", None, "Dotted paths of the numbers to compare.")
_PAIRS = flags.DEFINE_integer("pairs", 3, "Runs per side, alternated.", lower_bound=1)
_OUTPUT_FLAG = flags.DEFINE_string("output_flag", "output", "The script's JSON file flag.")
_OUTPUT = flags.DEFINE_string("output_json", None, "Also write the JSON here.")
flags.mark_flags_as_required(["base", "script", "fields"])


def log(message: str) -> None:
  print(f"[ab_commits] {message}", file=sys.stderr, flush=True)


def field(report, path: str) -> float:
  """The number at a dotted path of keys and list indices."""
  value = report
  for key in path.split("."):
    try:
      value = value[int(key)] if isinstance(value, list) else value[key]
    except (KeyError, IndexError, ValueError):
      raise UserInputError(f"--fields: {path!r} not in the script's JSON (at {key!r})")
  if not isinstance(value, (int, float)):
    raise UserInputError(f"--fields: {path!r} is not a number: {value!r}")
  return float(value)


def git(*args: str) -> str:
  return subprocess.run(["git", "-C", REPO, *args], check=True, capture_output=True,
                        text=True).stdout.strip()


def run_side(tree: str, script: list[str], out_dir: str, name: str) -> dict:
  output = os.path.join(out_dir, f"{name}.json")
  command = [sys.executable, *script, f"--{_OUTPUT_FLAG.value}={output}"]
  log(f"{name}: {' '.join(command)} (in {tree})")
  result = subprocess.run(command, cwd=tree, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  if result.returncode != 0:
    raise UserInputError(f"{name}: the script failed (exit {result.returncode}):\n"
                         f"{result.stderr[-2000:]}")
  with open(output) as f:
    return json.load(f)


def side_values(side: str, tree: str, script: list[str], out_dir: str,
                number: int) -> dict[str, float]:
  """Round `number` of `side`: the script run in `tree`; the numbers at --fields."""
  report = run_side(tree, script, out_dir, f"{side}_{number}")
  values = {path: field(report, path) for path in _FIELDS.value}
  log(f"{side} {number}: " + ", ".join(f"{p}={v:.4g}" for p, v in values.items()))
  return values


def main(argv):
  del argv
  script = shlex.split(_SCRIPT.value)
  if not script or not os.path.isfile(os.path.join(REPO, script[0])):
    raise UserInputError(f"--script={_SCRIPT.value!r}: no such script in the repo")
  if _OUTPUT.value:
    cli.check_output_file(_OUTPUT.value, "--output_json")
  try:
    base_commit = git("rev-parse", "--verify", f"{_BASE.value}^{{commit}}")
  except subprocess.CalledProcessError:
    raise UserInputError(f"--base={_BASE.value}: not a commit of this repository")
  head_commit = git("rev-parse", "HEAD")
  dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
  work = tempfile.mkdtemp(prefix="ab_commits_")
  base_tree = os.path.join(work, "base")
  git("worktree", "add", "--detach", base_tree, base_commit)
  trees = {"base": base_tree, "head": REPO}
  try:
    rounds = ab.alternate({side: functools.partial(side_values, side, tree, script, work)
                           for side, tree in trees.items()}, _PAIRS.value, warmup=0)
  finally:
    git("worktree", "remove", "--force", base_tree)
    shutil.rmtree(work, ignore_errors=True)
  values = {side: {p: [r[p] for r in ab.side(rounds, side)] for p in _FIELDS.value}
            for side in trees}
  emit({
      "script": script, "pairs": _PAIRS.value, "order": "base, head, base, head ...",
      "base": base_commit[:7], "head": head_commit[:7] + ("+uncommitted" if dirty else ""),
      "fields": {p: {"base": values["base"][p], "head": values["head"][p],
                     "base_median": statistics.median(values["base"][p]),
                     "head_median": statistics.median(values["head"][p]),
                     "head_over_base_paired_median": ab.paired_median(values["head"][p],
                                                                      values["base"][p])}
                 for p in _FIELDS.value},
  }, _OUTPUT.value)


if __name__ == "__main__":
  cli.run(main)

"""benchmarks/ab_commits.py: numbers found by dotted path, bad input rejected in one line
before any run starts."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.ab_commits import field  # noqa: E402
from tlt_jax.errors import UserInputError  # noqa: E402


def test_field_follows_keys_and_list_indices():
  report = {"fixed": [{"sd": {"tokens_per_s_median": 41.5}}, {"sd": {"n": 3}}]}
  assert field(report, "fixed.0.sd.tokens_per_s_median") == 41.5
  assert field(report, "fixed.1.sd.n") == 3.0
  for path, needle in (("fixed.2.sd.n", "at '2'"), ("fixed.x", "at 'x'"),
                       ("fixed.0.sd", "is not a number"), ("nope", "at 'nope'")):
    with pytest.raises(UserInputError, match=needle):
      field(report, path)


@pytest.mark.parametrize("args, needle", [
    (["--base=not-a-commit", "--fields=a", "--script=benchmarks/rollout.py"],
     "--base=not-a-commit: not a commit"),
    (["--base=HEAD", "--fields=a", "--script=benchmarks/missing.py --x=1"],
     "no such script in the repo"),
    (["--base=HEAD", "--fields=a", "--script=benchmarks/rollout.py",
      "--output_json=/nonexistent/dir/out.json"], "does not exist"),
])
def test_bad_input_is_one_line_and_exit_2(args, needle):
  proc = subprocess.run([sys.executable, "benchmarks/ab_commits.py", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and needle in lines[0], proc.stderr

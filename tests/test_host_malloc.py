"""tlt_jax.runtime.host: entry points restart once with huge-page malloc, keeping the pid,
arguments and a user's own setting; freed heap goes back to the OS on request."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from tlt_jax.runtime import host

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("given, expected", [
    ("", "glibc.malloc.hugetlb=1"),
    ("glibc.malloc.arena_max=2", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"),
    ("glibc.malloc.hugetlb=0", None),
    ("glibc.malloc.arena_max=2:glibc.malloc.hugetlb=2", None),
    ("glibc.malloc.hugetlbx=1", "glibc.malloc.hugetlbx=1:glibc.malloc.hugetlb=1"),
])
def test_tunables_add_huge_pages_unless_the_user_chose(given, expected):
  assert host.tunables_with_huge_pages(given) == expected


def test_return_free_heap_is_safe_to_call_anywhere():
  host.return_free_heap()  # glibc's malloc_trim, or nothing without glibc


ENTRY = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {repo!r})
    from experiments import cli
    def main(argv):
      print(json.dumps({{"pid": os.getpid(), "argv": sys.argv,
                         "tunables": os.environ.get("GLIBC_TUNABLES")}}))
    cli.run(main)
""")


def _run_entry(tmp_path, env_tunables):
  script = tmp_path / "entry.py"
  script.write_text(ENTRY.format(repo=REPO))
  env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
  if env_tunables is not None:
    env["GLIBC_TUNABLES"] = env_tunables
  proc = subprocess.Popen([sys.executable, str(script), "--verbosity=0"], env=env,
                          stdout=subprocess.PIPE, text=True)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 0
  return proc.pid, json.loads(out)


@pytest.mark.skipif(not host.huge_pages_available(),
                    reason="the kernel has no transparent huge pages (always or madvise)")
def test_entry_point_restarts_in_place_with_the_tunable(tmp_path):
  pid, seen = _run_entry(tmp_path, None)
  assert seen["pid"] == pid               # exec, not a child: signals and kills still land
  assert seen["argv"][1:] == ["--verbosity=0"]
  assert seen["tunables"] == "glibc.malloc.hugetlb=1"
  _, kept = _run_entry(tmp_path, "glibc.malloc.hugetlb=0")
  assert kept["tunables"] == "glibc.malloc.hugetlb=0"

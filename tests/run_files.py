"""The test suite, one pytest process per test file, `--jobs` files at a time.

  python -m tests.run_files [--jobs=N] [FILE ...] [-- PYTEST_ARGS ...]

Why not one pytest process: a process that has run the whole suite holds every program
it compiled, and late in such a process XLA's CPU runtime crashed (segfault inside a
speculative-decoding call of tests/test_speculative_smollm2.py that passes in a process of
its own). A process per file keeps each file's state its own; two at a time keep both
cores busy through the single-threaded compiles. Each file's pytest line is printed as it
finishes, the failures' output after the last one, and then the closing line
`tests: N passed, N failed, N skipped`; the exit code is 0 only if every file passed and
at least one test ran.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ElementTree

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
NO_TESTS = 5   # pytest's exit code when nothing was collected (e.g. all deselected by -k)
# The files that take longest (seconds with two at a time on the 2-core CPU, in a full run
# on a shared host), started first so the run does not end on one of them alone; the rest
# follow by name.
LONGEST_FIRST = ("test_speculative.py",         # 1200
                 "test_precompile.py",          # 670
                 "test_drafter_training.py",    # 530
                 "test_rl_replicas_cli.py",     # 490
                 "test_rl_run_cli.py",          # 480
                 "test_rl_online_drafter.py",   # 430
                 "test_hybrid_drafting.py",     # 370
                 "test_generate_sd_cli.py",     # 330
                 "test_rl_bad_input.py",        # 310
                 "test_smollm2_parity.py",      # 290
                 "test_model_free.py")          # 280


def counts(junit_xml: str) -> dict[str, int]:
  """passed / failed / skipped from a pytest JUnit report."""
  root = ElementTree.parse(junit_xml).getroot()
  suites = [root] if root.tag == "testsuite" else list(root)
  total = {k: sum(int(s.get(k, 0)) for s in suites)
           for k in ("tests", "failures", "errors", "skipped")}
  failed = total["failures"] + total["errors"]
  return {"passed": total["tests"] - failed - total["skipped"], "failed": failed,
          "skipped": total["skipped"]}


def run_file(path: str, pytest_args: list[str], work: str) -> tuple[int, dict, str, float]:
  name = os.path.splitext(os.path.basename(path))[0]
  junit = os.path.join(work, f"{name}.xml")
  basetemp = os.path.join(work, name)
  start = time.perf_counter()
  proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                         f"--junitxml={junit}", f"--basetemp={basetemp}", path, *pytest_args],
                        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        stdin=subprocess.DEVNULL)
  seconds = time.perf_counter() - start
  found = counts(junit) if os.path.isfile(junit) else {"passed": 0, "failed": 1, "skipped": 0}
  if proc.returncode not in (0, NO_TESTS) and not found["failed"]:
    found["failed"] = 1   # the process died (a signal) or pytest itself failed
  shutil.rmtree(basetemp, ignore_errors=True)
  return proc.returncode, found, proc.stdout, seconds


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--jobs", type=int, default=2, help="test files run at once")
  parser.add_argument("files", nargs="*", help="test files (default: tests/test_*.py)")
  argv = sys.argv[1:]
  pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
  args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
  if args.jobs < 1:
    parser.error(f"--jobs={args.jobs}: must be >= 1")
  files = args.files or sorted(
      (os.path.join("tests", f) for f in os.listdir(TESTS)
       if f.startswith("test_") and f.endswith(".py")),
      key=lambda f: (LONGEST_FIRST.index(os.path.basename(f))
                     if os.path.basename(f) in LONGEST_FIRST else len(LONGEST_FIRST), f))
  missing = [f for f in files if not os.path.isfile(os.path.join(REPO, f))]
  if missing:
    parser.error(f"{missing[0]}: no such test file")

  start = time.perf_counter()
  total = {"passed": 0, "failed": 0, "skipped": 0}
  failures: list[tuple[str, str]] = []
  lock = threading.Lock()
  with tempfile.TemporaryDirectory(prefix="tlt_jax_tests_") as work:
    # The suite's files share one tokenizer cache of their own (tests/conftest.py).
    os.environ.setdefault("TLT_JAX_TOKENIZER_CACHE", os.path.join(work, "tokenizers"))

    def one(path: str) -> None:
      code, found, output, seconds = run_file(path, pytest_args, work)
      last = output.strip().splitlines()[-1] if output.strip() else f"exit code {code}"
      with lock:
        for key in total:
          total[key] += found[key]
        if found["failed"]:
          failures.append((path, output))
        print(f"{path}: {last.strip('= ')} [{seconds:.0f}s, exit {code}]", flush=True)

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
      list(pool.map(one, files))
  for path, output in failures:
    print(f"\n{'=' * 30} {path} {'=' * 30}\n{output[-20000:]}", flush=True)
  ran = total["passed"] + total["failed"]
  print(f"\n{len(files)} test files in {time.perf_counter() - start:.0f}s")
  print(f"tests: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
  return 0 if not total["failed"] and ran else 1


if __name__ == "__main__":
  sys.exit(main())

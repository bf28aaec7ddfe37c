"""Backs the host's large buffers with transparent huge pages: every entry point starts here.

XLA on CPU takes each program's temporaries from glibc malloc, which serves anything above
its mmap threshold (32 MiB at most) with a fresh mmap and returns it on free. A SmolLM2
training micro-batch so touches ~2 GiB of new 4 KiB pages per call: 516k minor faults and
~1 s of kernel time in 8 s of wall time (benchmarks/train_microbatch.py). With glibc's
`glibc.malloc.hugetlb=1` tunable malloc asks for transparent huge pages (madvise) on those
mappings: ~4k faults, and the micro-batch ran 8.0 -> 6.5 s. The tunable is read when the
process starts, so the entry point re-executes itself once with it set.

A user's own `glibc.malloc.hugetlb` setting in GLIBC_TUNABLES is kept as it is (set it to 0
to turn this off).
"""
from __future__ import annotations

import os
import sys

TUNABLE = "glibc.malloc.hugetlb"
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages_available() -> bool:
  """True on Linux with transparent huge pages in `always` or `madvise` mode."""
  try:
    with open(THP_SETTING) as f:
      setting = f.read()
  except OSError:
    return False
  return "[always]" in setting or "[madvise]" in setting


def tunables_with_huge_pages(tunables: str) -> str | None:
  """GLIBC_TUNABLES with `TUNABLE=1` added; None when it already names the tunable."""
  if any(entry.split("=", 1)[0] == TUNABLE for entry in tunables.split(":") if entry):
    return None
  return ":".join(filter(None, [tunables, f"{TUNABLE}=1"]))


def tunables_without_huge_pages(tunables: str) -> str:
  """GLIBC_TUNABLES without any `TUNABLE` entry: malloc's own default."""
  return ":".join(e for e in tunables.split(":") if e and e.split("=", 1)[0] != TUNABLE)


def reexec_with_huge_pages() -> None:
  """Re-executes this process (same pid, same arguments) with huge-page malloc, once; a
  no-op where the kernel has no transparent huge pages or the user set the tunable."""
  if not huge_pages_available():
    return
  tunables = tunables_with_huge_pages(os.environ.get("GLIBC_TUNABLES", ""))
  if tunables is None:
    return
  os.environ["GLIBC_TUNABLES"] = tunables
  sys.stdout.flush()
  sys.stderr.flush()
  os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])

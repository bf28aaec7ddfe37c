"""Host-level tuning of the process: huge-page malloc and handing freed heap back to the OS.

Both concern glibc's malloc, not the model, so library code never calls them: the entry
points do (experiments/cli.py re-executes with huge pages before anything starts; the RL
entry point hands `return_free_heap` to the learner as its between-phases hook).

Huge pages. XLA on CPU takes each program's temporaries from glibc malloc, which serves
anything above its mmap threshold (32 MiB at most) with a fresh mmap and returns it on free,
so a training micro-batch touches gigabytes of new 4 KiB pages per call, each a minor fault.
With glibc's `glibc.malloc.hugetlb=1` tunable malloc asks for transparent huge pages
(madvise) on those mappings and most of those faults go away (measured by
benchmarks/research/train_microbatch.py). The tunable is read when the process starts, so
the entry point re-executes itself once with it set. A user's own `glibc.malloc.hugetlb`
setting in GLIBC_TUNABLES is kept as it is (set it to 0 to turn this off).

Free heap. XLA's compiler and mid-sized buffers leave the heap fragmented, freed but
resident; `malloc_trim` returns those pages, so a later phase's peak does not stack on top.
"""
from __future__ import annotations

import ctypes
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


def _glibc():
  try:
    libc = ctypes.CDLL("libc.so.6")
    return libc if hasattr(libc, "malloc_trim") else None
  except OSError:
    return None


_LIBC = _glibc()


def return_free_heap() -> None:
  """Hands the C heap's free pages back to the OS (glibc's `malloc_trim`; elsewhere
  nothing to do)."""
  if _LIBC is not None:
    _LIBC.malloc_trim(0)

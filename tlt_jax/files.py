"""Atomic file and directory writes: a reader sees the old content or the new, never half;
and the user's cache dir, where a machine keeps what is built once and reused.

Each writer fills a temporary beside its target (same directory, so the same filesystem)
and renames it into place when the write has finished; an exception midway removes the
temporary and leaves the target as it was. Temporaries are named `.NAME.tmp-XXXX`.

Nothing is fsync'ed: this guards against a process that dies mid-write (a crash, a kill,
a full disk), not against the machine losing power.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import IO, Iterator

from tlt_jax.errors import UserInputError

FILE_MODE = 0o644  # mkstemp's files are private (0600); what we write is meant to be shared
DIR_MODE = 0o755


@contextlib.contextmanager
def atomic_file(path: str, mode: str = "w") -> Iterator[IO]:
  """Yields a file object (`mode` "w" text or "wb" bytes) that becomes `path` once the
  block ends without an exception."""
  if mode not in ("w", "wb"):
    raise ValueError(f"atomic_file mode {mode!r}: expected 'w' or 'wb'")
  directory, base = os.path.split(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{base}.tmp-")
  try:
    with os.fdopen(fd, mode) as f:
      yield f
    os.chmod(tmp, FILE_MODE)
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(tmp)
    raise


def write_atomic(path: str, data: str | bytes) -> None:
  """Writes `data` (text or bytes) to `path` through `atomic_file`."""
  with atomic_file(path, "wb" if isinstance(data, bytes) else "w") as f:
    f.write(data)


@contextlib.contextmanager
def atomic_dir(out_dir: str, overwrite: bool = False) -> Iterator[str]:
  """Yields a temp dir beside `out_dir` that becomes `out_dir` only once fully written.

  A crash or an exception midway leaves no half-written `out_dir` behind. An existing
  non-empty `out_dir` is an error unless `overwrite`; it is then replaced as a whole.
  """
  out_dir = os.path.abspath(out_dir)
  if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
    raise UserInputError(f"{out_dir}: output directory exists and is not empty")
  if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
    raise UserInputError(f"{out_dir}: output path exists and is not a directory")
  parent, base = os.path.split(out_dir)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=parent)
  try:
    os.chmod(tmp, DIR_MODE)
    yield tmp
    if os.path.lexists(out_dir):
      old = tmp + ".old"
      os.rename(out_dir, old)
      os.rename(tmp, out_dir)
      shutil.rmtree(old)
    else:
      os.rename(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def user_cache_dir(name: str) -> str:
  """$XDG_CACHE_HOME/tlt_jax/NAME, else ~/.cache/tlt_jax/NAME (compiled programs,
  tokenizers converted from GGUF)."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "tlt_jax", name)

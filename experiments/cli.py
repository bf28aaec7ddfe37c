"""Shared CLI plumbing: absl flag parsing, user errors as one line with exit code 2, and
the process set-up every entry point shares (huge-page malloc, the compilation cache)."""
from __future__ import annotations

import json
import logging as std_logging
import os
import sys
import warnings
from typing import Any, Callable

from absl import app, flags, logging

from tlt_jax.errors import UserInputError
from tlt_jax.files import atomic_file
from tlt_jax.runtime import compilation_cache, host

EXIT_USAGE = 2

_COMPILATION_CACHE_DIR = flags.DEFINE_string(
    "compilation_cache_dir", None, "Where JAX's persistent compilation cache keeps this "
    "machine's compiled programs, so the next run of a setting loads them instead of "
    "compiling (default: $JAX_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME/tlt_jax/jax or "
    "~/.cache/tlt_jax/jax); empty: off.")


def fail(message: str) -> None:
  print(f"error: {message}", file=sys.stderr)
  sys.exit(EXIT_USAGE)


def _parse_flags(argv: list[str]) -> list[str]:
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    fail(str(e).replace("\n", " "))


def _drop_orbax_tracebacks(record: std_logging.LogRecord) -> bool:
  """Orbax logs a background save's exception with its traceback, then re-raises it to the
  caller (save / wait_until_finished), which reports it as one line: the log is a duplicate."""
  return not (record.exc_info and f"{os.sep}orbax{os.sep}" in record.pathname)


def _drop_unretrieved_write_errors(record: std_logging.LogRecord) -> bool:
  """A failed save's other tensorstore writes fail the same way; asyncio logs each, with
  its traceback, when it collects them: after the one-line error, burying it."""
  return "exception was never retrieved" not in record.getMessage()


def _quiet_unraisable(unraisable) -> None:
  """After a failed orbax write, tensorstore completes the other writes into asyncio loops
  orbax already closed; the 'Event loop is closed' each raises is noise, not the fault."""
  if not (isinstance(unraisable.exc_value, RuntimeError)
          and str(unraisable.exc_value) == "Event loop is closed"):
    sys.__unraisablehook__(unraisable)


def enable_compilation_cache() -> None:
  """`--compilation_cache_dir` (or its default) on for this process, checked writable."""
  path = _COMPILATION_CACHE_DIR.value
  path = compilation_cache.default_dir() if path is None else path
  if path:
    check_output_dir(path, "--compilation_cache_dir")
  compilation_cache.enable(path)


def run(main: Callable[[list[str]], Any]) -> None:
  """`app.run` with bad flags, `UserInputError`s and I/O failures (a full disk, a
  read-only dir) reported as one line, exit code 2; the process first restarts itself with
  huge-page malloc (`host.reexec_with_huge_pages`), and turns the compilation cache on
  before `main` compiles anything (`enable_compilation_cache`)."""
  host.reexec_with_huge_pages()

  def guarded(argv):
    if len(argv) > 1:
      fail(f"unexpected arguments: {' '.join(argv[1:])}")
    if not flags.FLAGS["verbosity"].present:
      logging.set_verbosity(logging.WARNING)  # jax and orbax log chatty INFO lines
      std_logging.getLogger("absl").addFilter(_drop_orbax_tracebacks)
      std_logging.getLogger("asyncio").addFilter(_drop_unretrieved_write_errors)
      sys.unraisablehook = _quiet_unraisable
      # The same failed save can leave a tensorstore write coroutine never scheduled; its
      # warning prints at interpreter exit, after (and burying) the one-line error.
      warnings.filterwarnings("ignore", r"coroutine '.*' was never awaited", RuntimeWarning)
    try:
      enable_compilation_cache()
      return main(argv)
    except UserInputError as e:
      fail(str(e))
    except OSError as e:
      fail(f"{e.filename}: {e.strerror}" if e.filename and e.strerror else f"I/O error: {e}")

  app.run(guarded, flags_parser=_parse_flags)


def check_output_file(path: str, flag: str) -> None:
  """Fails now, in one line, if `path` could not be written at the end of the job: its
  directory is missing or read-only, or the path is a directory."""
  directory = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(directory):
    raise UserInputError(f"{flag}={path}: directory {directory} does not exist")
  if os.path.isdir(path):
    raise UserInputError(f"{flag}={path}: is a directory")
  if not os.access(directory, os.W_OK | os.X_OK):
    raise UserInputError(f"{flag}={path}: directory {directory} is not writable")


def check_output_dir(path: str, flag: str) -> None:
  """Like `check_output_file` for a directory the job creates (or fills) at its end."""
  if os.path.lexists(path) and not os.path.isdir(path):
    raise UserInputError(f"{flag}={path}: exists and is not a directory")
  existing = os.path.abspath(path)
  while not os.path.lexists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise UserInputError(f"{flag}={path}: {existing} is not a directory")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise UserInputError(f"{flag}={path}: {existing} is not writable")


def write_json_atomic(path: str, payload: Any) -> None:
  """Writes JSON next to `path` and renames it into place: never a half-written file."""
  directory = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(directory):
    raise UserInputError(f"{path}: directory {directory} does not exist")
  with atomic_file(path) as f:
    json.dump(payload, f, indent=1)

"""Shared CLI plumbing: absl flag parsing and user errors as one line with exit code 2."""
from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any, Callable

from absl import app, flags, logging

from tlt_jax.errors import UserInputError

EXIT_USAGE = 2


def fail(message: str) -> None:
  print(f"error: {message}", file=sys.stderr)
  sys.exit(EXIT_USAGE)


def _parse_flags(argv: list[str]) -> list[str]:
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    fail(str(e).replace("\n", " "))


def run(main: Callable[[list[str]], Any]) -> None:
  """`app.run` with bad flags and `UserInputError`s reported as one line, exit code 2."""

  def guarded(argv):
    if len(argv) > 1:
      fail(f"unexpected arguments: {' '.join(argv[1:])}")
    if not flags.FLAGS["verbosity"].present:
      logging.set_verbosity(logging.WARNING)  # jax and orbax log chatty INFO lines
    try:
      return main(argv)
    except UserInputError as e:
      fail(str(e))

  app.run(guarded, flags_parser=_parse_flags)


def write_json_atomic(path: str, payload: Any) -> None:
  """Writes JSON next to `path` and renames it into place: never a half-written file."""
  directory = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(directory):
    raise UserInputError(f"{path}: directory {directory} does not exist")
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
  try:
    with os.fdopen(fd, "w") as f:
      json.dump(payload, f, indent=1)
    os.replace(tmp, path)
  except BaseException:
    os.unlink(tmp)
    raise

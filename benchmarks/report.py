"""Shared output for benchmark scripts: JSON on stdout, optionally also to a file."""
from __future__ import annotations

import json
from typing import Any


def emit(result: Any, output: str | None) -> None:
  text = json.dumps(result, indent=1)
  print(text)
  if output:
    with open(output, "w") as f:
      f.write(text + "\n")

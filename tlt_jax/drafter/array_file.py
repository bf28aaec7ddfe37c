"""Named host arrays in one .npz file, written atomically, read back bit for bit.

Each array is stored as its raw bytes with its dtype name and shape beside it, because
numpy's own format keeps no dtype it does not know (bfloat16 comes back as opaque 2-byte
voids). Nothing is pickled, so a file from elsewhere cannot run code on load.
"""
from __future__ import annotations

import json
import zipfile
from typing import Mapping

import jax.numpy as jnp
import numpy as np

from tlt_jax.errors import UserInputError
from tlt_jax.files import atomic_file

_LAYOUT = "__layout__"  # JSON: name -> [dtype name, shape]


def write_arrays(path: str, arrays: Mapping[str, np.ndarray]) -> None:
  """Writes `arrays` to `path` (a reader sees the old file or the new, never half)."""
  if _LAYOUT in arrays:
    raise ValueError(f"write_arrays: {_LAYOUT!r} is a reserved name")
  layout = {name: [np.dtype(a.dtype).name, list(a.shape)] for name, a in arrays.items()}
  raw = {name: np.ascontiguousarray(a).reshape(-1).view(np.uint8) for name, a in arrays.items()}
  raw[_LAYOUT] = np.frombuffer(json.dumps(layout).encode(), np.uint8)
  with atomic_file(path, "wb") as f:
    np.savez(f, **raw)


def read_arrays(path: str) -> dict[str, np.ndarray]:
  """The arrays `write_arrays` wrote, with their dtypes and shapes; one-line errors."""
  try:
    with np.load(path, allow_pickle=False) as stored:
      layout = json.loads(stored[_LAYOUT].tobytes())
      return {name: stored[name].view(jnp.dtype(dtype)).reshape(shape)
              for name, (dtype, shape) in layout.items()}
  except (OSError, KeyError, ValueError, TypeError, zipfile.BadZipFile) as e:
    raise UserInputError(f"{path}: not a readable array file ({e})") from None

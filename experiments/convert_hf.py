"""Converts a HF Llama/Qwen2/Qwen3 checkpoint dir into a tlt_jax model checkpoint.

  python -m experiments.convert_hf --hf_dir=DIR --out=DIR [--dtype=bfloat16] [--overwrite]

Exit code 2 with one `error: ...` line on stderr for any bad flag or input.
"""
from __future__ import annotations

import os
import sys

import jax.numpy as jnp
from absl import app, flags, logging

from tlt_jax import checkpoint
from tlt_jax.errors import UserInputError
from tlt_jax.models import hf

_HF_DIR = flags.DEFINE_string("hf_dir", None, "HF model dir (config.json + safetensors).")
_OUT = flags.DEFINE_string("out", None, "Output checkpoint dir; must not exist or be empty.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Stored param dtype.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace a non-empty --out dir.")
flags.mark_flags_as_required(["hf_dir", "out"])


def _fail(message: str) -> None:
  print(f"error: {message}", file=sys.stderr)
  sys.exit(2)


def _parse_flags(argv: list[str]) -> list[str]:
  """Like absl's default parser, but exits 2 with one line instead of 1 with usage."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    _fail(str(e).replace("\n", " "))


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    _fail(f"unexpected arguments: {' '.join(argv[1:])}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every step of a save at INFO
  out = _OUT.value
  if os.path.isdir(out) and os.listdir(out) and not _OVERWRITE.value:
    _fail(f"{out}: output directory exists and is not empty (pass --overwrite to replace it)")
  try:
    print(f"loading {_HF_DIR.value}", file=sys.stderr)
    config, params = hf.load_hf_dir(_HF_DIR.value, dtype=jnp.dtype(_DTYPE.value))
    print(f"saving {out}", file=sys.stderr)
    checkpoint.save_model_checkpoint(out, params, config,
                                     checkpoint.find_tokenizer_files(_HF_DIR.value),
                                     overwrite=_OVERWRITE.value)
  except UserInputError as e:
    _fail(str(e))
  print(f"converted {_HF_DIR.value} -> {out}: {config.model_type}, {config.num_layers} layers, "
        f"{config.num_params / 1e6:.1f}M params, {_DTYPE.value}")


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)

"""Converts a HF Llama/Qwen2/Qwen3 checkpoint dir into a tlt_jax model checkpoint.

  python -m experiments.convert_hf --hf_dir=DIR --out=DIR [--dtype=bfloat16] [--overwrite]

Exit code 2 with one `error: ...` line on stderr for any bad flag or input.
"""
from __future__ import annotations

import os
import sys

import jax.numpy as jnp
from absl import flags

from experiments import cli
from tlt_jax.models import checkpoint
from tlt_jax.errors import UserInputError
from tlt_jax.models import hf

_HF_DIR = flags.DEFINE_string("hf_dir", None, "HF model dir (config.json + safetensors).")
_OUT = flags.DEFINE_string("out", None, "Output checkpoint dir; must not exist or be empty.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Stored param dtype.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace a non-empty --out dir.")
flags.mark_flags_as_required(["hf_dir", "out"])


def main(argv: list[str]) -> None:
  del argv
  out = _OUT.value
  if os.path.isdir(out) and os.listdir(out) and not _OVERWRITE.value:
    raise UserInputError(
        f"{out}: output directory exists and is not empty (pass --overwrite to replace it)")
  print(f"loading {_HF_DIR.value}", file=sys.stderr)
  config, params = hf.load_hf_dir(_HF_DIR.value, dtype=jnp.dtype(_DTYPE.value))
  print(f"saving {out}", file=sys.stderr)
  checkpoint.save_model_checkpoint(out, params, config,
                                   checkpoint.find_tokenizer_files(_HF_DIR.value),
                                   overwrite=_OVERWRITE.value)
  print(f"converted {_HF_DIR.value} -> {out}: {config.model_type}, {config.num_layers} layers, "
        f"{config.num_params / 1e6:.1f}M params, {_DTYPE.value}")


if __name__ == "__main__":
  cli.run(main)

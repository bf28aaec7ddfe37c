"""One `--model` string -> config, params and tokenizer, whatever the source format.

A tokenizer is optional only for HF dirs and checkpoints shipped without tokenizer files:
such a model can still be driven with token ids, and `LoadedModel.require_tokenizer`
gives the one-line error where text is needed.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp

from tlt_jax.errors import UserInputError
from tlt_jax.models.bundled import smollm2_gguf_path
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.gguf import load_gguf
from tlt_jax.models.tokenizer import Tokenizer, has_tokenizer_files

BUNDLED_SMOLLM2 = "smollm2"


@dataclasses.dataclass(frozen=True, eq=False)
class LoadedModel:
  config: ModelConfig
  params: dict
  tokenizer: Tokenizer | None
  source: str                       # the spec it was loaded from, for messages

  def require_tokenizer(self) -> Tokenizer:
    if self.tokenizer is None:
      raise UserInputError(
          f"{self.source}: model has no tokenizer files (tokenizer.json); add them or pass token ids")
    return self.tokenizer


def load_model(spec: str, dtype=jnp.float32,
               shardings_fn: Callable[[ModelConfig], Any] | None = None) -> LoadedModel:
  """Load `smollm2` (bundled), a .gguf file, an HF dir or a converted checkpoint dir.

  `shardings_fn(config)` returns a sharding pytree matching the params; they are placed
  with it after loading (the source format is only known once the spec is resolved).
  """
  if spec == BUNDLED_SMOLLM2 or spec.endswith(".gguf"):
    path = smollm2_gguf_path() if spec == BUNDLED_SMOLLM2 else spec
    config, params = load_gguf(path, dtype=dtype)
    tokenizer = Tokenizer.from_gguf(path, extra_eos_ids=config.eos_token_ids)
  else:
    config, params = _load_dir(spec, dtype)
    tokenizer = _dir_tokenizer(spec, config)
  if shardings_fn is not None:
    params = jax.device_put(params, shardings_fn(config))
  return LoadedModel(config=config, params=params, tokenizer=tokenizer, source=spec)


def _load_dir(spec: str, dtype) -> tuple[ModelConfig, dict]:
  if os.path.isdir(spec):
    from tlt_jax.models import checkpoint
    # Checked first: a converted checkpoint may carry a config.json of its own.
    if checkpoint.is_model_checkpoint(spec):
      return checkpoint.load_model_checkpoint(spec, dtype=dtype, shardings=None)
    if os.path.isfile(os.path.join(spec, "config.json")):
      from tlt_jax.models import hf
      return hf.load_hf_dir(spec, dtype=dtype, shardings=None)
  raise UserInputError(
      f"{spec}: unknown model (expected '{BUNDLED_SMOLLM2}', a .gguf file, an HF dir with "
      "config.json + *.safetensors, or a converted checkpoint dir)")


def _dir_tokenizer(model_dir: str, config: ModelConfig) -> Tokenizer | None:
  if not has_tokenizer_files(model_dir):
    return None
  return Tokenizer.from_dir(model_dir, extra_eos_ids=config.eos_token_ids)

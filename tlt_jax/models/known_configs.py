"""A model's config without its weights: what `experiments.plan` sizes a run from.

A run names its model by a path that may not exist where it is planned (a GPU flagfile
read on a laptop). The config then comes, in this order, from the path's own config.json
(an HF dir or converted checkpoint), a GGUF file's metadata (the bundled SmolLM2 too), or
this table of known architectures, looked up by the path's last component. The table holds
the fields of the models the shipped flagfiles name, as their HF config.json files give
them, and is parsed like a config.json (`ModelConfig.from_hf_dict`).
"""
from __future__ import annotations

import os

from tlt_jax.errors import UserInputError
from tlt_jax.models.config import ModelConfig

_QWEN2_5_7B = dict(model_type="qwen2", vocab_size=152064, hidden_size=3584,
                   intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                   num_key_value_heads=4, rms_norm_eps=1e-6, tie_word_embeddings=False,
                   use_sliding_window=False, bos_token_id=151643)

KNOWN_CONFIGS: dict[str, dict] = {
    "Qwen2.5-1.5B-Instruct": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
        num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1e6,
        max_position_embeddings=32768, use_sliding_window=False, bos_token_id=151643,
        eos_token_id=151645),
    "Qwen2.5-7B": dict(_QWEN2_5_7B, rope_theta=1e6, max_position_embeddings=131072,
                       eos_token_id=151643),
    "DeepSeek-R1-Distill-Qwen-7B": dict(_QWEN2_5_7B, rope_theta=1e4,
                                        max_position_embeddings=131072,
                                        eos_token_id=151643),
}


def config_without_weights(model: str) -> tuple[ModelConfig, str]:
  """(config, where it came from) for a --model value, reading no weights."""
  from tlt_jax.models.bundled import smollm2_gguf_path
  from tlt_jax.models.gguf import gguf_config
  from tlt_jax.models.loading import BUNDLED_SMOLLM2

  if model == BUNDLED_SMOLLM2 or (model.endswith(".gguf") and os.path.isfile(model)):
    path = smollm2_gguf_path() if model == BUNDLED_SMOLLM2 else model
    return gguf_config(path), "GGUF metadata"
  if os.path.isfile(os.path.join(model, "config.json")):
    return ModelConfig.from_hf_dir(model), os.path.join(model, "config.json")
  name = os.path.basename(os.path.normpath(model))
  if name in KNOWN_CONFIGS:
    return ModelConfig.from_hf_dict(KNOWN_CONFIGS[name], source=f"known config {name}"), (
        f"known architecture {name} (no config.json at {model})")
  raise UserInputError(f"--model={model}: no config.json there and not a known architecture "
                       f"({', '.join(sorted(KNOWN_CONFIGS))})")

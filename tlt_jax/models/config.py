"""Model configuration: one frozen dataclass for Llama, Qwen2/2.5 and Qwen3 decoders.

It is hashable so jitted functions can take it as a static argument.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from tlt_jax.errors import UserInputError

# HF `model_type` -> architecture family. The families differ only in a few switches.
_FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_ROPE_TYPES = ("default", "llama3", "linear")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  theta: float = 10000.0
  rope_type: str = "default"        # "default" | "llama3" | "linear"
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes and switches of a decoder-only transformer."""
  model_type: str                   # HF model_type, kept for export
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope: RopeConfig = RopeConfig()
  tie_word_embeddings: bool = False
  qkv_bias: bool = False            # Qwen2/2.5
  qk_norm: bool = False             # Qwen3: RMSNorm over head_dim on q and k
  max_position_embeddings: int = 4096
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise UserInputError(
          f"config: num_attention_heads={self.num_heads} is not a multiple of "
          f"num_key_value_heads={self.num_kv_heads}")
    if self.rope.rope_type not in _ROPE_TYPES:
      raise UserInputError(
          f"config: rope_type '{self.rope.rope_type}' is not supported "
          f"(supported: {', '.join(_ROPE_TYPES)})")

  @property
  def family(self) -> str:
    return _FAMILIES[self.model_type]

  @property
  def num_params(self) -> int:
    e, f, v, d = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
    attn = e * d * (self.num_heads * 2 + self.num_kv_heads * 2)
    per_layer = attn + 3 * e * f + 2 * e
    head = 0 if self.tie_word_embeddings else e * v
    return v * e + self.num_layers * per_layer + e + head

  # ---- HF config.json ----------------------------------------------------------------

  @classmethod
  def from_hf_dict(cls, d: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
    model_type = d.get("model_type")
    if model_type not in _FAMILIES:
      raise UserInputError(
          f"{source}: unknown architecture model_type={model_type!r} "
          f"(supported: {', '.join(sorted(_FAMILIES))})")
    _reject_sliding_window(d, source)
    for act_key in ("hidden_act", "hidden_activation"):
      if d.get(act_key, "silu") != "silu":
        raise UserInputError(f"{source}: {act_key}={d[act_key]!r} is not supported (silu only)")
    try:
      num_heads = int(d["num_attention_heads"])
      hidden = int(d["hidden_size"])
      head_dim = d.get("head_dim") or hidden // num_heads
      eos = d.get("eos_token_id")
      eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
      family = _FAMILIES[model_type]
      return cls(
          model_type=model_type,
          vocab_size=int(d["vocab_size"]),
          hidden_size=hidden,
          intermediate_size=int(d["intermediate_size"]),
          num_layers=int(d["num_hidden_layers"]),
          num_heads=num_heads,
          num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
          head_dim=int(head_dim),
          rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
          rope=_rope_from_hf(d, source),
          tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
          qkv_bias=family == "qwen2" or bool(d.get("attention_bias", False)),
          qk_norm=family == "qwen3",
          max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
          bos_token_id=d.get("bos_token_id"),
          eos_token_ids=tuple(int(e) for e in eos_ids),
      )
    except KeyError as e:
      raise UserInputError(f"{source}: missing field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
      if isinstance(e, UserInputError):
        raise
      raise UserInputError(f"{source}: malformed field ({e})") from None

  @classmethod
  def from_hf_dir(cls, hf_dir: str) -> "ModelConfig":
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
      raise UserInputError(f"{path}: missing config.json")
    try:
      with open(path) as f:
        d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
      raise UserInputError(f"{path}: cannot read ({e})") from None
    return cls.from_hf_dict(d, source=path)

  def to_hf_dict(self) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": self.rope.rope_type, "rope_theta": self.rope.theta}
    if self.rope.rope_type != "default":
      rope["factor"] = self.rope.factor
    if self.rope.rope_type == "llama3":
      rope.update(low_freq_factor=self.rope.low_freq_factor,
                  high_freq_factor=self.rope.high_freq_factor,
                  original_max_position_embeddings=self.rope.original_max_position_embeddings)
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    d = {
        "architectures": [arch[self.family]],
        "model_type": self.model_type,
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "rms_norm_eps": self.rms_norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": self.tie_word_embeddings,
        "max_position_embeddings": self.max_position_embeddings,
        "bos_token_id": self.bos_token_id,
        "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1
                        else self.eos_token_ids[0],
        # Both spellings: transformers>=5 reads rope_parameters, older readers the rest.
        "rope_parameters": rope,
        "rope_theta": self.rope.theta,
    }
    if self.rope.rope_type != "default":
      d["rope_scaling"] = rope
    if self.family == "llama":
      d["attention_bias"] = self.qkv_bias
    return d


def _reject_sliding_window(d: Mapping[str, Any], source: str) -> None:
  """Attention here is always full. Qwen configs carry a `sliding_window` size that their
  `use_sliding_window: false` turns off; Mistral-style configs have only the size, which
  limits attention unless it spans every position."""
  if d.get("use_sliding_window"):
    raise UserInputError(f"{source}: use_sliding_window=true is not supported")
  window = d.get("sliding_window")
  if ("use_sliding_window" not in d and window is not None
      and window < d.get("max_position_embeddings", 4096)):
    raise UserInputError(f"{source}: sliding_window={window} is not supported (full "
                         "attention only)")


def _rope_from_hf(d: Mapping[str, Any], source: str) -> RopeConfig:
  # transformers>=5 writes `rope_parameters` (theta inside); older files `rope_theta` plus
  # an optional `rope_scaling`.
  params = dict(d.get("rope_parameters") or {})
  scaling = d.get("rope_scaling") or {}
  merged = {**scaling, **params}
  theta = merged.get("rope_theta", d.get("rope_theta", 10000.0))
  rope_type = merged.get("rope_type", merged.get("type", "default"))
  if rope_type not in _ROPE_TYPES:
    raise UserInputError(
        f"{source}: rope_type '{rope_type}' is not supported (supported: {', '.join(_ROPE_TYPES)})")
  return RopeConfig(
      theta=float(theta),
      rope_type=rope_type,
      factor=float(merged.get("factor", 1.0)),
      low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
      high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
      original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
  )

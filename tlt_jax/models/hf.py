"""Hugging Face safetensors checkpoints <-> the functional param pytree.

Loading checks every tensor's presence, dtype and shape against config.json before any
data is read, so a mismatched checkpoint fails with one line naming the file and tensor
rather than with a shape error deep inside jit.
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.numpy

from tlt_jax.errors import UserInputError
from tlt_jax.files import atomic_dir
from tlt_jax.models.config import ModelConfig

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")

# Param name -> (HF name, transposed). Matrices here are [in, out], nn.Linear's [out, in].
_TOP_NAMES = {
    "embed": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}
_LAYER_NAMES = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}


def param_shapes(config: ModelConfig) -> dict[str, Any]:
  """The param pytree's structure with a shape tuple at each leaf."""
  e, f, v, d = config.hidden_size, config.intermediate_size, config.vocab_size, config.head_dim
  hq, hk, n = config.num_heads * d, config.num_kv_heads * d, config.num_layers
  layer = {"attn_norm": (e,), "wq": (e, hq), "wk": (e, hk), "wv": (e, hk), "wo": (hq, e)}
  if config.qkv_bias:
    layer.update(bq=(hq,), bk=(hk,), bv=(hk,))
  if config.qk_norm:
    layer.update(q_norm=(d,), k_norm=(d,))
  layer.update(mlp_norm=(e,), w_gate=(e, f), w_up=(e, f), w_down=(f, e))
  shapes = {"embed": (v, e), "layers": {k: (n,) + s for k, s in layer.items()},
            "final_norm": (e,)}
  if not config.tie_word_embeddings:
    shapes["lm_head"] = (e, v)
  return shapes


def _hf_tensors(config: ModelConfig) -> Iterator[tuple[tuple, str, tuple[int, ...], bool]]:
  """(param path, HF name, HF shape, transposed) for every HF tensor the config needs."""
  shapes = param_shapes(config)
  for key, (name, transposed) in _TOP_NAMES.items():
    if key in shapes:
      yield (key,), name, _hf_shape(shapes[key], transposed), transposed
  for key, shape in shapes["layers"].items():
    suffix, transposed = _LAYER_NAMES[key]
    hf_shape = _hf_shape(shape[1:], transposed)
    for i in range(config.num_layers):
      yield ("layers", key, i), f"model.layers.{i}.{suffix}", hf_shape, transposed


def _hf_shape(shape: tuple[int, ...], transposed: bool) -> tuple[int, ...]:
  return shape[::-1] if transposed else shape


# ---- loading --------------------------------------------------------------------------

class _SafetensorsReader:
  """Open safetensors files of one checkpoint, addressed by tensor name."""

  def __init__(self, hf_dir: str, stack: contextlib.ExitStack):
    self._files: dict[str, Any] = {}
    self._stack = stack
    single, index = os.path.join(hf_dir, SAFETENSORS), os.path.join(hf_dir, SAFETENSORS_INDEX)
    if os.path.isfile(index):
      self.source = index
      self.location = {name: os.path.join(hf_dir, f) for name, f in _read_index(index).items()}
    elif os.path.isfile(single):
      self.source = single
      self.location = {name: single for name in self._open(single).keys()}
    else:
      raise UserInputError(f"{hf_dir}: no {SAFETENSORS} or {SAFETENSORS_INDEX}")

  def _open(self, path: str):
    if path not in self._files:
      if not os.path.isfile(path):
        raise UserInputError(f"{path}: missing safetensors file (listed in {self.source})")
      try:
        self._files[path] = self._stack.enter_context(safetensors.safe_open(path, "numpy"))
      except (OSError, safetensors.SafetensorError) as e:
        raise UserInputError(f"{path}: not a readable safetensors file ({e})") from None
    return self._files[path]

  def check(self, name: str, shape: tuple[int, ...]) -> None:
    if name not in self.location:
      raise UserInputError(f"{self.source}: missing tensor {name}")
    path = self.location[name]
    handle = self._open(path)
    if name not in handle.keys():
      raise UserInputError(f"{path}: missing tensor {name} (listed in {self.source})")
    info = handle.get_slice(name)
    if tuple(info.get_shape()) != shape:
      raise UserInputError(
          f"{path}: tensor {name} has shape {tuple(info.get_shape())}, config.json implies "
          f"{shape}")
    if info.get_dtype() not in _FLOAT_DTYPES:
      raise UserInputError(f"{path}: tensor {name} has dtype {info.get_dtype()}, expected a "
                           f"float type ({', '.join(_FLOAT_DTYPES)})")

  def read(self, name: str) -> np.ndarray:
    path = self.location[name]
    try:
      return self._open(path).get_tensor(name)
    except (OSError, safetensors.SafetensorError) as e:
      raise UserInputError(f"{path}: cannot read tensor {name} ({e})") from None


def _read_index(path: str) -> dict[str, str]:
  try:
    with open(path) as f:
      weight_map = json.load(f)["weight_map"]
  except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
    raise UserInputError(f"{path}: not a valid safetensors index ({e!r})") from None
  if not isinstance(weight_map, dict):
    raise UserInputError(f"{path}: weight_map is not a mapping")
  return weight_map


def load_hf_dir(hf_dir: str, dtype=jnp.float32, shardings: Any = None
                ) -> tuple[ModelConfig, dict[str, Any]]:
  """Reads a HF Llama/Qwen2/Qwen3 checkpoint dir into (config, params).

  With `shardings` (a pytree of `jax.sharding.Sharding` matching params) each leaf goes
  straight to its sharding once built, so the host holds one stacked leaf at a time and
  no device ever holds the whole model unsharded.
  """
  config = ModelConfig.from_hf_dir(hf_dir)
  shapes = param_shapes(config)
  np_dtype = np.dtype(dtype)
  with contextlib.ExitStack() as stack:
    reader = _SafetensorsReader(hf_dir, stack)
    for _, name, hf_shape, _ in _hf_tensors(config):
      reader.check(name, hf_shape)
    params: dict[str, Any] = {"layers": {}}
    for key in shapes:
      if key != "layers":
        name, transposed = _TOP_NAMES[key]
        leaf = _transpose(reader.read(name), transposed).astype(np_dtype)
        params[key] = _place(leaf, shardings and shardings[key])
    for key, shape in shapes["layers"].items():
      suffix, transposed = _LAYER_NAMES[key]
      leaf = np.empty(shape, np_dtype)
      for i in range(config.num_layers):
        leaf[i] = _transpose(reader.read(f"model.layers.{i}.{suffix}"), transposed)
      params["layers"][key] = _place(leaf, shardings and shardings["layers"][key])
  return config, params


def _transpose(x: np.ndarray, transposed: bool) -> np.ndarray:
  return x.T if transposed else x


def _place(leaf: np.ndarray, sharding: jax.sharding.Sharding | None) -> jax.Array:
  if sharding is None:
    return jnp.asarray(leaf)
  # Each process fills only its addressable shards, so this also works across hosts.
  return jax.make_array_from_callback(leaf.shape, sharding, lambda index: leaf[index])


# ---- saving ---------------------------------------------------------------------------

def save_hf_dir(params: dict[str, Any], config: ModelConfig, out_dir: str,
                overwrite: bool = False, tokenizer: Any = None) -> None:
  """Writes config.json + model.safetensors that transformers loads as-is, plus the
  tokenizer's files when one is given (`Tokenizer.save`), all or nothing."""
  host = jax.device_get(params)
  got = jax.tree.map(lambda x: x.shape, host)
  if got != param_shapes(config):
    raise ValueError(f"params do not match config: {got} vs {param_shapes(config)}")
  tensors = {}
  for path, name, _, transposed in _hf_tensors(config):
    leaf = host[path[0]] if len(path) == 1 else host["layers"][path[1]][path[2]]
    tensors[name] = np.ascontiguousarray(_transpose(leaf, transposed))
  with atomic_dir(out_dir, overwrite) as tmp:
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(config.to_hf_dict(), f, indent=2)
    safetensors.numpy.save_file(tensors, os.path.join(tmp, SAFETENSORS),
                                metadata={"format": "pt"})
    if tokenizer is not None:
      tokenizer.save(tmp)

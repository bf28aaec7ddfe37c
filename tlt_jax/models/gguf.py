"""Load a llama.cpp GGUF file into the HF-layout param pytree.

Quantized tensors are dequantized with the `gguf` package's own reference code, so the
result is exactly what llama.cpp computes with. llama.cpp's converter permutes q/k rows
for its interleaved rotary; our transformer uses HF's rotate_half, so that is undone here.
"""
from __future__ import annotations

import functools
import os

import gguf
import jax.numpy as jnp
import numpy as np

from tlt_jax.errors import UserInputError
from tlt_jax.models.config import ModelConfig, RopeConfig

_SUPPORTED_ARCHITECTURES = ("llama",)
# Turn-end markers of ChatML and Llama 3 chat templates. GGUF files often name only the
# pretraining EOS, and a chat model that is not stopped at its turn end rambles on.
CHAT_END_TOKENS = ("<|im_end|>", "<|eot_id|>")

# blk.N.<name> -> (our layer key, is a linear weight stored [out, in]).
_LAYER_TENSORS = {
    "attn_norm.weight": ("attn_norm", False),
    "attn_q.weight": ("wq", True),
    "attn_k.weight": ("wk", True),
    "attn_v.weight": ("wv", True),
    "attn_output.weight": ("wo", True),
    "ffn_norm.weight": ("mlp_norm", False),
    "ffn_gate.weight": ("w_gate", True),
    "ffn_up.weight": ("w_up", True),
    "ffn_down.weight": ("w_down", True),
}


def open_gguf(path: str) -> gguf.GGUFReader:
  """A reader over `path` (memory-mapped, nothing dequantized yet), or a one-line error.

  Parsing the metadata takes seconds (a vocab and its merges are ~100k strings, read one
  by one) and a run asks for it several times (the memory plan, the weights, the
  tokenizer), so a file is parsed once per process while it stays unchanged."""
  if not os.path.isfile(path):
    raise UserInputError(f"{path}: no such GGUF file")
  stat = os.stat(path)
  return _parsed(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _parsed(path: str, size: int, mtime_ns: int) -> gguf.GGUFReader:
  del size, mtime_ns  # the cache key: a rewritten file is parsed again
  try:
    return _Reader(path)
  except (ValueError, IndexError, OSError) as e:
    raise UserInputError(f"{path}: not a readable GGUF file ({e})") from None


class _Reader(gguf.GGUFReader):
  """gguf's reader, slicing a plain ndarray view of its memmap while it parses: a np.memmap
  slice costs microseconds of subclass bookkeeping, and a vocab's metadata is ~10^6 slices
  (docs/architecture.md, "Tokenizer cache"). The same bytes, the same parts."""

  def _get(self, offset, dtype, count=1, override_order=None):
    plain = self.__dict__.get("_plain")
    if plain is None:
      plain = self._plain = self.data.view(np.ndarray)
    count = int(count)
    array = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype)[:count]
    order = self.byte_order if override_order is None else override_order
    return array.view(array.dtype.newbyteorder(order))


def _meta(reader: gguf.GGUFReader, key: str, default=None):
  """A metadata value as a Python scalar, string or list."""
  f = reader.get_field(key)
  return default if f is None else f.contents()


def load_gguf(path: str, dtype=jnp.float32) -> tuple[ModelConfig, dict]:
  """(config, params) of a GGUF model; params follow the layout in transformer.py."""
  reader = open_gguf(path)
  config = _config_from_metadata(reader, path)
  tensors = {t.name: t for t in reader.tensors}

  def take(name: str, shape: tuple[int, ...]) -> np.ndarray:
    tensor = tensors.pop(name, None)
    if tensor is None:
      raise UserInputError(f"{path}: missing tensor {name!r}")
    # ggml lists dimensions fastest-first; the reader's numpy arrays are already
    # slowest-first, i.e. [out, in] for linear weights, like torch.
    array = gguf.dequantize(tensor.data, tensor.tensor_type)
    if array.shape != shape:
      raise UserInputError(f"{path}: tensor {name!r} has shape {array.shape}, expected {shape}")
    return array

  e, f, d = config.hidden_size, config.intermediate_size, config.head_dim
  hq, hk = config.num_heads * d, config.num_kv_heads * d
  out_in = {"wq": (hq, e), "wk": (hk, e), "wv": (hk, e), "wo": (e, hq),
            "w_gate": (f, e), "w_up": (f, e), "w_down": (e, f)}
  per_layer: dict[str, list[np.ndarray]] = {key: [] for key, _ in _LAYER_TENSORS.values()}
  for i in range(config.num_layers):
    for suffix, (key, linear) in _LAYER_TENSORS.items():
      array = take(f"blk.{i}.{suffix}", out_in[key] if linear else (e,))
      if key == "wq":
        array = _unpermute_rotary_rows(array, config.num_heads)
      elif key == "wk":
        array = _unpermute_rotary_rows(array, config.num_kv_heads)
      per_layer[key].append(array.T if linear else array)

  as_jax = lambda a: jnp.asarray(a, dtype=dtype)
  params = {
      "embed": as_jax(take("token_embd.weight", (config.vocab_size, e))),
      "layers": {key: as_jax(np.stack(arrays)) for key, arrays in per_layer.items()},
      "final_norm": as_jax(take("output_norm.weight", (e,))),
  }
  if not config.tie_word_embeddings:
    params["lm_head"] = as_jax(take("output.weight", (config.vocab_size, e)).T)
  if tensors:
    raise UserInputError(
        f"{path}: unsupported tensors for a plain llama model: {', '.join(sorted(tensors)[:5])}")
  return config, params


def gguf_config(path: str) -> ModelConfig:
  """The model config a GGUF file's metadata describes, without reading its tensors."""
  return _config_from_metadata(open_gguf(path), path)


def _unpermute_rotary_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Inverse of convert_hf_to_gguf's `permute`: per head, rows (pairs, 2) -> (2, pairs)."""
  rows = w.shape[0]
  return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _config_from_metadata(reader: gguf.GGUFReader, path: str) -> ModelConfig:
  arch = _meta(reader, "general.architecture")
  if arch not in _SUPPORTED_ARCHITECTURES:
    raise UserInputError(
        f"{path}: GGUF architecture {arch!r} is not supported "
        f"(supported: {', '.join(_SUPPORTED_ARCHITECTURES)})")

  def required(key: str):
    value = _meta(reader, f"{arch}.{key}")
    if value is None:
      raise UserInputError(f"{path}: missing GGUF metadata {arch}.{key}")
    return value

  hidden, num_heads = int(required("embedding_length")), int(required("attention.head_count"))
  head_dim = int(_meta(reader, f"{arch}.attention.key_length", hidden // num_heads))
  if int(_meta(reader, f"{arch}.rope.dimension_count", head_dim)) != head_dim:
    raise UserInputError(f"{path}: partial rotary ({arch}.rope.dimension_count) is not supported")
  # Llama 3.1 frequency scaling comes as a rope_freqs tensor, rejected with the other
  # unexpected tensors in load_gguf.
  scaling = _meta(reader, f"{arch}.rope.scaling.type", "none")
  if scaling not in ("none", "linear"):
    raise UserInputError(f"{path}: rope scaling {scaling!r} is not supported")
  rope = RopeConfig(theta=float(_meta(reader, f"{arch}.rope.freq_base", 10000.0)),
                    rope_type="default" if scaling == "none" else "linear",
                    factor=float(_meta(reader, f"{arch}.rope.scaling.factor", 1.0)))

  tokens = _meta(reader, "tokenizer.ggml.tokens") or []
  vocab_size = len(tokens) or int(required("vocab_size"))
  eos_ids = [_meta(reader, f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
  eos_ids += [tokens.index(t) for t in CHAT_END_TOKENS if t in tokens]
  return ModelConfig(
      model_type=arch,
      vocab_size=vocab_size,
      hidden_size=hidden,
      intermediate_size=int(required("feed_forward_length")),
      num_layers=int(required("block_count")),
      num_heads=num_heads,
      num_kv_heads=int(_meta(reader, f"{arch}.attention.head_count_kv", num_heads)),
      head_dim=head_dim,
      rms_norm_eps=float(required("attention.layer_norm_rms_epsilon")),
      rope=rope,
      tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
      max_position_embeddings=int(_meta(reader, f"{arch}.context_length", 4096)),
      bos_token_id=_meta(reader, "tokenizer.ggml.bos_token_id"),
      eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
  )

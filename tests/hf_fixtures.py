"""Tiny random HF checkpoints built offline with transformers + CPU torch.

Each kind exercises one architecture switch (GQA + llama3 rope, tied embeddings, qkv
bias, qk-norm). Norm weights and biases are drawn away from 1 and 0 so a loader that
drops or misplaces them changes the model's outputs.
"""
from __future__ import annotations

import os

TINY_KINDS = ("llama", "llama_tied", "qwen2", "qwen3")

_SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
              rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}

# Character-level vocabulary: specials, newline, printable ASCII. Fits in vocab_size.
_SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _hf_model(kind: str):
  import transformers
  if kind in ("llama", "llama_tied"):
    config = transformers.LlamaConfig(num_hidden_layers=3, rope_parameters=_LLAMA3_ROPE,
                                      tie_word_embeddings=kind == "llama_tied", **_SIZES)
    return transformers.LlamaForCausalLM(config)
  if kind == "qwen2":
    config = transformers.Qwen2Config(num_hidden_layers=2, tie_word_embeddings=False,
                                      **_SIZES)
    return transformers.Qwen2ForCausalLM(config)
  if kind == "qwen3":
    config = transformers.Qwen3Config(num_hidden_layers=2, tie_word_embeddings=False,
                                      **_SIZES)
    return transformers.Qwen3ForCausalLM(config)
  raise ValueError(f"unknown tiny kind {kind!r} (known: {', '.join(TINY_KINDS)})")


def _randomize(model, seed: int) -> None:
  """Redraws every weight: matrices at 1/sqrt(fan_in), norms near 1, biases near 0."""
  import torch
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
      if "norm" in name:
        p.copy_(1.0 + 0.2 * noise)
      elif name.endswith(".bias"):
        p.copy_(0.2 * noise)
      elif "embed_tokens" in name:
        p.copy_(noise)
      else:
        p.copy_(noise * p.shape[-1] ** -0.5)


def _save_tokenizer(out_dir: str) -> None:
  import tokenizers
  import transformers
  chars = ["\n"] + [chr(c) for c in range(32, 127)]
  vocab = {tok: i for i, tok in enumerate(_SPECIALS + tuple(chars))}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(
      tokenizers.Regex(r"[\s\S]"), behavior="isolated")
  tok.decoder = tokenizers.decoders.Fuse()
  fast = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
      unk_token="<unk>")
  fast.chat_template = _CHAT_TEMPLATE
  fast.save_pretrained(out_dir)


def make_tiny_hf_checkpoint(kind: str, out_dir: str, seed: int = 0, shard: bool = False) -> str:
  """Saves a deterministic random tiny `kind` checkpoint plus a char-level tokenizer.

  `shard=True` splits the weights over several files with a model.safetensors.index.json.
  """
  import torch
  torch.manual_seed(seed)
  model = _hf_model(kind)
  _randomize(model, seed)
  os.makedirs(out_dir, exist_ok=True)
  model.save_pretrained(out_dir, max_shard_size="64KB" if shard else "1GB")
  _save_tokenizer(out_dir)
  return out_dir

"""SmolLM2-135M-Instruct from its GGUF: params and tokenizer match transformers' reading.

transformers dequantizes with the same `gguf` code and undoes the q/k permutation itself,
so equal tensors prove our dequantization, permutation and [in, out] layout without
running a forward pass. `load_model` is covered here for every kind of spec.
"""
import json
import os
import shutil

import gguf
import jax
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from tlt_jax.errors import UserInputError
from tlt_jax.models.bundled import smollm2_gguf_path
from tlt_jax.models.gguf import _unpermute_rotary_rows, load_gguf
from tlt_jax.models.loading import load_model
from tlt_jax.models import tokenizer as tokenizer_lib
from tlt_jax.models.tokenizer import Tokenizer

TEXTS = [
    "Hello world!",
    "What is 12345 + 678? The answer is 13023.",
    "naïve café, 日本語, emoji 🤖 and math ∑ x² ≤ π",
    "  leading spaces\n\n\ttabs and trailing  ",
    "spaces before punctuation , . ! ? 's n't survive decode",
    "<|im_start|>user\nhi<|im_end|>\n",
]
MESSAGES = [{"role": "user", "content": "Natalia sold 48 clips. How many? Answer: 72."}]


@pytest.fixture(scope="module")
def gguf_path():
  return smollm2_gguf_path()


@pytest.fixture(scope="module")
def ours(gguf_path):
  return load_gguf(gguf_path)


@pytest.fixture(scope="module")
def hf_tensors(gguf_path):
  # from_pretrained(gguf_file=...) needs `accelerate`; this is the function it uses to
  # dequantize and un-permute, given a (weightless) model for the name mapping.
  d, name = os.path.split(gguf_path)
  with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d, gguf_file=name))
  return load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=model)["tensors"]


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path):
  d, name = os.path.split(gguf_path)
  return AutoTokenizer.from_pretrained(d, gguf_file=name, local_files_only=True)


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
  return Tokenizer.from_gguf(gguf_path)


def test_config_from_metadata(ours):
  config, _ = ours
  assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
  assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
  assert config.vocab_size == 49152 and config.tie_word_embeddings
  assert config.rope.theta == 100000.0 and config.max_position_embeddings == 8192
  assert config.bos_token_id == 1 and 2 in config.eos_token_ids  # <|im_end|>


def test_params_equal_transformers(ours, hf_tensors):
  config, params = ours
  hf_to_ours = {"self_attn.q_proj": "wq", "self_attn.k_proj": "wk", "self_attn.v_proj": "wv",
                "self_attn.o_proj": "wo", "mlp.gate_proj": "w_gate", "mlp.up_proj": "w_up",
                "mlp.down_proj": "w_down", "input_layernorm": "attn_norm",
                "post_attention_layernorm": "mlp_norm"}
  expected = {"embed": hf_tensors["model.embed_tokens.weight"],
              "final_norm": hf_tensors["model.norm.weight"]}
  for i in range(config.num_layers):
    for hf_name, key in hf_to_ours.items():
      w = hf_tensors[f"model.layers.{i}.{hf_name}.weight"]
      expected[(key, i)] = w.T if w.ndim == 2 else w   # torch Linear is [out, in]
  assert len(expected) == len(hf_tensors)  # tied: transformers has no lm_head tensor either
  assert "lm_head" not in params
  for where, want in expected.items():
    got = params[where] if isinstance(where, str) else params["layers"][where[0]][where[1]]
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=0, atol=1e-6, err_msg=str(where))


def test_unpermute_inverts_llama_cpp_permute():
  def llama_cpp_permute(w, n_head):  # convert_hf_to_gguf.LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)
  w = np.random.default_rng(0).normal(size=(3 * 8, 5))
  np.testing.assert_array_equal(_unpermute_rotary_rows(llama_cpp_permute(w, 3), 3), w)


def test_tokenizer_matches_transformers(tokenizer, hf_tokenizer):
  for text in TEXTS:
    ids = tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text), text
    assert tokenizer.decode(ids) == text
  hf_chat = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                             return_dict=True)["input_ids"]
  assert tokenizer.apply_chat_template(MESSAGES) == hf_chat
  assert tokenizer.encode("12345") == [33, 34, 35, 36, 37]  # SmolLM2 splits digits
  assert tokenizer.vocab_size == 49152
  assert tokenizer.encode("<|im_end|>") == [2] and 2 in tokenizer.eos_token_ids
  assert (tokenizer.bos_token_id, tokenizer.pad_token_id) == (1, 2)


def test_tokenizer_save_round_trip(tokenizer, tmp_path):
  tokenizer.save(str(tmp_path))
  with open(tmp_path / "tokenizer_config.json") as f:
    assert "<|im_start|>" in json.load(f)["chat_template"]
  reloaded = Tokenizer.from_dir(str(tmp_path))
  for text in TEXTS:
    assert reloaded.encode(text) == tokenizer.encode(text)
  assert reloaded.apply_chat_template(MESSAGES) == tokenizer.apply_chat_template(MESSAGES)
  assert reloaded.eos_token_ids == tokenizer.eos_token_ids


def test_tokenizer_cache(gguf_path, hf_tokenizer, tmp_path, monkeypatch):
  """The first rebuild from GGUF is saved, keyed by content (another path to the same file
  reuses it); the tokenizer read back equals transformers' rebuild; a cache that cannot be
  written warns and still returns the tokenizer."""
  monkeypatch.setenv(tokenizer_lib.CACHE_ENV, str(tmp_path / "cache"))
  first = Tokenizer.from_gguf(gguf_path)
  entries = os.listdir(tmp_path / "cache")
  assert len(entries) == 1 and first._hf.name_or_path != str(tmp_path / "cache" / entries[0])
  os.symlink(gguf_path, tmp_path / "same.gguf")
  cached = Tokenizer.from_gguf(str(tmp_path / "same.gguf"))
  assert cached._hf.name_or_path == str(tmp_path / "cache" / entries[0])
  assert os.listdir(tmp_path / "cache") == entries
  for text in TEXTS:
    assert cached.encode(text) == hf_tokenizer.encode(text), text
    assert cached.decode(cached.encode(text)) == text
  hf_chat = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                             return_dict=True)["input_ids"]
  assert cached.apply_chat_template(MESSAGES) == hf_chat
  assert (cached.eos_token_ids, cached.bos_token_id, cached.pad_token_id, cached.vocab_size) \
      == (first.eos_token_ids, first.bos_token_id, first.pad_token_id, first.vocab_size)

  (tmp_path / "a_file").write_text("")
  monkeypatch.setenv(tokenizer_lib.CACHE_ENV, str(tmp_path / "a_file"))
  with pytest.warns(UserWarning, match="tokenizer not cached"):
    assert Tokenizer.from_gguf(gguf_path).encode(TEXTS[1]) == first.encode(TEXTS[1])


def test_load_model_smollm2_chat_prompt():
  loaded = load_model("smollm2")
  assert loaded.config.num_layers == 30 and loaded.params["embed"].shape == (49152, 576)
  tok = loaded.require_tokenizer()
  question = "What is 2 + 3?"
  text = tok.render_chat([{"role": "user", "content": question}])
  assert text.endswith(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
  ids = tok.chat_prompt(question)
  assert ids == tok.encode(text)
  assert ids[-4:] == tok.encode("<|im_start|>assistant\n")


def test_errors_name_the_input(tmp_path):
  missing = str(tmp_path / "nope.gguf")
  with pytest.raises(UserInputError, match="nope.gguf"):
    load_gguf(missing)
  junk = tmp_path / "junk.gguf"
  junk.write_bytes(b"not a gguf at all")
  with pytest.raises(UserInputError, match="junk.gguf.*not a readable GGUF"):
    load_gguf(str(junk))
  other = str(tmp_path / "other.gguf")
  writer = gguf.GGUFWriter(other, "qwen2")
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(UserInputError, match="other.gguf.*'qwen2'"):
    load_gguf(other)
  with pytest.raises(UserInputError, match="no-such-model"):
    load_model("no-such-model")


def test_load_model_hf_dir_and_checkpoint(tiny_hf_dirs, tmp_path):
  from tlt_jax.models.checkpoint import find_tokenizer_files, save_model_checkpoint
  hf_dir = tiny_hf_dirs["llama"]
  from_hf = load_model(hf_dir)
  assert from_hf.tokenizer is not None and from_hf.tokenizer.decode(
      from_hf.tokenizer.encode("abc")) == "abc"
  assert 2 in from_hf.tokenizer.eos_token_ids

  ckpt = str(tmp_path / "ckpt")
  save_model_checkpoint(ckpt, from_hf.params, from_hf.config, find_tokenizer_files(hf_dir))
  replicated = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  from_ckpt = load_model(ckpt, shardings_fn=lambda config: jax.tree.map(
      lambda _: replicated, from_hf.params))
  assert from_ckpt.config == from_hf.config
  jax.tree.map(np.testing.assert_array_equal, from_ckpt.params, from_hf.params)
  assert from_ckpt.tokenizer.encode("a b\n") == from_hf.tokenizer.encode("a b\n")

  bare = tmp_path / "bare"
  bare.mkdir()
  for name in os.listdir(hf_dir):
    if name == "config.json" or name.endswith(".safetensors"):
      shutil.copy(os.path.join(hf_dir, name), bare)
  no_tokenizer = load_model(str(bare))
  assert no_tokenizer.tokenizer is None
  with pytest.raises(UserInputError, match="bare.*no tokenizer"):
    no_tokenizer.require_tokenizer()

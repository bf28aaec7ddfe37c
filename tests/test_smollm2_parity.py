"""SmolLM2-135M-Instruct end to end: our JAX model against HF LlamaForCausalLM.

The HF side holds the GGUF weights as transformers dequantizes them (no `accelerate`:
load_gguf_checkpoint on a meta skeleton, then load_state_dict into a real CPU model), so
both sides run the same float32 weights and must agree on logits and greedy tokens.
"""
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from tlt_jax.models import transformer
from tlt_jax.models.bundled import smollm2_gguf_path
from tlt_jax.models.kv_cache import init_cache
from tlt_jax.models.loading import load_model
from tlt_jax.rollout.engine import generate
from tlt_jax.rollout.sampling import SamplingParams

QUESTION = "What is the capital of France?"
MAX_NEW = 32


@pytest.fixture(scope="module")
def ours():
  return load_model("smollm2")


@pytest.fixture(scope="module")
def hf_model():
  path = smollm2_gguf_path()
  d, name = os.path.split(path)
  config = transformers.AutoConfig.from_pretrained(d, gguf_file=name)
  assert isinstance(config, transformers.LlamaConfig) and config.tie_word_embeddings
  with torch.device("meta"):
    skeleton = transformers.AutoModelForCausalLM.from_config(config)
  tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)["tensors"]
  model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
  result = model.load_state_dict(tensors, strict=False)
  assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}
  embed = model.model.embed_tokens.weight
  if model.lm_head.weight.data_ptr() != embed.data_ptr():
    model.lm_head.weight = embed
  assert torch.equal(model.lm_head.weight, tensors["model.embed_tokens.weight"])
  return model


def test_padded_batch_last_logits_match_hf(ours, hf_model):
  tok = ours.tokenizer
  prompts = [tok.encode("The quick brown fox jumps over the lazy dog, and then"),
             tok.chat_prompt("Name three primary colors."),
             tok.encode("1, 2, 3,")]
  lengths = [len(p) for p in prompts]
  assert len(set(lengths)) == 3
  b, t = len(prompts), max(lengths)
  tokens = np.full((b, t), tok.pad_token_id, np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  hidden, _ = transformer.forward(ours.params, ours.config, jnp.asarray(tokens), positions,
                                  init_cache(ours.config, b, t))
  logits = np.asarray(transformer.lm_logits(ours.params, ours.config, hidden))
  got = logits[np.arange(b), np.array(lengths) - 1]
  with torch.no_grad():
    want = np.stack([hf_model(torch.tensor([p])).logits[0, -1].numpy() for p in prompts])
  diff = np.abs(got - want).max()
  print(f"max |logits diff| = {diff:.3g}")
  assert diff <= 1e-3
  assert (got.argmax(-1) == want.argmax(-1)).all()


def test_greedy_chat_answer_matches_hf(ours, hf_model):
  tok = ours.tokenizer
  prompts = [tok.chat_prompt(QUESTION), tok.chat_prompt("Write a short poem about the sea.")]
  eos = tok.eos_token_ids
  result = generate(ours.params, ours.config, prompts, max_new_tokens=MAX_NEW,
                    sampling=SamplingParams(temperature=0.0), eos_ids=eos)
  for prompt, out in zip(prompts, result.outputs):
    with torch.no_grad():
      ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                              eos_token_id=list(eos), pad_token_id=tok.pad_token_id)
    ref = ref[0, len(prompt):].tolist()
    assert out.token_ids == ref
    assert tok.decode(out.token_ids) == tok.decode(ref)
    assert out.finish_reason == ("eos" if ref[-1] in eos else "length")
  answer, poem = result.outputs
  assert answer.finish_reason == "eos" and "Paris" in tok.decode(answer.token_ids)
  assert poem.finish_reason == "length" and len(poem.token_ids) == MAX_NEW

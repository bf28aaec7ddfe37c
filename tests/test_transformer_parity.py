"""The JAX transformer against HF transformers (CPU torch), and its cache/verify modes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.hf_fixtures import TINY_KINDS
from tlt_jax.models import transformer
from tlt_jax.models.hf import load_hf_dir
from tlt_jax.models.kv_cache import init_cache
from tlt_jax.rollout.engine import generate
from tlt_jax.rollout.sampling import SamplingParams

PROMPT_LENGTHS = (11, 7, 3, 9)


def _hf_model(hf_dir):
  import torch
  import transformers
  return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def _prompts(vocab_size, seed=0):
  rng = np.random.RandomState(seed)
  return [rng.randint(3, vocab_size, n).tolist() for n in PROMPT_LENGTHS]


def _prefill_logits(params, config, prompts):
  """Last-position logits for a right-padded batch."""
  b, t = len(prompts), max(map(len, prompts))
  tokens = np.zeros((b, t), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  hidden, _ = transformer.forward(params, config, jnp.asarray(tokens), positions,
                                  init_cache(config, b, 32))
  last = np.array([len(p) - 1 for p in prompts])
  return np.asarray(transformer.lm_logits(params, config, hidden))[np.arange(b), last]


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_padded_batch_logits_match_hf(tiny_hf_dirs, kind):
  import torch
  config, params = load_hf_dir(tiny_hf_dirs[kind])
  model = _hf_model(tiny_hf_dirs[kind])
  prompts = _prompts(config.vocab_size)
  ours = _prefill_logits(params, config, prompts)
  for i, prompt in enumerate(prompts):
    with torch.no_grad():
      ref = model(torch.tensor([prompt])).logits[0, -1].numpy()
    np.testing.assert_allclose(ours[i], ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_greedy_generation_matches_hf(tiny_hf_dirs, kind):
  import torch
  config, params = load_hf_dir(tiny_hf_dirs[kind])
  model = _hf_model(tiny_hf_dirs[kind])
  prompts = _prompts(config.vocab_size, seed=1)
  result = generate(params, config, prompts, max_new_tokens=32,
                    sampling=SamplingParams(temperature=0.0), eos_ids=config.eos_token_ids)
  for prompt, out in zip(prompts, result.outputs):
    with torch.no_grad():
      ref = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                           pad_token_id=0)[0, len(prompt):].tolist()
    assert out.token_ids == ref
    assert out.finish_reason == ("eos" if ref[-1] in config.eos_token_ids else "length")


def test_greedy_logprobs_are_the_model_log_softmax(tiny_hf_dirs):
  config, params = load_hf_dir(tiny_hf_dirs["qwen3"])
  prompt = _prompts(config.vocab_size)[0]
  out = generate(params, config, [prompt], max_new_tokens=8,
                 sampling=SamplingParams(temperature=0.0)).outputs[0]
  full = prompt + out.token_ids
  logits = _prefill_logits(params, config, [full[:len(prompt) + i] for i in range(8)])
  expected = jax.nn.log_softmax(logits, axis=-1)[np.arange(8), out.token_ids]
  np.testing.assert_allclose(out.logprobs, expected, atol=1e-4)


def _random_model(kind="qwen3"):
  from tlt_jax.models.config import ModelConfig
  config = ModelConfig(model_type=kind, vocab_size=97, hidden_size=32, intermediate_size=64,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                       qk_norm=kind == "qwen3", qkv_bias=kind == "qwen2")
  return config, transformer.init_params(config, jax.random.key(3))


def test_rows_advance_independently():
  """Rows committing different token counts still see exactly their own prefix."""
  config, params = _random_model()
  rng = np.random.RandomState(0)
  seqs = [rng.randint(0, config.vocab_size, n).tolist() for n in (9, 5)]
  cache = init_cache(config, 2, 16)
  # Step 1: feed 4 tokens to each row, but commit 4 for row 0 and only 2 for row 1.
  chunk = jnp.asarray([seqs[0][:4], seqs[1][:4]])
  _, cache = transformer.forward(params, config, chunk, jnp.broadcast_to(jnp.arange(4), (2, 4)),
                                 cache)
  cache = cache.advance(jnp.array([4, 2]))
  # Step 2: each row continues from its own committed length.
  nxt = jnp.asarray([seqs[0][4:5], seqs[1][2:3]])
  hidden, _ = transformer.forward(params, config, nxt, cache.lengths[:, None], cache)
  got = transformer.lm_logits(params, config, hidden[:, 0])
  want = _prefill_logits(params, config, [seqs[0][:5], seqs[1][:3]])
  np.testing.assert_allclose(got, want, atol=1e-5)


def test_tree_verify_matches_each_branch():
  """A token tree verified in one pass gives each node the logits of its own path."""
  config, params = _random_model("qwen2")
  prefix = [5, 17, 42, 8]
  # Tree over the prefix: node0 -> {node1 -> node3, node2}; parents index earlier nodes.
  tree_tokens, parents = [11, 23, 31, 47], [-1, 0, 0, 1]
  depth = [0, 1, 1, 2]
  mask = np.zeros((4, 4), bool)
  for i in range(4):
    j = i
    while j >= 0:
      mask[i, j] = True
      j = parents[j]
  cache = init_cache(config, 1, 16)
  _, cache = transformer.forward(params, config, jnp.asarray([prefix]),
                                 jnp.arange(4)[None], cache)
  cache = cache.advance(jnp.array([4]))
  hidden, _ = transformer.forward(params, config, jnp.asarray([tree_tokens]),
                                  jnp.asarray([[4 + d for d in depth]]), cache,
                                  jnp.asarray(mask[None]))
  got = np.asarray(transformer.lm_logits(params, config, hidden[0]))
  paths = []
  for i in range(4):
    path, j = [], i
    while j >= 0:
      path.insert(0, tree_tokens[j])
      j = parents[j]
    paths.append(prefix + path)
  np.testing.assert_allclose(got, _prefill_logits(params, config, paths), atol=1e-5)

"""The rollout's per-layer layout (each layer's weights and cache in buffers of their own)
computes what the stacked layout computes, and its decode program reads those buffers in
place: no per-step copy of a layer's weights or cache (checked in the compiled HLO)."""
import re

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.models import transformer
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.kv_cache import init_cache
from tlt_jax.rollout import decode
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.weights import rollout_layout

CONFIG = ModelConfig(model_type="qwen3", vocab_size=67, hidden_size=48, intermediate_size=80,
                     num_layers=3, num_heads=4, num_kv_heads=2, head_dim=12, qk_norm=True,
                     max_position_embeddings=128)
BATCH, CACHE_LEN = 3, 40


def _prefill_then_step(params, cache):
  prompt = jnp.asarray(np.random.RandomState(0).randint(0, CONFIG.vocab_size, (BATCH, 7)))
  positions = jnp.broadcast_to(jnp.arange(7), (BATCH, 7))
  hidden, cache = transformer.forward(params, CONFIG, prompt, positions, cache)
  cache = cache.advance(jnp.full((BATCH,), 7))
  step_hidden, cache = transformer.forward(params, CONFIG, prompt[:, -1:], cache.lengths[:, None],
                                           cache)
  return hidden, step_hidden, cache


def test_per_layer_layout_matches_stacked():
  params = transformer.init_params(CONFIG, jax.random.key(0))
  split = rollout_layout(params)
  assert isinstance(split["layers"], tuple) and len(split["layers"]) == CONFIG.num_layers
  assert rollout_layout(split) is split
  want = _prefill_then_step(params, init_cache(CONFIG, BATCH, CACHE_LEN))
  got = _prefill_then_step(split, init_cache(CONFIG, BATCH, CACHE_LEN, per_layer=True))
  np.testing.assert_allclose(got[0], want[0], atol=1e-5)
  np.testing.assert_allclose(got[1], want[1], atol=1e-5)
  for layer in range(CONFIG.num_layers):
    np.testing.assert_allclose(got[2].k[layer][0], want[2].k[layer], atol=1e-5)
    np.testing.assert_allclose(got[2].v[layer][0], want[2].v[layer], atol=1e-5)


def test_decode_program_reads_layer_buffers_in_place():
  params = rollout_layout(transformer.init_params(CONFIG, jax.random.key(0)))
  state = decode.empty_state(init_cache(CONFIG, BATCH, CACHE_LEN, per_layer=True),
                             jnp.full((BATCH,), 9), jnp.ones((BATCH,), bool), jax.random.key(1),
                             max_new_tokens=9, keep_hidden=False,
                             hidden_size=CONFIG.hidden_size)
  hlo = decode.decode_chunk.lower(
      params, state, config=CONFIG, sampling=SamplingParams(temperature=1.0), eos_ids=(),
      max_new_tokens=9, chunk_steps=4).compile().as_text()
  cache_shape = f"f32[1,{BATCH},{CONFIG.num_kv_heads},{CACHE_LEN},{CONFIG.head_dim}]"
  copies = [line for line in hlo.splitlines()
            if re.search(r"= \S+ copy\(", line) and cache_shape in line.split("copy(")[0]]
  assert not copies, f"cache buffers copied per step:\n" + "\n".join(copies)
  slices = [line for line in hlo.splitlines() if re.search(r"= \S+ dynamic-slice\(", line)
            and f"f32[1,{CONFIG.hidden_size}," in line.split("dynamic-slice(")[0]]
  assert not slices, "layer weights sliced out of a stack:\n" + "\n".join(slices)

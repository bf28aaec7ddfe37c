"""Long prompts cost memory linear in their length: the prefill runs them in passes of
`decode.PREFILL_CHUNK` positions, each against the slots the passes before it wrote, and
leaves what one pass left."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.models import transformer
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.kv_cache import init_cache
from tlt_jax.rollout import decode
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.weights import rollout_layout

CONFIG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                     max_position_embeddings=8192)
STATIC = dict(config=CONFIG, sampling=SamplingParams(temperature=0.0), eos_ids=(),
              max_new_tokens=4)


def _empty_state(rows: int, cache_len: int):
  return decode.empty_state(init_cache(CONFIG, rows, cache_len, per_layer=True),
                            jnp.full((rows,), 4), jnp.ones((rows,), bool), jax.random.key(0),
                            max_new_tokens=4, keep_hidden=True, hidden_size=CONFIG.hidden_size)


def _prefill_temp_bytes(prompt_len: int) -> int:
  """Temporary bytes of the compiled prefill of one prompt of `prompt_len` tokens."""
  params = rollout_layout(transformer.init_params(CONFIG, jax.random.key(0)))
  state = jax.eval_shape(lambda: _empty_state(1, prompt_len))
  compiled = decode.prefill_rows.lower(
      params, state, jnp.zeros((1, prompt_len), jnp.int32), jnp.ones((1,), jnp.int32),
      jnp.zeros((1,), jnp.int32), jnp.int32(0), **STATIC).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_prefill_memory_is_linear_in_the_prompt():
  # In one pass: 4x the temporaries per doubling ([heads, T, T] scores per layer).
  small, large = _prefill_temp_bytes(2048), _prefill_temp_bytes(4096)
  assert large < 2.5 * small, (small, large)


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_prefill_in_passes_matches_one_pass(impl):
  """Two distinct prompts of 13 and 30 tokens copied to three rows, in passes of 8 and 7
  positions (the last pass shorter) and in one: the same cache, record and first tokens,
  with the jnp attention and the kernel (interpreted off-GPU)."""
  params = rollout_layout(transformer.init_params(CONFIG, jax.random.key(1)))
  rng = np.random.RandomState(0)
  tokens = rng.randint(0, CONFIG.vocab_size, (2, 32)).astype(np.int32)
  prefill = lambda chunk, impl: decode.prefill_rows(
      params, _empty_state(3, 64), jnp.asarray(tokens), jnp.array([13, 30]),
      jnp.array([1, 0, 1]), jnp.int32(0), prefill_chunk=chunk, attention_impl=impl, **STATIC)
  want = prefill(decode.PREFILL_CHUNK, "reference")
  for chunk in (8, 7):
    got = prefill(chunk, impl)
    for got_leaf, want_leaf in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      if jnp.issubdtype(got_leaf.dtype, jnp.floating):
        np.testing.assert_allclose(got_leaf, want_leaf, atol=1e-5)
      elif not jnp.issubdtype(got_leaf.dtype, jax.dtypes.prng_key):
        np.testing.assert_array_equal(got_leaf, want_leaf)

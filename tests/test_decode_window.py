"""Decode chunks attend over a cache window sized to the longest live row (the CPU kernel
over the whole cache, reading only the slots it sees): the tokens are those of a cacheless
greedy reference, and the window grows in page x 2^k steps."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.cpu import kernels as cpu_kernels
from tlt_jax.models import transformer
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.drafter import init_drafter_params
from tlt_jax.models.kv_cache import init_cache
from tlt_jax.rollout.buckets import BucketSpec
from tlt_jax.rollout.engine import generate, windowed_attention
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.spec_config import SpecConfig
from tlt_jax.rollout.strategy import SpecStrategy
from tlt_jax.rollout.weights import DraftWeights

CONFIG = ModelConfig(model_type="llama", vocab_size=61, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                     max_position_embeddings=256)


@jax.jit
def _causal_logits(params, tokens):
  """Logits at every position of tokens [1, T] from one causal pass over an empty cache."""
  hidden, _ = transformer.forward(params, CONFIG, tokens, jnp.arange(tokens.shape[1])[None],
                                  init_cache(CONFIG, 1, tokens.shape[1]))
  return transformer.lm_logits(params, CONFIG, hidden[0])


def _greedy_without_cache(params, prompt, new_tokens):
  """Argmax continuation and its log-probs, recomputing the whole (zero-padded, causal)
  sequence each step."""
  ids, logprobs = list(prompt), []
  for _ in range(new_tokens):
    padded = jnp.asarray([ids + [0] * (64 - len(ids))])
    logits = _causal_logits(params, padded)[len(ids) - 1]
    ids.append(int(jnp.argmax(logits)))
    logprobs.append(float(jax.nn.log_softmax(logits)[ids[-1]]))
  return ids[len(prompt):], logprobs


def test_attention_window_buckets():
  spec = BucketSpec(cache_page=8)
  assert [spec.attention_window(n, 40) for n in (1, 8, 9, 16, 17, 33, 40)] == \
      [8, 8, 16, 16, 32, 40, 40]


def test_only_the_cpu_kernel_attends_without_a_window():
  """The CPU kernel reads only the slots a query sees: a window would only copy."""
  assert windowed_attention("reference", None)
  assert windowed_attention("auto", None) == (cpu_kernels.build_problem() is not None)
  assert not windowed_attention("cpu", None)


@pytest.mark.parametrize("attention_impl", ["reference", "auto"])
@pytest.mark.parametrize("strategy", [None, "3_1_4", "3_2_5"])
def test_windowed_decode_matches_cacheless_greedy(strategy, attention_impl):
  """reference: windowed chunks; auto: on this CPU the kernel over the whole cache."""
  params = transformer.init_params(CONFIG, jax.random.key(3))
  rng = np.random.RandomState(0)
  prompts = [rng.randint(0, CONFIG.vocab_size, n).tolist() for n in (3, 11, 6)]
  spec = None if strategy is None else SpecConfig(
      strategy=SpecStrategy.parse(strategy), threshold=4, patience=0)
  drafter = None if strategy is None else DraftWeights(
      init_drafter_params(CONFIG, jax.random.key(4)))
  # Page 8 and 2-step chunks: the window grows by doubling up to the whole cache.
  result = generate(params, CONFIG, prompts, max_new_tokens=45,
                    sampling=SamplingParams(temperature=0.0),
                    buckets=BucketSpec(cache_page=8, prompt_page=8), chunk_steps=2, spec=spec,
                    drafter=drafter, attention_impl=attention_impl)
  assert result.stats["cache_length"] >= 56
  for prompt, out in zip(prompts, result.outputs):
    tokens, logprobs = _greedy_without_cache(params, prompt, 45)
    assert out.token_ids == tokens
    np.testing.assert_allclose(out.logprobs, logprobs, atol=1e-5)


def test_prefill_groups_pad_only_to_their_own_longest_prompt():
  """Prompts are prefilled longest first in groups, each padded to its own longest prompt:
  same tokens as a cacheless reference, and one prefill program per group width."""
  from tlt_jax.rollout import decode
  params = transformer.init_params(CONFIG, jax.random.key(5))
  rng = np.random.RandomState(1)
  prompts = [rng.randint(0, CONFIG.vocab_size, n).tolist() for n in (2, 30, 5, 17, 9, 3, 25, 12)]
  greedy = SamplingParams(temperature=0.0)
  before = decode.prefill_rows._cache_size()
  # Groups of 2 rows, longest first: (30, 25) -> 32, (17, 12) -> 24, (9, 5) -> 16, (3, 2) -> 8.
  grouped = generate(params, CONFIG, prompts, max_new_tokens=6, sampling=greedy,
                     buckets=BucketSpec(prompt_page=8, prefill_groups=4))
  assert decode.prefill_rows._cache_size() - before == 4
  whole = generate(params, CONFIG, prompts, max_new_tokens=6, sampling=greedy,
                   buckets=BucketSpec(prompt_page=8, prefill_groups=1))
  for prompt, a, b in zip(prompts, grouped.outputs, whole.outputs):
    tokens, logprobs = _greedy_without_cache(params, prompt, 6)
    assert a.token_ids == b.token_ids == tokens
    np.testing.assert_allclose(a.logprobs, logprobs, atol=1e-5)


def test_rows_sharing_a_prompt_prefill_it_once():
  """A GRPO group's rows share one prompt: each distinct prompt of a prefill group runs
  once (a power-of-two count of them), every row gets its K/V, and the tokens are those of
  a cacheless reference; at T=1 the rows still draw their first tokens apart."""
  from tlt_jax.rollout import decode
  from tlt_jax.rollout.engine import distinct_prompts
  params = transformer.init_params(CONFIG, jax.random.key(6))
  rng = np.random.RandomState(2)
  a, b, c = (rng.randint(1, CONFIG.vocab_size, n).tolist() for n in (7, 11, 7))
  prompts = [a, b, a, a, b, c]
  tokens = np.zeros((8, 16), np.int32)
  lengths = np.ones(8, np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)], lengths[i] = p, len(p)
  picked, sources = distinct_prompts(tokens, lengths, BucketSpec())
  assert len(picked) == 4                    # a, b, c and the dead rows' padding prompt
  np.testing.assert_array_equal(tokens[picked][sources], tokens)
  np.testing.assert_array_equal(lengths[picked][sources], lengths)

  before = decode.prefill_rows._cache_size()
  out = generate(params, CONFIG, prompts, max_new_tokens=5, sampling=SamplingParams(0.0),
                 buckets=BucketSpec(prompt_page=8, prefill_groups=1))
  assert decode.prefill_rows._cache_size() - before == 1
  for prompt, o in zip(prompts, out.outputs):
    expected, logprobs = _greedy_without_cache(params, prompt, 5)
    assert o.token_ids == expected
    np.testing.assert_allclose(o.logprobs, logprobs, atol=1e-5)
  sampled = generate(params, CONFIG, [a] * 8, max_new_tokens=1, sampling=SamplingParams(1.0),
                     seed=3)
  assert len({o.token_ids[0] for o in sampled.outputs}) > 1


def test_tail_seconds_start_once_nine_tenths_of_the_rows_are_done():
  from tlt_jax.rollout.engine import tail_seconds
  trace = [(1.0, 20), (2.0, 9), (3.5, 2), (4.0, 1), (9.0, 0)]
  assert tail_seconds(trace, 20) == 9.0 - 3.5     # 18 of 20 done at 3.5 s
  assert tail_seconds(trace, 10) == 9.0 - 4.0     # 9 of 10 done at 4 s
  assert tail_seconds(trace, 4) == 9.0 - 4.0      # a tenth of 4 rows rounds up to 1 row
  assert tail_seconds([(0.5, 1), (2.5, 0)], 1) == 2.0

"""Speculative decoding on the real SmolLM2-135M-Instruct: exact greedy tokens and log-probs.

The drafter is random (exactness must not depend on drafter quality), except in the test of
the drafter the repo ships.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.drafter.trainer import load_drafter
from tlt_jax.models import transformer
from tlt_jax.models.drafter import init_drafter_params
from tlt_jax.models.kv_cache import init_cache
from tlt_jax.models.loading import load_model
from tlt_jax.rollout.engine import generate
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.spec_config import SpecConfig
from tlt_jax.rollout.strategy import SpecStrategy
from tlt_jax.rollout.weights import DraftWeights

SHIPPED_DRAFTER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                               "assets", "drafter_smollm2")
QUESTIONS = ("What is 7 times 8?", "Name a primary color.",
             "Write one sentence about the moon and the tides.")


@pytest.fixture(scope="module")
def smollm2():
  model = load_model("smollm2")
  drafter = init_drafter_params(model.config, jax.random.key(0))
  prompts = [model.tokenizer.chat_prompt(q) for q in QUESTIONS]
  return model, drafter, prompts


@pytest.mark.parametrize("strategy", ["4_1_5", "3_2_5"])
def test_smollm2_greedy_sd_is_token_identical(smollm2, strategy):
  model, drafter, prompts = smollm2
  eos = tuple(model.tokenizer.eos_token_ids)
  kwargs = dict(max_new_tokens=24, sampling=SamplingParams(temperature=0.0), eos_ids=eos)
  plain = generate(model.params, model.config, prompts, **kwargs)
  # A reduced draft vocabulary, as deployed: drafting restricted, verification exact.
  spec = SpecConfig(strategy=SpecStrategy.parse(strategy), threshold=4, patience=3)
  sd = generate(model.params, model.config, prompts, spec=spec,
                drafter=DraftWeights(drafter, jnp.arange(4096, dtype=jnp.int32)), **kwargs)
  assert [o.token_ids for o in plain.outputs] == [o.token_ids for o in sd.outputs]
  np.testing.assert_allclose(np.concatenate([o.logprobs for o in plain.outputs]),
                             np.concatenate([o.logprobs for o in sd.outputs]), atol=1e-4)
  assert sd.stats["spec/verify_steps"] > 0


def test_smollm2_sampled_sd_logprobs_equal_a_plain_forward(smollm2):
  """Emitted log-probs are the target's log_softmax(logits / T) at each emitted token."""
  model, drafter, prompts = smollm2
  temperature = 0.8
  spec = SpecConfig(strategy=SpecStrategy(3, 2, 5), threshold=4, patience=0)
  out = generate(model.params, model.config, prompts[:1], max_new_tokens=12, seed=5,
                 sampling=SamplingParams(temperature=temperature, top_p=0.95), spec=spec,
                 drafter=DraftWeights(drafter), eos_ids=()).outputs[0]
  full = prompts[0] + out.token_ids
  tokens = jnp.asarray([full])
  hidden, _ = transformer.forward(model.params, model.config, tokens,
                                  jnp.arange(len(full))[None], init_cache(model.config, 1, 128))
  logits = transformer.lm_logits(model.params, model.config, hidden)[0]
  positions = np.arange(len(prompts[0]) - 1, len(full) - 1)
  expected = jax.nn.log_softmax(logits[positions] / temperature, axis=-1)[
      np.arange(len(positions)), np.asarray(out.token_ids)]
  np.testing.assert_allclose(out.logprobs, expected, atol=1e-4)


def test_shipped_drafter_is_trained_for_smollm2(smollm2):
  """assets/drafter_smollm2 loads for SmolLM2 and drafts what SmolLM2 says: greedy 4_1_5
  accepts well over one token per verify step (a random drafter: about 1), with the output
  still exactly plain decoding's."""
  model, _, prompts = smollm2
  drafter, vocab_ids = load_drafter(SHIPPED_DRAFTER, model.config)
  eos = tuple(model.tokenizer.eos_token_ids)
  kwargs = dict(max_new_tokens=48, sampling=SamplingParams(temperature=0.0), eos_ids=eos)
  plain = generate(model.params, model.config, prompts[:2], **kwargs)
  spec = SpecConfig(strategy=SpecStrategy(4, 1, 5), threshold=2, patience=0)
  sd = generate(model.params, model.config, prompts[:2], spec=spec,
                drafter=DraftWeights(drafter, jnp.asarray(vocab_ids)), **kwargs)
  assert [o.token_ids for o in plain.outputs] == [o.token_ids for o in sd.outputs]
  assert sd.stats["spec/accept_len"] > 1.4, sd.stats["spec/accept_len"]

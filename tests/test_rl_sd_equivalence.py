"""SD does not change training: an RL step with speculative decoding in the rollout trains
exactly as one without it. Greedy (T=0): the same response tokens, rewards, losses and
updated params. Sampled (T=1): response lengths and rewards over many samples pass a
two-sample homogeneity test, one that does tell T=0.7 from T=1 at the same sample size."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.rl_sd_helpers import ALPHABET, CharTokenizer
from tlt_jax import optim
from tlt_jax.data.rl_data import PromptRecord, PromptStream
from tlt_jax.models import drafter as drafter_lib
from tlt_jax.models import transformer
from tlt_jax.models.config import ModelConfig
from tlt_jax.rl.config import AdvantageConfig, LossConfig
from tlt_jax.rl.learner import Learner, StepConfig
from tlt_jax.rl.rewards import RewardPool, RewardSpec
from tlt_jax.rl.rollout import RolloutSettings
from tlt_jax.rl.update import UpdateConfig, UpdateContext, init_policy_state
from tlt_jax.rollout.buckets import BucketSpec
from tlt_jax.rollout.engine import SpecConfig
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.strategy import SpecStrategy

VOCAB = 12
EOS = (10, 11)
MAX_NEW = 24
REWARD = "tests.rl_sd_helpers:letter_share_reward"
LR = 1e-3
# One optimizer for every learner: it keys the update's compiled programs.
OPTIMIZER = optim.make_optimizer(LR, 1, weight_decay=0.01, clip_norm=1.0, b2=0.999,
                                 schedule="constant")


@pytest.fixture(scope="module")
def model():
  config = ModelConfig(model_type="qwen3", vocab_size=VOCAB, hidden_size=32,
                       intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=8, qk_norm=True, max_position_embeddings=512)
  params = transformer.init_params(config, jax.random.key(0))
  drafter = drafter_lib.init_drafter_params(config, jax.random.key(1))
  return config, params, drafter


@pytest.fixture(scope="module")
def rewards():
  with RewardPool(RewardSpec(REWARD), num_workers=1, timeout_s=60.0) as pool:
    yield pool


def _prompt_pairs(n, seed=0):
  rng = np.random.RandomState(seed)
  pairs = []
  for i in range(n):
    ids = rng.randint(0, VOCAB - len(EOS), rng.randint(3, 11)).tolist()
    record = PromptRecord(prompt=({"role": "user", "content": f"prompt {i}"},),
                          ground_truth=ALPHABET[i % 3] + ALPHABET[3 + i % 4],
                          data_source="toy")
    pairs.append((record, ids))
  return pairs


def _learner(model, rewards, *, sd, temperature, prompts_per_step, group_size, seed=0,
             batch_buckets=(16,), params=None):
  """experiments/rl_flags.build_run's wiring, small: a fresh copy of the params (updates
  donate the policy's buffers), SD from the first decode step, an entropy bonus."""
  config, model_params, drafter = model
  params = model_params if params is None else params
  sampling = SamplingParams(temperature=temperature)
  rows = prompts_per_step * group_size
  spec = (SpecConfig(drafter=drafter, strategy=SpecStrategy.parse("4_1_5"),
                     threshold=rows, patience=0) if sd else None)
  rollout = RolloutSettings(group_size=group_size, max_new_tokens=MAX_NEW, sampling=sampling,
                            eos_ids=EOS, spec=spec, chunk_steps=8,
                            buckets=BucketSpec(batch_buckets=batch_buckets))
  context = UpdateContext(config=config, sampling=sampling,
                          loss=LossConfig(entropy_coef=0.02),
                          update=UpdateConfig(micro_batch_rows=8, train_seq_len=64),
                          optimizer=OPTIMIZER,
                          learning_rate=optim.learning_rate_schedule(LR, 1,
                                                                     schedule="constant"),
                          max_response_len=MAX_NEW)
  return Learner(config=config, tokenizer=CharTokenizer(),
                 state=init_policy_state(jax.tree.map(jnp.copy, params), OPTIMIZER),
                 ref_params=None,
                 stream=PromptStream(_prompt_pairs(32), prompts_per_step, seed=0),
                 rollout=rollout,
                 step_config=StepConfig(prompts_per_step=prompts_per_step,
                                        advantage=AdvantageConfig(), seed=seed),
                 update=context, rewards=rewards)


def _capture_groups(learner):
  """Keeps the step's scored rollouts (`collect_groups`' result) on the side."""
  captured = []
  collect = learner.collect_groups
  def collect_and_keep(step, record):
    captured.append(collect(step, record))
    return captured[-1]
  learner.collect_groups = collect_and_keep
  return captured


def test_greedy_step_is_identical_with_and_without_sd(model, rewards):
  runs = {}
  for sd in (False, True):
    learner = _learner(model, rewards, sd=sd, temperature=0.0, prompts_per_step=4,
                       group_size=4)
    captured = _capture_groups(learner)
    record = learner.step(1)
    runs[sd] = (record, captured[0], learner.state.params)
  (plain_record, plain, plain_params), (sd_record, sd, sd_params) = runs[False], runs[True]

  assert "spec/verify_steps" not in plain_record
  assert sd_record["spec/verify_steps"] > 0 and sd_record["spec/enabled_frac"] > 0
  lengths = plain.rollouts.response_lengths
  assert len(set(lengths.tolist())) > 1              # rows end at different lengths
  assert not plain.rollouts.truncated.all()           # some end by EOS
  assert len(set(plain.rewards.ravel().tolist())) > 1

  # Rollouts: the same tokens, ends and order; the rollout log-probs agree to rounding.
  assert sd.rollouts.responses == plain.rollouts.responses
  assert sd.rollouts.prompts == plain.rollouts.prompts
  np.testing.assert_array_equal(sd.rollouts.truncated, plain.rollouts.truncated)
  for a, b in zip(plain.rollouts.logprobs, sd.rollouts.logprobs):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
  # Rewards, and everything the update computes from the tokens, bit for bit.
  np.testing.assert_array_equal(sd.rewards, plain.rewards)
  for key in ("reward/mean", "reward/std", "response_len/mean", "response_len/max",
              "actor/pg_loss", "actor/loss", "actor/entropy", "actor/ratio_mean",
              "actor/grad_norm"):
    assert sd_record[key] == plain_record[key], key
  assert plain_record["actor/loss"] != 0 and plain_record["actor/grad_norm"] > 0
  changed = jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.any(a != b)), plain_params,
                                         model[1]))
  assert any(changed)                                # the step did move the params
  for path, a, b in zip(jax.tree_util.tree_flatten_with_path(plain_params)[0],
                        jax.tree.leaves(plain_params), jax.tree.leaves(sd_params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path[0]))

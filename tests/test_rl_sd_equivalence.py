"""SD does not change training: an RL step with speculative decoding in the rollout trains
exactly as one without it. Greedy (T=0): the same response tokens, rewards, losses and
updated params. Sampled (T=1): response lengths and rewards over many samples pass a
two-sample test, one that does tell T=0.7 from T=1 at the same sample size."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chi2_contingency

from tests.rl_sd_helpers import CharTokenizer
from tlt_jax import optim
from tlt_jax.data.rl_data import PromptRecord, PromptStream
from tlt_jax.models import drafter as drafter_lib
from tlt_jax.models import transformer
from tlt_jax.models.config import ModelConfig
from tlt_jax.rl.config import LossConfig
from tlt_jax.rl.learner import Learner, StepConfig
from tlt_jax.rl.rewards import RewardPool, RewardSpec
from tlt_jax.rl.rollout import RolloutSettings
from tlt_jax.rl.update import UpdateConfig, UpdateContext, init_policy_state
from tlt_jax.rollout.buckets import BucketSpec
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.spec_config import SpecConfig
from tlt_jax.rollout.strategy import SpecStrategy
from tlt_jax.rollout.weights import DraftWeights

VOCAB = 12
EOS = (10, 11)          # 2 of 12 ids: sampled responses end at varied lengths
MAX_NEW = 24
REWARD = "tests.rl_sd_helpers:variety_reward"
LR = 1e-3
# One optimizer for every learner: it keys the update's compiled programs.
OPTIMIZER = optim.make_optimizer(LR, 1, weight_decay=0.01, clip_norm=1.0, b2=0.999,
                                 schedule="constant")
CONFIG = ModelConfig(model_type="qwen3", vocab_size=VOCAB, hidden_size=32,
                     intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=8, qk_norm=True, max_position_embeddings=512)


def _random_like(init, seed):
  """Random values in the layout `init` builds (jax.eval_shape: nothing runs), drawn with
  numpy: `init_params`' many small eager random ops each compile a program, ~20 s on two
  CPU cores. Matrices at 1/sqrt(fan_in), norms near 1, biases near 0, embeddings N(0, 1)."""
  shapes = jax.eval_shape(init, jax.random.key(0))
  rng = np.random.RandomState(seed)
  def draw(path, leaf):
    name = jax.tree_util.keystr(path)
    noise = rng.standard_normal(leaf.shape).astype(np.float32)
    if "norm" in name:
      return jnp.asarray(1.0 + 0.1 * noise)
    if "bias" in name:
      return jnp.asarray(0.02 * noise)
    if "embed" in name:
      return jnp.asarray(noise)
    return jnp.asarray(noise * leaf.shape[-2] ** -0.5)
  return jax.tree_util.tree_map_with_path(draw, shapes)


@pytest.fixture(scope="module")
def model():
  """A random policy with a 3x sharper head than 1/sqrt(fan_in), so that the sampling
  temperature visibly moves lengths and rewards (see the power check), and a random
  drafter (seed 9: its greedy drafts are often accepted on these prompts)."""
  params = _random_like(functools.partial(transformer.init_params, CONFIG), seed=0)
  params["lm_head"] = params["lm_head"] * 3.0
  drafter = _random_like(functools.partial(drafter_lib.init_drafter_params, CONFIG), seed=9)
  return params, drafter


@pytest.fixture(scope="module")
def rewards():
  with RewardPool(RewardSpec(REWARD), num_workers=1, timeout_s=60.0) as pool:
    yield pool


def _prompt_pairs(n, seed=0):
  """n prompts of 3-10 random non-EOS ids."""
  rng = np.random.RandomState(seed)
  return [(PromptRecord(prompt=({"role": "user", "content": f"prompt {i}"},),
                        ground_truth="", data_source="toy"),
           rng.randint(0, VOCAB - len(EOS), rng.randint(3, 11)).tolist()) for i in range(n)]


def _learner(params, drafter, rewards, *, sd, temperature, prompts_per_step, group_size,
             seed, batch_buckets):
  """experiments/rl_flags.build_run's wiring, small: a fresh copy of the params (updates
  donate the policy's buffers), SD on from the first decode step, an entropy bonus."""
  sampling = SamplingParams(temperature=temperature)
  rows = prompts_per_step * group_size
  spec = (SpecConfig(strategy=SpecStrategy.parse("4_1_5"), threshold=rows, patience=0)
          if sd else None)
  rollout = RolloutSettings(group_size=group_size, max_new_tokens=MAX_NEW, sampling=sampling,
                            eos_ids=EOS, spec=spec, chunk_steps=8,
                            buckets=BucketSpec(batch_buckets=batch_buckets))
  context = UpdateContext(config=CONFIG, sampling=sampling,
                          loss=LossConfig(entropy_coef=0.02),
                          update=UpdateConfig(micro_batch_rows=8, train_seq_len=64),
                          optimizer=OPTIMIZER,
                          learning_rate=optim.learning_rate_schedule(LR, 1,
                                                                     schedule="constant"),
                          max_response_len=MAX_NEW)
  return Learner(config=CONFIG, tokenizer=CharTokenizer(),
                 state=init_policy_state(jax.tree.map(jnp.copy, params), context),
                 ref_params=None,
                 stream=PromptStream(_prompt_pairs(32), prompts_per_step, seed=0),
                 rollout=rollout,
                 step_config=StepConfig(prompts_per_step=prompts_per_step, seed=seed),
                 update=context, rewards=rewards,
                 drafter=DraftWeights(drafter) if sd else None)


def _capture_groups(learner):
  """Keeps the step's scored rollouts (what `collect_groups` returns) on the side."""
  captured = []
  collect = learner.collect_groups
  def collect_and_keep(step, record):
    captured.append(collect(step, record))
    return captured[-1]
  learner.collect_groups = collect_and_keep
  return captured


def test_greedy_step_is_identical_with_and_without_sd(model, rewards):
  """T=0: one full RL step (rollout, rewards, advantages, update) per learner.

  Greedy rows of a group are equal, so GRPO advantages are 0 and the update is the
  entropy bonus (+ weight decay): the params move by a function of the rollout tokens."""
  params, drafter = model
  runs = {}
  for sd in (False, True):
    learner = _learner(params, drafter, rewards, sd=sd, temperature=0.0, prompts_per_step=4,
                       group_size=4, seed=0, batch_buckets=(16,))
    captured = _capture_groups(learner)
    record = learner.step(1)
    runs[sd] = (record, captured[0], learner.state.params)
  (plain_record, plain, plain_params), (sd_record, sd, sd_params) = runs[False], runs[True]

  assert "spec/verify_steps" not in plain_record
  # SD from the first decode step: every token but each row's first (the prefill's).
  assert sd_record["spec/verify_steps"] > 0 and sd_record["spec/accept_len"] > 1.2
  assert sd_record["spec/enabled_frac"] == pytest.approx(
      1 - 16 / sd_record["rollout/generated_tokens"])
  lengths = plain.rollouts.response_lengths
  assert len(set(lengths.tolist())) > 1              # rows end at different lengths
  assert not plain.rollouts.truncated.all()           # some by EOS
  assert len(set(plain.rewards.ravel().tolist())) > 1

  # Rollouts: the same tokens, ends and order.
  assert sd.rollouts.responses == plain.rollouts.responses
  assert sd.rollouts.prompts == plain.rollouts.prompts
  np.testing.assert_array_equal(sd.rollouts.truncated, plain.rollouts.truncated)
  # Their log-probs agree to float32 rounding, not bit for bit (measured: 3/4 of the
  # tokens equal, the rest <= 6e-7 apart): the verify pass scores 5 tokens per row in one
  # forward, plain decode 1, and XLA:CPU rounds by shape (the plain model run over the same
  # tokens in chunks of 5 vs 1 differs alike). The trainer's packed forward is as far from
  # either (rollout/logprob_diff_max ~7e-7 both ways).
  for a, b in zip(plain.rollouts.logprobs, sd.rollouts.logprobs):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
  for key in ("rollout/logprob_diff_mean", "rollout/logprob_diff_max"):
    assert sd_record[key] == pytest.approx(plain_record[key], rel=0, abs=1e-6), key
  # Rewards and every metric of the rewards and the update, bit for bit. The rollout
  # log-probs enter the loss only through ratio * advantage, and greedy advantages are 0.
  np.testing.assert_array_equal(sd.rewards, plain.rewards)
  compared = [k for k in plain_record if k.startswith(("actor/", "reward/", "response_len/",
                                                       "data/"))]
  assert {"actor/pg_loss", "actor/loss", "actor/entropy", "actor/grad_norm",
          "reward/mean", "response_len/mean"} <= set(compared)
  # actor/ratio_mean averages exp(logp - rollout logp): it carries the rollout log-probs'
  # rounding (<= 1e-6 above) and nothing else; every other metric is bit for bit.
  for key in compared:
    tolerance = 2e-6 if key == "actor/ratio_mean" else 0
    assert sd_record[key] == pytest.approx(plain_record[key], rel=0, abs=tolerance), key
  assert plain_record["actor/loss"] != 0 and plain_record["actor/grad_norm"] > 0
  flat_plain = jax.tree_util.tree_flatten_with_path(plain_params)[0]
  assert any(np.any(np.asarray(a) != np.asarray(b))
             for (_, a), b in zip(flat_plain, jax.tree.leaves(params)))   # params moved
  for (path, a), b in zip(flat_plain, jax.tree.leaves(sd_params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                  err_msg=jax.tree_util.keystr(path))


def _homogeneity_p(a, b, min_count=10):
  """Chi-square two-sample homogeneity p-value of two samples of a discrete value: one
  column per value in ascending order, sparse columns merged with their next ones until
  each holds >= min_count samples of the pooled two."""
  values = np.union1d(a, b)
  columns, pending = [], np.zeros(2)
  for v in values:
    pending = pending + [np.sum(a == v), np.sum(b == v)]
    if pending.sum() >= min_count:
      columns.append(pending)
      pending = np.zeros(2)
  if pending.sum():
    columns[-1] = columns[-1] + pending
  return chi2_contingency(np.array(columns).T)[1]


def _sample(learner, steps):
  """Response lengths and rewards of `steps` rollouts (each its own step seed, the same
  prompt batches for every learner), and the rollouts' records."""
  lengths, rewards, records = [], [], []
  for step in range(1, steps + 1):
    record = {}
    scored = learner.collect_groups(step, record)
    lengths.append(scored.rollouts.response_lengths)
    rewards.append(scored.rewards.ravel())
    records.append(record)
  return np.concatenate(lengths), np.concatenate(rewards), records


def test_sampled_rollouts_have_the_same_distribution_with_and_without_sd(model, rewards):
  """T=1: 2048 responses each (32 rollouts of 8 prompts x 8), SD on from the first decode
  step, independent step seeds. Their response lengths and rewards pass a chi-square
  homogeneity test; the same test at the same size tells T=1 from T=0.7."""
  params, drafter = model
  steps, kwargs = 32, dict(temperature=1.0, prompts_per_step=8, group_size=8,
                           batch_buckets=(64,))
  plain = _sample(_learner(params, drafter, rewards, sd=False, seed=1, **kwargs), steps)
  sd = _sample(_learner(params, drafter, rewards, sd=True, seed=2, **kwargs), steps)
  # T=0.7 through the head: logits / 0.7 are exactly what temperature 0.7 samples from,
  # and the T=1 programs serve them (a new temperature would compile new ones).
  sharper = dict(params, lm_head=params["lm_head"] / 0.7)
  cold = _sample(_learner(sharper, drafter, rewards, sd=False, seed=3, **kwargs), steps)

  assert all("spec/verify_steps" not in r for r in plain[2])
  # Every token but each row's first (sampled by the prefill) came from an SD verify step.
  for step, r in enumerate(sd[2], 1):
    assert r["spec/verify_steps"] > 0 and r["spec/accept_len"] > 1.1, step
    assert r["spec/enabled_frac"] == pytest.approx(1 - 64 / r["rollout/generated_tokens"])
  # Lengths spread out, some responses truncated, rewards many-valued.
  assert 0.02 < np.mean(plain[0] == MAX_NEW) < 0.5 and len(np.unique(plain[0])) > 10
  assert len(np.unique(plain[1])) > 10

  p_length, p_reward = _homogeneity_p(plain[0], sd[0]), _homogeneity_p(plain[1], sd[1])
  power_length, power_reward = _homogeneity_p(sd[0], cold[0]), _homogeneity_p(sd[1], cold[1])
  print(f"SD vs plain: lengths p={p_length:.3g}, rewards p={p_reward:.3g}; "
        f"SD vs T=0.7: lengths p={power_length:.3g}, rewards p={power_reward:.3g}")
  assert p_length >= 1e-3 and p_reward >= 1e-3, (p_length, p_reward)
  assert power_length < 1e-3 and power_reward < 1e-3, (power_length, power_reward)

"""Sequences with a zero gradient left out of the update (`UpdateConfig.skip_zero_advantage`):
the step is the one that computes them, only cheaper. Against the torch oracle:
tests/test_rl_torch_oracle.py (`test_zero_advantage_sequences_left_out_keep_the_oracles_*`)."""
import dataclasses

import jax
import numpy as np
import optax

from tlt_jax import optim
from tlt_jax.models import transformer
from tlt_jax.models.config import ModelConfig
from tlt_jax.rl.batching import Sequences
from tlt_jax.rl.config import LossConfig
from tlt_jax.rl.update import (UpdateConfig, UpdateContext, init_policy_state,
                               moving_sequences, update_policy)
from tlt_jax.rollout.sampling import SamplingParams

TINY = ModelConfig(model_type="llama", vocab_size=61, hidden_size=32, intermediate_size=64,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                   max_position_embeddings=256)
N = 6


def _batch():
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 61, 5).tolist() for _ in range(N)]
  responses = [rng.integers(0, 61, n).tolist() for n in (7, 3, 9, 4, 8, 2)]
  logprobs = [np.full(len(r), -4.0, np.float32) for r in responses]
  return Sequences(prompts, responses), logprobs


def _update(advantages, skip: bool, optimizer, epochs=1, mini_batches=1):
  ctx = UpdateContext(config=TINY, sampling=SamplingParams(temperature=1.0), loss=LossConfig(),
                      update=UpdateConfig(ppo_epochs=epochs, num_mini_batches=mini_batches,
                                          micro_batch_rows=2, train_seq_len=32,
                                          skip_zero_advantage=skip),
                      optimizer=optimizer, learning_rate=optax.constant_schedule(1e-3),
                      max_response_len=16)
  sequences, logprobs = _batch()
  params = transformer.init_params(TINY, jax.random.key(0))
  return update_policy(init_policy_state(params, ctx), sequences,
                       np.asarray(advantages, np.float32), logprobs, None, np.ones(N, bool),
                       ctx, seed=0)


def test_a_step_of_tied_groups_computes_nothing_and_still_steps_the_optimizer():
  """Every advantage zero: no micro-batch runs, yet AdamW's step (its weight decay moves
  every weight) is the one the full computation takes, bit for bit."""
  adamw = optim.make_optimizer(1e-3, 10, weight_decay=0.1)
  skipped, metrics = _update(np.zeros(N), True, adamw)
  full, full_metrics = _update(np.zeros(N), False, adamw)
  assert metrics["train/skipped_sequences"] == N and metrics["train/micro_batches"] == 0
  assert "train/fill" not in metrics and "actor/entropy" not in metrics
  assert metrics["actor/loss"] == 0.0
  assert full_metrics["train/skipped_sequences"] == 0 and full_metrics["train/micro_batches"] > 0
  assert int(skipped.step) == int(full.step) == 1
  for a, b in zip(jax.tree.leaves(skipped.params), jax.tree.leaves(full.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  before = transformer.init_params(TINY, jax.random.key(0))
  assert not np.array_equal(np.asarray(skipped.params["embed"]), np.asarray(before["embed"]))


def test_skipping_keeps_the_step_and_computes_fewer_slots():
  """Two of three groups informative: the same SGD step (to summation order) from fewer
  computed token slots, over several epochs and mini-batches (each keeps its own
  normalizer); metrics cover the trained tokens."""
  advantages = [1.0, -1.0, 0.0, 0.0, 0.5, -0.5]
  sgd = optax.sgd(1e-1)
  for epochs, mini_batches in ((1, 1), (2, 2)):
    skipped, metrics = _update(advantages, True, sgd, epochs, mini_batches)
    full, full_metrics = _update(advantages, False, sgd, epochs, mini_batches)
    assert metrics["train/skipped_sequences"] == 2
    assert metrics["actor/updates"] == full_metrics["actor/updates"] == epochs * mini_batches
    assert metrics["train/rows"] < full_metrics["train/rows"]
    for a, b in zip(jax.tree.leaves(skipped.params), jax.tree.leaves(full.params)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
    before = transformer.init_params(TINY, jax.random.key(0))
    moved = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                for a, b in zip(jax.tree.leaves(skipped.params), jax.tree.leaves(before)))
    assert moved > 1e-3
    np.testing.assert_allclose(metrics["actor/grad_norm"], full_metrics["actor/grad_norm"],
                               rtol=1e-5)


def test_only_a_loss_without_kl_or_entropy_skips():
  advantages = np.array([1.0, 0.0, -1.0, 0.0])
  in_loss = np.array([True, True, False, False])
  np.testing.assert_array_equal(moving_sequences(advantages, in_loss, LossConfig()),
                                [True, False, False, False])
  for fields in (dict(kl_coef=0.1), dict(entropy_coef=0.01)):
    loss = dataclasses.replace(LossConfig(), **fields)
    np.testing.assert_array_equal(moving_sequences(advantages, in_loss, loss), in_loss)

"""The RL step's math against hand-computed cases: group advantages, DAPO's overlong penalty
and dynamic sampling, KL estimators, the clipped policy loss, and the loss aggregation modes
(including that micro-batches sum to the mini-batch loss and gradient)."""
from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.cpu import kernels as cpu_kernels
from tlt_jax.errors import UserInputError
from tlt_jax.rl.advantages import (GroupFill, group_advantages, informative_groups,
                                   overlong_penalty)
from tlt_jax.rl.config import AdvantageConfig, LossConfig, OverlongConfig
from tlt_jax.rl.losses import kl_penalty, policy_loss, sequence_weights

# ---------------------------------------------------------------- advantages


def test_grpo_advantages_use_unbiased_std():
  # [1, 0, 0, 1]: mean 0.5, deviations +-0.5, ddof=1 var = 4 * 0.25 / 3 = 1/3,
  # std = 0.577350 -> A = +-0.5 / 0.577350 = +-0.866025 (ddof=0 would give +-1).
  adv = group_advantages(np.array([[1.0, 0.0, 0.0, 1.0]]), AdvantageConfig("grpo", eps=1e-6))
  np.testing.assert_allclose(adv, [[0.866025, -0.866025, -0.866025, 0.866025]], rtol=1e-5)
  assert adv.dtype == np.float32


def test_grpo_advantages_add_eps_to_std():
  # [0, 1, 2]: mean 1, ddof=1 std = sqrt((1 + 0 + 1) / 2) = 1; eps 0.5 -> A = [-1, 0, 1] / 1.5.
  adv = group_advantages(np.array([[0.0, 1.0, 2.0]]), AdvantageConfig("grpo", eps=0.5))
  np.testing.assert_allclose(adv, [[-2 / 3, 0.0, 2 / 3]], rtol=1e-6)


def test_dr_grpo_advantages_only_subtract_the_mean():
  # [1, 0, 0, 1] -> mean 0.5; [0, 1, 5] -> mean 2.
  adv = group_advantages(np.array([[1.0, 0.0, 0.0, 1.0]]), AdvantageConfig("dr_grpo"))
  np.testing.assert_allclose(adv, [[0.5, -0.5, -0.5, 0.5]], rtol=1e-6)
  adv = group_advantages(np.array([[0.0, 1.0, 5.0]]), AdvantageConfig("dr_grpo"))
  np.testing.assert_allclose(adv, [[-2.0, -1.0, 3.0]], rtol=1e-6)


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo"])
def test_zero_variance_groups_get_exactly_zero(mode):
  # 0.1 * 3 is not exactly representable: the mean of [0.1, 0.1, 0.1] differs from 0.1 by
  # rounding, and without the explicit zero grpo would divide that noise by eps.
  rewards = np.array([[0.1, 0.1, 0.1], [1.0, 0.0, 1.0], [5.0, 5.0, 5.0]])
  adv = group_advantages(rewards, AdvantageConfig(mode))
  assert np.all(adv[0] == 0) and np.all(adv[2] == 0)
  assert np.all(adv[1] != 0)


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo"])
def test_single_sample_groups_give_zero_not_nan(mode):
  with warnings.catch_warnings():
    warnings.simplefilter("error")   # no "degrees of freedom <= 0" warning either
    adv = group_advantages(np.array([[1.0], [0.0]]), AdvantageConfig(mode))
  np.testing.assert_array_equal(adv, [[0.0], [0.0]])


def test_informative_groups_flags_groups_with_differing_rewards():
  rewards = np.array([[1, 1, 1], [1, 0, 1], [0, 0, 0], [0, 0, 2]])
  np.testing.assert_array_equal(informative_groups(rewards), [False, True, False, True])
  np.testing.assert_array_equal(informative_groups(np.array([[3.0]])), [False])


# ---------------------------------------------------------------- overlong penalty


def test_overlong_soft_penalty_at_the_boundaries():
  # max 20, buffer 4 -> the ramp starts after 16 tokens: L=17 -> (16-17)/4 = -0.25,
  # L=18 -> -0.5, L=20 (the cap) -> -1, beyond the cap -> -1.
  config = OverlongConfig("soft_penalty", buffer_len=4, penalty_factor=1.0)
  got = overlong_penalty(np.array([0, 16, 17, 18, 20, 21]), 20, config)
  np.testing.assert_allclose(got, [0.0, 0.0, -0.25, -0.5, -1.0, -1.0], rtol=1e-6)
  assert got.dtype == np.float32
  # penalty_factor scales the ramp: L=18 -> -0.5 * 2 = -1; beyond the cap -> -2.
  config = OverlongConfig("soft_penalty", buffer_len=4, penalty_factor=2.0)
  np.testing.assert_allclose(overlong_penalty([18, 25], 20, config), [-1.0, -2.0], rtol=1e-6)


@pytest.mark.parametrize("mode", ["none", "mask"])
def test_overlong_penalty_is_zero_unless_soft(mode):
  got = overlong_penalty(np.array([5, 20, 30]), 20, OverlongConfig(mode, buffer_len=4))
  np.testing.assert_array_equal(got, [0.0, 0.0, 0.0])


def test_overlong_buffer_longer_than_responses_is_rejected():
  with pytest.raises(UserInputError, match="overlong_buffer_len"):
    overlong_penalty([3], 8, OverlongConfig("soft_penalty", buffer_len=9))


# ---------------------------------------------------------------- dynamic sampling


def test_dynamic_sampling_drops_all_equal_groups():
  rewards = np.array([[1, 1], [0, 0], [1, 0], [0, 1]])
  fill = GroupFill(target_groups=2, max_draws=3).add_draw(informative_groups(rewards))
  assert fill.done
  picked = fill.selection()
  np.testing.assert_array_equal(picked.groups, [[0, 2], [0, 3]])
  assert picked.num_padded == 0 and picked.num_draws == 1


def test_dynamic_sampling_refills_until_target_and_drops_the_surplus():
  fill = GroupFill(target_groups=3, max_draws=5)
  fill = fill.add_draw([True, False, True, False])
  assert not fill.done
  fill = fill.add_draw([False, True, True])   # only one more fits: (1, 2) is surplus
  assert fill.done
  picked = fill.selection()
  np.testing.assert_array_equal(picked.groups, [[0, 0], [0, 2], [1, 1]])
  assert picked.num_padded == 0 and picked.num_draws == 2
  with pytest.raises(ValueError, match="after done"):
    fill.add_draw([True])


def test_dynamic_sampling_cap_pads_with_uninformative_groups():
  fill = GroupFill(target_groups=4, max_draws=2)
  fill = fill.add_draw([True, False, False])
  fill = fill.add_draw([False, True, False])
  assert fill.done   # cap reached with 2 of 4
  padded = fill.selection(pad=True)
  np.testing.assert_array_equal(padded.groups, [[0, 0], [1, 1], [0, 1], [0, 2]])
  assert padded.num_padded == 2 and padded.num_draws == 2
  short = fill.selection(pad=False)
  np.testing.assert_array_equal(short.groups, [[0, 0], [1, 1]])
  assert short.num_padded == 0


def test_dynamic_sampling_rejects_bad_limits():
  with pytest.raises(UserInputError):
    GroupFill(target_groups=0, max_draws=1)
  with pytest.raises(UserInputError):
    GroupFill(target_groups=1, max_draws=0)


# ---------------------------------------------------------------- KL estimators


def test_kl_estimators_hand_values():
  logp = jnp.array([0.0, 1.0, -1.0, 2.0])   # ref 0 -> log r = logp
  ref = jnp.zeros(4)
  np.testing.assert_allclose(kl_penalty(logp, ref, "k1"), [0.0, 1.0, -1.0, 2.0])
  np.testing.assert_allclose(kl_penalty(logp, ref, "k2"), [0.0, 0.5, 0.5, 2.0])
  # k3: e^-1 - 1 + 1 = 0.367879; e^1 - 1 - 1 = 0.718282; e^-2 - 1 + 2 = 1.135335.
  np.testing.assert_allclose(kl_penalty(logp, ref, "k3"), [0.0, 0.367879, 0.718282, 1.135335],
                             rtol=1e-5, atol=1e-7)


def test_k3_is_nonnegative_and_close_to_k2_for_small_log_ratios():
  log_r = jnp.linspace(-3.0, 3.0, 601)
  assert np.all(np.asarray(kl_penalty(log_r, jnp.zeros_like(log_r), "k3")) >= 0)
  # log r = 0.01: k2 = 5e-5, k3 = r^2/2 - r^3/6 + ... = 4.9834e-5 (0.3% below k2).
  small = jnp.array([0.01, -0.01])
  k3 = np.asarray(kl_penalty(small, jnp.zeros(2), "k3"))
  np.testing.assert_allclose(k3, [4.9834e-5, 5.0167e-5], rtol=1e-3)
  np.testing.assert_allclose(k3, 5e-5, rtol=1e-2)


def test_k3_clamps_the_log_ratio_so_exp_cannot_overflow():
  logp = jnp.array([0.0, -200.0])
  ref = jnp.array([-200.0, 0.0])   # log r = +200 and -200, clamped to +-20
  k3 = kl_penalty(logp, ref, "k3")
  # +20: e^-20 - 1 + 20 = 19.0000; -20: e^20 - 1 - 20 = 4.85165e8.
  np.testing.assert_allclose(k3, [19.0, 4.8516519e8], rtol=1e-5)
  grad = jax.grad(lambda x: kl_penalty(x, ref, "k3").sum())(logp)
  assert np.all(np.isfinite(grad))


# ---------------------------------------------------------------- policy loss


def _one_token_loss(ratio, advantage, config, **extra):
  """Loss, metrics and d loss / d logp of one token at the given ratio (old_logp = 0)."""
  logp = jnp.array([math.log(ratio)])
  args = (jnp.zeros(1), jnp.array([advantage]), jnp.ones(1), jnp.ones(1), config)
  loss, metrics = policy_loss(logp, *args, **extra)
  grad = jax.grad(lambda x: policy_loss(x, *args, **extra)[0])(logp)
  return float(loss), {k: float(v) for k, v in metrics.items()}, float(grad[0])


def test_positive_advantage_ratio_above_one_plus_high_is_clipped():
  # A=1, r=1.5: max(-1.5, -1.2) = -1.2, constant in logp.
  loss, metrics, grad = _one_token_loss(1.5, 1.0, LossConfig())
  assert loss == pytest.approx(-1.2) and grad == 0.0 and metrics["actor/clip_frac"] == 1.0
  # A=1, r=0.5: max(-0.5, -0.8) = -0.5, unclipped, gradient -A r = -0.5.
  loss, metrics, grad = _one_token_loss(0.5, 1.0, LossConfig())
  assert loss == pytest.approx(-0.5) and grad == pytest.approx(-0.5)
  assert metrics["actor/clip_frac"] == 0.0


def test_negative_advantage_ratio_below_one_minus_low_is_clipped():
  # A=-1, r=0.5: max(0.5, 0.8) = 0.8, constant in logp.
  loss, metrics, grad = _one_token_loss(0.5, -1.0, LossConfig())
  assert loss == pytest.approx(0.8) and grad == 0.0 and metrics["actor/clip_frac"] == 1.0
  # A=-1, r=1.5: max(1.5, 1.2) = 1.5, unclipped, gradient -A r = 1.5.
  loss, metrics, grad = _one_token_loss(1.5, -1.0, LossConfig())
  assert loss == pytest.approx(1.5) and grad == pytest.approx(1.5)
  assert metrics["actor/clip_frac"] == 0.0


def test_clip_higher_is_asymmetric():
  config = LossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28)
  # A=1, r=1.25: inside [0.8, 1.28] -> -1.25 (symmetric 0.2 would clip to -1.2).
  loss, metrics, _ = _one_token_loss(1.25, 1.0, config)
  assert loss == pytest.approx(-1.25) and metrics["actor/clip_frac"] == 0.0
  assert _one_token_loss(1.25, 1.0, LossConfig())[0] == pytest.approx(-1.2)
  # A=1, r=1.4 -> clipped to -1.28.
  assert _one_token_loss(1.4, 1.0, config)[0] == pytest.approx(-1.28)
  # A=-1, r=0.75: the low side still clips at 0.8 -> max(0.75, 0.8) = 0.8.
  loss, metrics, _ = _one_token_loss(0.75, -1.0, config)
  assert loss == pytest.approx(0.8) and metrics["actor/clip_frac"] == 1.0


def test_dual_clip_caps_negative_advantage_loss():
  config = LossConfig(clip_ratio_c=3.0)
  # A=-1, r=5: max(5, 1.2) = 5 > -A c = 3 -> 3, constant.
  loss, metrics, grad = _one_token_loss(5.0, -1.0, config)
  assert loss == pytest.approx(3.0) and grad == 0.0
  assert metrics["actor/clip_frac_dual"] == 1.0
  # A=-1, r=2: 2 < 3 -> inactive, gradient -A r = 2.
  loss, metrics, grad = _one_token_loss(2.0, -1.0, config)
  assert loss == pytest.approx(2.0) and grad == pytest.approx(2.0)
  assert metrics["actor/clip_frac_dual"] == 0.0
  # A=+1, r=5: dual clip is for A<0 only -> the ordinary clip, -1.2.
  loss, metrics, _ = _one_token_loss(5.0, 1.0, config)
  assert loss == pytest.approx(-1.2) and metrics["actor/clip_frac_dual"] == 0.0
  # Without clip_ratio_c the A=-1, r=5 token costs 5 and there is no dual metric.
  loss, metrics, _ = _one_token_loss(5.0, -1.0, LossConfig())
  assert loss == pytest.approx(5.0) and "actor/clip_frac_dual" not in metrics


def test_truncated_importance_sampling_caps_the_rollout_weight():
  config = LossConfig(tis_cap=2.0)
  # old - rollout = log 3 -> weight min(3, 2) = 2; A=1, r=1: pg = -1 * 2, grad -A r w = -2.
  loss, metrics, grad = _one_token_loss(1.0, 1.0, config, rollout_logp=jnp.array([-math.log(3)]))
  assert loss == pytest.approx(-2.0) and grad == pytest.approx(-2.0)
  assert metrics["actor/tis_weight_mean"] == pytest.approx(2.0)
  # old - rollout = log 0.5 -> weight 0.5 (under the cap): pg = -0.5.
  loss, _, _ = _one_token_loss(1.0, 1.0, config, rollout_logp=jnp.array([math.log(2)]))
  assert loss == pytest.approx(-0.5)
  # No rollout log-probs: the old ones are the rollout's, weight 1.
  assert _one_token_loss(1.0, 1.0, config)[0] == pytest.approx(-1.0)


def test_kl_and_entropy_terms_and_their_metrics():
  config = LossConfig(kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01)
  # A=0 -> pg 0; log r = 1 -> kl 1; entropy 2: loss = 0.1 * 1 - 0.01 * 2 = 0.08.
  loss, metrics, grad = _one_token_loss(1.0, 0.0, config, ref_logp=jnp.array([-1.0]),
                                        entropy=jnp.array([2.0]))
  assert loss == pytest.approx(0.08)
  assert metrics["actor/kl"] == pytest.approx(1.0)
  assert metrics["actor/entropy"] == pytest.approx(2.0)
  assert metrics["actor/pg_loss"] == 0.0
  assert grad == pytest.approx(0.1)   # d(0.1 * (logp - ref)) / d logp
  with pytest.raises(ValueError, match="ref_logp"):
    _one_token_loss(1.0, 0.0, config, entropy=jnp.array([2.0]))
  with pytest.raises(ValueError, match="entropy"):
    _one_token_loss(1.0, 0.0, config, ref_logp=jnp.array([-1.0]))


def test_metrics_are_weighted_by_metric_weights():
  # Two tokens, metric weight 1/2 each: r = 1.5 (A=1, clipped) and r = 0.5 (A=1, not).
  logp = jnp.log(jnp.array([1.5, 0.5]))
  half = jnp.full(2, 0.5)
  _, metrics = policy_loss(logp, jnp.zeros(2), jnp.ones(2), half, half, LossConfig())
  assert float(metrics["actor/ratio_mean"]) == pytest.approx(1.0)
  assert float(metrics["actor/clip_frac"]) == pytest.approx(0.5)
  # pg = [-1.2, -0.5] with loss weight 1/2 each.
  assert float(metrics["actor/pg_loss"]) == pytest.approx(-0.85)


# ---------------------------------------------------------------- aggregation

# Three responses of 1, 2 and 3 loss tokens plus one fully masked response, packed in rows of
# 4 tokens: row 0 = [a, b, b, pad], row 1 = [c, c, c, d] where d is in no loss (L_d = 0).
# At ratio 1 each token's loss is pg = -A: a = [2], b = [1, 3], c = [3, 0, 6] -> sums 2, 4, 9.
LENGTHS = np.array([1, 2, 3, 0])
SEQ_OF_TOKEN = np.array([[0, 1, 1, -1], [2, 2, 2, 3]])
PG = np.array([[2.0, 1.0, 3.0, 0.0], [3.0, 0.0, 6.0, 0.0]])
MASK = SEQ_OF_TOKEN >= 0
MASK[1, 3] = False


def _token_weights(mode):
  weights = sequence_weights(LENGTHS, mode, max_response_len=4)
  return np.where(MASK, weights[np.maximum(SEQ_OF_TOKEN, 0)], 0.0).astype(np.float32)


def test_sequence_weights_hand_values():
  # N counts the 3 responses with tokens; the empty one gets 0.
  np.testing.assert_allclose(sequence_weights(LENGTHS, "token_mean", 4), [1/6, 1/6, 1/6, 0])
  np.testing.assert_allclose(sequence_weights(LENGTHS, "seq_mean_token_mean", 4),
                             [1/3, 1/6, 1/9, 0])
  np.testing.assert_allclose(sequence_weights(LENGTHS, "seq_mean_token_sum", 4),
                             [1/3, 1/3, 1/3, 0])
  np.testing.assert_allclose(sequence_weights(LENGTHS, "seq_mean_token_sum_norm", 4),
                             [1/12, 1/12, 1/12, 0])
  for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
    np.testing.assert_array_equal(sequence_weights([0, 0], mode, 4), [0.0, 0.0])


@pytest.mark.parametrize("mode, expected, grad_of_last_c_token", [
    ("token_mean", 15 / 6, 6 / 6),                    # (2 + 4 + 9) / 6 tokens
    ("seq_mean_token_mean", 7 / 3, 6 / 9),            # mean(2/1, 4/2, 9/3) = mean(2, 2, 3)
    ("seq_mean_token_sum", 5.0, 6 / 3),               # mean(2, 4, 9)
    ("seq_mean_token_sum_norm", 15 / 12, 6 / 12),     # (2 + 4 + 9) / (3 * 4)
])
def test_aggregation_modes_hand_values(mode, expected, grad_of_last_c_token):
  weights = jnp.asarray(_token_weights(mode))
  args = (jnp.zeros((2, 4)), jnp.asarray(-PG), weights, weights, LossConfig(loss_agg_mode=mode))
  loss, _ = policy_loss(jnp.zeros((2, 4)), *args)
  assert float(loss) == pytest.approx(expected, rel=1e-6)
  # At r = 1 the token's gradient is -A r w = pg w.
  grad = jax.grad(lambda x: policy_loss(x, *args)[0])(jnp.zeros((2, 4)))
  assert float(grad[1, 2]) == pytest.approx(grad_of_last_c_token, rel=1e-6)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_micro_batches_sum_to_the_mini_batch_loss_and_gradient(mode):
  rng = np.random.default_rng(0)
  old_logp = jnp.asarray(rng.uniform(-3, -0.1, (2, 4)), jnp.float32)
  logp = old_logp + jnp.asarray(rng.normal(0, 0.3, (2, 4)), jnp.float32)   # some get clipped
  ref_logp = old_logp + jnp.asarray(rng.normal(0, 0.2, (2, 4)), jnp.float32)
  entropy = jnp.asarray(rng.uniform(0.5, 2.0, (2, 4)), jnp.float32)
  advantages = jnp.asarray(rng.normal(0, 1, (2, 4)), jnp.float32)
  loss_weights = jnp.asarray(_token_weights(mode))
  metric_weights = jnp.asarray(_token_weights("token_mean"))
  config = LossConfig(clip_ratio_c=3.0, kl_coef=0.05, entropy_coef=0.01, loss_agg_mode=mode)

  def run(rows, x):
    return policy_loss(x, old_logp[rows], advantages[rows], loss_weights[rows],
                       metric_weights[rows], config, ref_logp=ref_logp[rows],
                       entropy=entropy[rows])

  full_grad, full_metrics = jax.grad(lambda x: run(slice(0, 2), x), has_aux=True)(logp)
  full_loss = run(slice(0, 2), logp)[0]
  parts = [run(slice(i, i + 1), logp[i:i + 1]) for i in range(2)]
  part_grads = [jax.grad(lambda x, i=i: run(slice(i, i + 1), x)[0])(logp[i:i + 1])
                for i in range(2)]
  np.testing.assert_allclose(parts[0][0] + parts[1][0], full_loss, rtol=1e-6)
  np.testing.assert_allclose(jnp.concatenate(part_grads), full_grad, rtol=1e-6, atol=1e-8)
  assert float(jnp.abs(full_grad).sum()) > 0
  for name, value in full_metrics.items():
    np.testing.assert_allclose(parts[0][1][name] + parts[1][1][name], value, rtol=1e-5,
                               atol=1e-7, err_msg=name)


def test_masked_tokens_with_garbage_give_finite_loss_and_zero_gradient():
  weights = jnp.asarray(_token_weights("token_mean"))
  garbage = jnp.where(jnp.asarray(MASK), 0.0, jnp.array([[0, 0, 0, jnp.nan], [0, 0, 0, jnp.inf]]))
  logp = jnp.where(jnp.asarray(MASK), -0.5, -jnp.inf)
  config = LossConfig(clip_ratio_c=3.0, kl_coef=0.1, kl_estimator="k3", tis_cap=2.0,
                      entropy_coef=0.01)

  def loss_of(x, entropy):
    return policy_loss(x, -0.4 + garbage, jnp.asarray(-PG) + garbage, weights, weights, config,
                       ref_logp=-0.6 + garbage, entropy=entropy, rollout_logp=-0.3 - garbage)

  entropy = jnp.where(jnp.asarray(MASK), 1.0, jnp.nan)
  loss, metrics = loss_of(logp, entropy)
  assert np.isfinite(float(loss)) and all(np.isfinite(float(v)) for v in metrics.values())
  (grad_logp, grad_entropy), _ = jax.grad(loss_of, argnums=(0, 1), has_aux=True)(logp, entropy)
  assert np.all(np.isfinite(grad_logp)) and np.all(np.isfinite(grad_entropy))
  assert np.all(np.asarray(grad_logp)[~MASK] == 0) and np.all(np.asarray(grad_logp)[MASK] != 0)


def test_policy_loss_jits_with_the_config_static():
  weights = jnp.asarray(_token_weights("token_mean"))
  jitted = jax.jit(policy_loss, static_argnames="config")
  loss, _ = jitted(jnp.zeros((2, 4)), jnp.zeros((2, 4)), jnp.asarray(-PG), weights, weights,
                   config=LossConfig())
  assert float(loss) == pytest.approx(15 / 6, rel=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprob_and_entropy_gradient_matches_autodiff(temperature):
  """The trainer's head scoring has a hand-written gradient (one [K, V] residual): it
  equals autodiff through log-softmax, the gather and the entropy, any temperature."""
  from tlt_jax.rl.logprobs import logprob_and_entropy
  from tlt_jax.rollout.sampling import SamplingParams, policy_logprobs
  sampling = SamplingParams(temperature)
  logits = jax.random.normal(jax.random.key(0), (7, 50)) * 3
  tokens = jnp.array([1, 5, 49, 0, 3, 3, 10])
  w_logp, w_entropy = jax.random.normal(jax.random.key(1), (2, 7))

  def autodiff(z):
    logp_all = policy_logprobs(z, sampling)
    return (jnp.take_along_axis(logp_all, tokens[:, None], axis=-1)[:, 0],
            -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1))

  def objective(fn):
    return lambda z: jnp.sum(fn(z)[0] * w_logp) + jnp.sum(fn(z)[1] * w_entropy)

  ours = lambda z: logprob_and_entropy(z, tokens, sampling)
  np.testing.assert_allclose(ours(logits), autodiff(logits), rtol=1e-6)
  np.testing.assert_allclose(jax.grad(objective(ours))(logits),
                             jax.grad(objective(autodiff))(logits), atol=1e-5)


@pytest.mark.skipif(cpu_kernels.build_problem() is not None,
                    reason="the CPU kernels do not build here (no AVX2/FMA or no g++)")
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_cpu_token_logprobs_kernel_matches_reference(temperature):
  """The LM head's CPU kernel equals `logprob_and_entropy` in value and VJP: a vocabulary
  that is not a multiple of the vector width, peaked and flat rows, tokens at both ends;
  and the trainer's `token_logprobs` calls it on CPU."""
  from tlt_jax.cpu.token_logprobs import token_logprobs as cpu_token_logprobs
  from tlt_jax.rl.logprobs import logprob_and_entropy
  from tlt_jax.rollout.sampling import SamplingParams
  sampling = SamplingParams(temperature)
  k, v = 9, 1003
  logits = np.array(jax.random.normal(jax.random.key(2), (k, v)) * 4)
  logits[0, 17] = 60.0   # nearly one-hot: entropy ~0
  logits[1] = 0.25       # flat: entropy log V
  logits = jnp.asarray(logits)
  tokens = jnp.array([17, 0, v - 1, 5, 1000, 999, 3, 500, 2])
  w_logp, w_entropy = jax.random.normal(jax.random.key(3), (2, k))
  kernel = lambda z: cpu_token_logprobs(z, tokens, sampling.logprob_temperature)
  reference = lambda z: logprob_and_entropy(z, tokens, sampling)
  for got, want in zip(jax.jit(kernel)(logits), reference(logits)):
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-5)
  assert float(kernel(logits)[1][1]) == pytest.approx(math.log(v), rel=1e-6)

  def objective(fn):
    return lambda z: jnp.sum(fn(z)[0] * w_logp) + jnp.sum(fn(z)[1] * w_entropy)

  got, want = jax.jit(jax.grad(objective(kernel)))(logits), jax.grad(objective(reference))(logits)
  np.testing.assert_allclose(got, want, atol=2e-6 * float(jnp.max(jnp.abs(want))))

  from tlt_jax.models import transformer
  from tlt_jax.models.config import ModelConfig
  from tlt_jax.rl.batching import Sequences, micro_batches, pack
  from tlt_jax.rl.logprobs import token_logprobs
  config = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                       num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
  sequences = Sequences([[1, 2, 3]], [[4, 5]])
  rows = next(micro_batches(pack(sequences, [0], 8), sequences, 1, {}, {}))
  params = jax.eval_shape(lambda: transformer.init_params(config, jax.random.key(0)))
  jaxpr = jax.make_jaxpr(lambda p: token_logprobs(p, config, rows, sampling))(params)
  assert "tlt_token_logprobs_forward" in str(jaxpr)


@pytest.mark.parametrize("shards", [1, 2])
def test_micro_batch_shapes_are_the_precompiled_ones(shards):
  """Every micro-batch of any step has one of `possible_shapes` (what --precompile builds),
  and all of them turn up, with one data shard or two: row counts, the four row lengths
  `pack_tight` picks from, scored slot counts."""
  from tlt_jax.rl.batching import Sequences, micro_batches, pack_tight, possible_shapes
  rng = np.random.default_rng(0)
  shapes = set(possible_shapes(4, 256, shards))
  assert {length for _, length, _ in shapes} == {64, 128, 192, 256}
  seen = set()
  for i in range(1500):
    n = int(rng.integers(1, 24))
    longest = int(rng.choice([60, 120, 180, 250]))
    prompt_share = [0.5, 0.05, 0.95][i % 3]                           # all response shares
    prompts = [[1] * max(1, int(rng.integers(1, longest) * prompt_share)) for _ in range(n)]
    responses = [[2] * int(rng.integers(1, longest - len(p) + 1)) for p in prompts]
    sequences = Sequences(prompts, responses)
    layout = pack_tight(sequences, range(n), 256, 4, shards)
    for rows in micro_batches(layout, sequences, 4, {}, {}, shards=shards):
      seen.add((rows.tokens.shape[0], rows.tokens.shape[1], rows.scored_slots.shape[0]))
  assert seen == shapes, (sorted(shapes - seen), sorted(seen - shapes))


def test_pack_tight_takes_the_row_length_that_computes_fewest_slots():
  """Short samples go in short rows, a long one forces long rows, and a choice between
  one long row and more short ones counts the padding rows of the micro-batches."""
  from tlt_jax.rl.batching import Sequences, pack_tight, row_counts, row_lengths
  assert row_lengths(960) == [256, 512, 768, 960] and row_lengths(32) == [32]
  seqs = lambda lengths: Sequences([[1]] * len(lengths), [[2] * (n - 1) for n in lengths])
  short = seqs([50, 60, 40, 30])
  assert pack_tight(short, range(4), 960, 2, 2).seq_len == 256
  with_long = seqs([50, 60, 700])
  assert pack_tight(with_long, range(3), 960, 2, 2).seq_len == 768
  # 3 x 200 slots: one row of 768 (padded to 2 rows: 1536 slots) against 3 rows of 256
  # (padded to 4: 1024 slots) or 2 of 512 (1024 slots: the shorter rows win the tie).
  three = seqs([200, 200, 200])
  layout = pack_tight(three, range(3), 960, 2, 2)
  assert layout.seq_len == 256
  assert sum(row_counts(layout.num_rows, 2, 2)) * layout.seq_len == 1024

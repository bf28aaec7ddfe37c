"""The policy loss of the RL train step, per token over packed rows [R, T], and the
per-sequence weights that make it add up across micro-batches.

Every aggregation mode is a weighted token sum: the loss of a mini-batch is
sum_i w_i * sum_t l_it. The learner gives each token its sequence's weight, so the losses
(and gradients) of the packed micro-batches of a mini-batch sum to exactly the mini-batch
aggregate, however the sequences were packed.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.rl.config import KL_ESTIMATORS, LOSS_AGG_MODES, LossConfig

# exp of a log-ratio beyond this is clamped: e^20 ~ 5e8 is far past any clip range, and
# e^89 already overflows float32.
LOG_RATIO_LIMIT = 20.0


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, estimator: str) -> jax.Array:
  """Per-token estimate of KL(policy || reference) from sampled tokens, log r = logp - ref.

  k1 = log r; k2 = (log r)^2 / 2; k3 = exp(-log r) - 1 + log r (>= 0, low variance). For
  k3, log r is clamped to [-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT] first so exp cannot overflow
  (the gradient is zero past the clamp); expm1 keeps small values accurate.
  """
  log_ratio = logp - ref_logp
  if estimator == "k1":
    return log_ratio
  if estimator == "k2":
    return 0.5 * jnp.square(log_ratio)
  if estimator == "k3":
    log_ratio = jnp.clip(log_ratio, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return jnp.expm1(-log_ratio) + log_ratio
  raise ValueError(f"kl estimator {estimator!r}: expected one of {', '.join(KL_ESTIMATORS)}")


def sequence_weights(response_lengths, mode: str, max_response_len: int) -> np.ndarray:
  """float32 [N]: w_i such that the mini-batch loss is sum_i w_i * sum_t l_it.

  `response_lengths` are the loss-mask token counts of the mini-batch's N responses.
  Fully masked responses (L_i == 0, e.g. dropped as overlong) get weight 0 and are not
  counted in N, as verl's seq-mean modes do, so masking a response never dilutes the rest.
    token_mean:              1 / sum_j L_j
    seq_mean_token_mean:     1 / (N * L_i)
    seq_mean_token_sum:      1 / N
    seq_mean_token_sum_norm: 1 / (N * max_response_len)
  token_mean weights are also the right `metric_weights` for `policy_loss`.
  """
  lengths = np.asarray(response_lengths, np.int64)
  if np.any(lengths < 0):
    raise ValueError(f"response lengths must be >= 0, got {lengths.min()}")
  counted = lengths > 0
  num_seqs = max(int(counted.sum()), 1)
  if mode == "token_mean":
    weights = np.full(lengths.shape, 1.0 / max(int(lengths.sum()), 1))
  elif mode == "seq_mean_token_mean":
    weights = 1.0 / (num_seqs * np.maximum(lengths, 1))
  elif mode == "seq_mean_token_sum":
    weights = np.full(lengths.shape, 1.0 / num_seqs)
  elif mode == "seq_mean_token_sum_norm":
    if max_response_len < 1:
      raise ValueError(f"max_response_len={max_response_len}: must be >= 1")
    weights = np.full(lengths.shape, 1.0 / (num_seqs * max_response_len))
  else:
    raise ValueError(f"loss_agg_mode {mode!r}: expected one of {', '.join(LOSS_AGG_MODES)}")
  return np.where(counted, weights, 0.0).astype(np.float32)


def policy_loss(logp, old_logp, advantages, loss_weights, metric_weights, config: LossConfig,
                ref_logp=None, entropy=None, rollout_logp=None):
  """(loss scalar, metrics dict of scalars) of one micro-batch; all inputs per token.

  `loss_weights` are the tokens' sequence weights (`sequence_weights`; 0 outside the loss),
  `metric_weights` token-mean weights over the whole mini-batch (mask / its token count),
  so both the loss and the metrics sum over micro-batches. Per token: the PPO-clipped
  surrogate max(-A r, -A clip(r, 1 - low, 1 + high)) with r = exp(logp - old_logp); dual
  clip caps it at -A c where A < 0; truncated IS multiplies it by the constant
  min(exp(old_logp - rollout_logp), tis_cap) when `rollout_logp` is given (None means the
  old log-probs are the rollout's own: weight 1). Then loss = sum w pg + kl_coef sum w kl
  - entropy_coef sum w entropy. Only `logp` (and `entropy`) carry gradients.

  Tokens with zero loss and metric weight may hold anything (padding, nan, inf): their
  inputs are replaced by 0 before any arithmetic, so neither values nor gradients go nan.
  """
  if config.kl_coef > 0 and ref_logp is None:
    raise ValueError(f"kl_coef={config.kl_coef} needs ref_logp (reference log-probs)")
  if config.entropy_coef > 0 and entropy is None:
    raise ValueError(f"entropy_coef={config.entropy_coef} needs the per-token entropy")
  loss_weights = jnp.asarray(loss_weights, jnp.float32)
  metric_weights = jnp.asarray(metric_weights, jnp.float32)
  live = (loss_weights != 0) | (metric_weights != 0)

  def clean(x, constant=True):
    x = jnp.where(live, jnp.asarray(x, jnp.float32), 0.0)
    return jax.lax.stop_gradient(x) if constant else x

  def loss_sum(x):
    return jnp.sum(loss_weights * x)

  def metric_mean(x):
    return jnp.sum(metric_weights * x)

  logp = clean(logp, constant=False)
  old_logp = clean(old_logp)
  advantages = clean(advantages)
  ratio = jnp.exp(jnp.clip(logp - old_logp, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
  pg_unclipped = -advantages * ratio
  clipped_ratio = jnp.clip(ratio, 1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
  pg_clipped = -advantages * clipped_ratio
  pg = jnp.maximum(pg_unclipped, pg_clipped)
  metrics = {"actor/clip_frac": metric_mean(pg_clipped > pg_unclipped),
             "actor/ratio_mean": metric_mean(ratio)}
  if config.clip_ratio_c is not None:
    pg_dual = -advantages * config.clip_ratio_c
    dual_active = (advantages < 0) & (pg > pg_dual)
    pg = jnp.where(dual_active, pg_dual, pg)
    metrics["actor/clip_frac_dual"] = metric_mean(dual_active)
  if config.tis_cap is not None and rollout_logp is not None:
    # min(exp(x), cap) == exp(min(x, log cap)): the same weight, without overflow.
    tis_weight = jnp.exp(jnp.minimum(old_logp - clean(rollout_logp), np.log(config.tis_cap)))
    pg = pg * tis_weight
    metrics["actor/tis_weight_mean"] = metric_mean(tis_weight)
  pg_loss = loss_sum(pg)
  loss = pg_loss
  metrics["actor/pg_loss"] = pg_loss
  if ref_logp is not None:
    kl = kl_penalty(logp, clean(ref_logp), config.kl_estimator)
    metrics["actor/kl"] = metric_mean(kl)
    if config.kl_coef > 0:
      loss = loss + config.kl_coef * loss_sum(kl)
  if entropy is not None:
    entropy = clean(entropy, constant=False)
    metrics["actor/entropy"] = metric_mean(entropy)
    if config.entropy_coef > 0:
      loss = loss - config.entropy_coef * loss_sum(entropy)
  return loss, {name: jax.lax.stop_gradient(value) for name, value in metrics.items()}

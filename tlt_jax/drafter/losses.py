"""The EAGLE drafter loss: regress the target's next hidden state and match its next-token
distribution, on response slots only.

Both terms read logits through the draft head. With a reduced draft vocabulary the soft-CE
target is the target's distribution restricted to the draft vocabulary and renormalized,
which is just the softmax of the target's logits over those ids: the drafter can only ever
propose draft-vocabulary tokens, so matching their relative probabilities is what raises
acceptance, and no full-vocabulary head pass is needed.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from tlt_jax.models.drafter import draft_logits

CE_WEIGHT = 0.1


def smooth_l1(pred: jax.Array, target: jax.Array, beta: float = 1.0) -> jax.Array:
  """Elementwise Huber-style loss (torch's SmoothL1Loss, beta=1)."""
  diff = jnp.abs(pred.astype(jnp.float32) - target.astype(jnp.float32))
  return jnp.where(diff < beta, 0.5 * diff * diff / beta, diff - 0.5 * beta)


def eagle_loss(pred_hidden: jax.Array, target_hidden: jax.Array, head: jax.Array,
               weights: jax.Array, ce_weight: float = CE_WEIGHT
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """pred/target hidden [..., E], head [E, Vd], weights [...] (0 on slots not trained).

  Returns the weighted mean of SmoothL1 (mean over E) + ce_weight * soft-CE, and metrics
  including top-1 accuracy (drafter argmax == target argmax within the draft vocabulary,
  what greedy decoding accepts) and `sampled_accept`, sum_v min(p_v, q_v): how often one
  draft drawn from q at T=1 passes rejection sampling against p at T=1 (both over the
  draft vocabulary, so tokens outside it make it an upper bound).
  """
  target_hidden = jax.lax.stop_gradient(target_hidden)
  regression = jnp.mean(smooth_l1(pred_hidden, target_hidden), axis=-1)
  target_logits = draft_logits(head, target_hidden)
  pred_logits = draft_logits(head, pred_hidden)
  target_probs = jax.nn.softmax(target_logits, axis=-1)
  pred_logprobs = jax.nn.log_softmax(pred_logits, axis=-1)
  soft_ce = -jnp.sum(target_probs * pred_logprobs, axis=-1)
  sampled_accept = jnp.sum(jnp.minimum(target_probs, jnp.exp(pred_logprobs)), axis=-1)
  hits = jnp.argmax(pred_logits, axis=-1) == jnp.argmax(target_logits, axis=-1)

  weights = weights.astype(jnp.float32)
  count = jnp.sum(weights)
  mean = lambda x: jnp.sum(weights * x) / jnp.maximum(count, 1.0)
  loss = mean(regression + ce_weight * soft_ce)
  return loss, {"loss": loss, "smooth_l1": mean(regression), "soft_ce": mean(soft_ce),
                "top1_acc": mean(hits.astype(jnp.float32)),
                "sampled_accept": mean(sampled_accept), "trained_slots": count}

"""Per-token log-probs (and entropies) of packed rows under a policy: what the trainer scores.

The rollout engine reports the policy's temperature-scaled, untruncated log-probs of each
emitted token (`sampling.policy_logprobs`); the trainer scores with that same function, so
the two differ only by rounding (reported as `rollout/logprob_diff_*`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tlt_jax.cpu import kernels
from tlt_jax.cpu.token_logprobs import token_logprobs as cpu_token_logprobs
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.transformer import Params, forward_packed, lm_logits
from tlt_jax.rl.batching import TrainRows
from tlt_jax.rollout.sampling import SamplingParams, policy_logprobs
from tlt_jax.sharding.rules import MeshRules, spans_devices


def token_logprobs(params: Params, config: ModelConfig, rows: TrainRows,
                   sampling: SamplingParams, rules: MeshRules | None = None,
                   remat: bool = False) -> tuple[jax.Array, jax.Array]:
  """(logp, entropy) [R, T]: slot j's log-prob of the token at j + 1 and the entropy of
  slot j's distribution, at the response slots `rows.scored_slots`; 0 elsewhere (only
  those slots go through the LM head)."""
  hidden = forward_packed(params, config, rows.tokens, rows.positions, rows.segment_ids,
                          rules, remat)
  r, t, e = hidden.shape
  slots = rows.scored_slots
  take = lambda x: jnp.take(x.reshape(r * t, *x.shape[2:]), slots, axis=0, mode="clip")
  next_tokens = take(jnp.pad(rows.tokens[:, 1:], ((0, 0), (0, 1))))
  logits = lm_logits(params, config, take(hidden), rules)
  if kernels.enabled(logits.dtype) and not spans_devices(rules):
    logp, entropy = cpu_token_logprobs(logits, next_tokens, sampling.logprob_temperature)
  else:
    logp, entropy = logprob_and_entropy(logits, next_tokens, sampling)
  # Padding entries point past the last slot: the gather clamps them, the scatter drops them.
  scatter = lambda x: jnp.zeros((r * t,), x.dtype).at[slots].set(x, mode="drop").reshape(r, t)
  return scatter(logp), scatter(entropy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def logprob_and_entropy(logits: jax.Array, tokens: jax.Array, sampling: SamplingParams
                        ) -> tuple[jax.Array, jax.Array]:
  """(log-prob of `tokens` [K], entropy [K]) under `policy_logprobs(logits [K, V])`; the
  reference of the CPU kernel `tlt_jax.cpu.token_logprobs`.

  Its gradient keeps one [K, V] residual (the log-probs) and forms d/dlogits in one pass;
  autodiff through log-softmax, exp and the gather kept several [K, V] buffers, the
  largest part of a training micro-batch's memory after the layers' activations."""
  return _logprob_and_entropy_fwd(logits, tokens, sampling)[0]


def _logprob_and_entropy_fwd(logits, tokens, sampling):
  logp_all = policy_logprobs(logits, sampling)
  logp = jnp.take_along_axis(logp_all, tokens[:, None], axis=-1)[:, 0]
  entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
  # The empty array carries the logits' dtype to the backward pass.
  return (logp, entropy), (logp_all, tokens, entropy, jnp.zeros((0,), logits.dtype))


def _logprob_and_entropy_bwd(sampling, residuals, cotangents):
  # With z = logits / scale and p = softmax(z): d logp[t] / dz = onehot(t) - p and
  # d entropy / dz = -p * (log p + entropy).
  logp_all, tokens, entropy, like = residuals
  d_logp, d_entropy = cotangents
  p = jnp.exp(logp_all)
  onehot = jnp.arange(logp_all.shape[-1]) == tokens[:, None]
  d_z = (d_logp[:, None] * (onehot - p)
         - d_entropy[:, None] * p * (logp_all + entropy[:, None]))
  return (d_z / sampling.logprob_temperature).astype(like.dtype), None


logprob_and_entropy.defvjp(_logprob_and_entropy_fwd, _logprob_and_entropy_bwd)


@functools.partial(jax.jit, static_argnames=("config", "sampling", "rules"))
def score_rows(params: Params, rows: TrainRows, *, config: ModelConfig,
               sampling: SamplingParams, rules: MeshRules | None = None) -> jax.Array:
  """Log-probs [R, T] without a gradient: the reference policy's, or the old policy's
  when a step makes several updates."""
  return token_logprobs(params, config, rows, sampling, rules)[0]

"""Per-token log-probs (and entropies) of packed rows under a policy: what the trainer scores.

The rollout engine reports the policy's temperature-scaled, untruncated log-probs of each
emitted token (`sampling.policy_logprobs`); the trainer scores that same distribution
(`ops.token_logprobs`), so the two differ only by rounding (reported as
`rollout/logprob_diff_*`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tlt_jax import ops, reference_ops
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.transformer import Params, forward_packed, lm_logits
from tlt_jax.rl.batching import TrainRows
from tlt_jax.rl.precision import compute_params
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.sharding import data_parallel
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
  logp, entropy = ops.token_logprobs(logits, next_tokens, sampling.logprob_temperature,
                                     sharded=spans_devices(rules))
  # Padding entries point past the last slot: the gather clamps them, the scatter drops them.
  scatter = lambda x: jnp.zeros((r * t,), x.dtype).at[slots].set(x, mode="drop").reshape(r, t)
  return scatter(logp), scatter(entropy)


def logprob_and_entropy(logits: jax.Array, tokens: jax.Array, sampling: SamplingParams
                        ) -> tuple[jax.Array, jax.Array]:
  """(log-prob of `tokens` [K], entropy [K]) under `policy_logprobs(logits [K, V])`, by the
  jnp reference (`reference_ops.token_logprobs`, which has a one-pass backward)."""
  return reference_ops.token_logprobs(logits, tokens, sampling.logprob_temperature)


@functools.partial(jax.jit, static_argnames=("config", "sampling", "rules", "compute_dtype"))
def score_rows(params: Params, rows: TrainRows, *, config: ModelConfig,
               sampling: SamplingParams, rules: MeshRules | None = None,
               compute_dtype: str | None = None) -> jax.Array:
  """Log-probs [R, T] without a gradient: the reference policy's, or the old policy's
  when a step makes several updates; computed in compute_dtype (None: the params'). With
  several data shards each scores its own rows (`data_parallel`)."""
  def score(params, rows, rules):
    return token_logprobs(compute_params(params, compute_dtype), config, rows, sampling,
                          rules)[0]
  if data_parallel.data_shards(rules) == 1:
    return score(params, rows, rules)
  return data_parallel.per_shard(score, rules, in_specs=(data_parallel.WHOLE,
                                                         data_parallel.SHARDED),
                                 out_specs=data_parallel.SHARDED)(params, rows)

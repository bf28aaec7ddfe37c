"""Lossless acceptance rules for speculative sampling.

`rejection_chain` is the Leviathan et al. / Chen et al. rule along a chain of drafts
sampled from q: accept draft i with probability min(1, p_i(x)/q_i(x)); at the first
rejection emit a token from norm(max(0, p_i - q_i)); if every draft is accepted, emit a
bonus token from the last p. Each emitted token is then distributed exactly as p.

Trees use the target-only rule instead (see speculative.py): it needs no q, so drafts may
be picked deterministically (top-k), at the price of accepting a node only with
probability p(node) rather than min(1, p/q).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from tlt_jax.rollout.sampling import categorical


def residual_probs(p: jax.Array, q: jax.Array) -> jax.Array:
  """norm(max(0, p - q)); falls back to p where p <= q everywhere (then never used)."""
  residual = jnp.maximum(p - q, 0.0)
  total = jnp.sum(residual, axis=-1, keepdims=True)
  return jnp.where(total > 0, residual / jnp.where(total > 0, total, 1.0), p)


def rejection_chain(key: jax.Array, target_probs: jax.Array, draft_probs: jax.Array,
                    draft_tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Accepts a prefix of a drafted chain.

  target_probs [B, d+1, V]: p at the root and after each draft; draft_probs [B, d, V]: the
  q each draft was sampled from; draft_tokens [B, d]. Returns (number of accepted drafts
  [B], the token emitted after them [B]).
  """
  b, d = draft_tokens.shape
  accept_key, sample_key = jax.random.split(key)
  p_draft = jnp.take_along_axis(target_probs[:, :d], draft_tokens[:, :, None], axis=-1)[..., 0]
  q_draft = jnp.take_along_axis(draft_probs, draft_tokens[:, :, None], axis=-1)[..., 0]
  u = jax.random.uniform(accept_key, (b, d))
  accepted = u * q_draft < p_draft           # u < p/q without dividing by q = 0
  num_accepted = jnp.sum(jnp.cumprod(accepted, axis=1), axis=1)
  rows = jnp.arange(b)
  p_next = target_probs[rows, num_accepted]
  padded_q = jnp.concatenate([draft_probs, jnp.zeros_like(draft_probs[:, :1])], axis=1)
  next_probs = residual_probs(p_next, padded_q[rows, num_accepted])   # q = 0 for the bonus
  return num_accepted, categorical(sample_key, jnp.log(next_probs))

"""Token sampling: temperature, top-k and top-p, as one processed distribution.

Plain decoding and speculative verification both sample from `processed_logprobs`, which
is what makes speculative decoding lossless with respect to plain decoding.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tlt_jax.errors import UserInputError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  temperature: float = 1.0   # 0 means greedy
  top_p: float = 1.0         # nucleus mass kept; 1 disables
  top_k: int = 0             # 0 disables

  def __post_init__(self):
    if not self.temperature >= 0:
      raise UserInputError(f"--temperature={self.temperature}: must be >= 0")
    if not 0 < self.top_p <= 1:
      raise UserInputError(f"--top_p={self.top_p}: must be in (0, 1]")
    if self.top_k < 0:
      raise UserInputError(f"--top_k={self.top_k}: must be >= 0")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


def policy_logprobs(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """Log-probs reported for emitted tokens: the temperature-scaled policy, untruncated.

  This is what an RL learner recomputes, so top-k/top-p (sampling-only transforms) are not
  applied; greedy decoding reports the raw (T=1) log-probs.
  """
  scale = 1.0 if params.greedy else params.temperature
  return jax.nn.log_softmax(logits.astype(jnp.float32) / scale, axis=-1)


def processed_logprobs(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """Log-probs of the distribution tokens are actually drawn from (-inf outside support)."""
  logits = logits.astype(jnp.float32)
  if params.greedy:
    top = jnp.argmax(logits, axis=-1)
    return jnp.where(jax.nn.one_hot(top, logits.shape[-1], dtype=bool), 0.0, -jnp.inf)
  logits = logits / params.temperature
  if params.top_k:
    kth = jax.lax.top_k(logits, params.top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if params.top_p < 1.0:
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before
    # it is still below top_p. The threshold is the smallest kept logit.
    kept = mass_before < params.top_p
    threshold = jnp.min(jnp.where(kept, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < threshold, -jnp.inf, logits)
  return jax.nn.log_softmax(logits, axis=-1)


def sample(key: jax.Array, logits: jax.Array, params: SamplingParams) -> jax.Array:
  """Draws one token per row of logits [..., V] from the processed distribution."""
  if params.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, processed_logprobs(logits, params), axis=-1).astype(jnp.int32)

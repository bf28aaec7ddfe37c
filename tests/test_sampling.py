"""The sampling primitives: the fast argmax agrees with jnp.argmax (ties included), the
inverse-CDF draw follows the processed distribution (across blocks, with unreachable
tokens), and the emitted tokens' log-probs are the policy's."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.rollout.sampling import (SamplingParams, argmax, categorical, policy_logprob_of,
                                     policy_logprobs, processed_logprobs, sample)


@pytest.mark.parametrize("shape", [(7,), (3, 49), (2, 5, 1000)])
def test_argmax_equals_jnp_argmax(shape):
  x = jax.random.normal(jax.random.key(0), shape)
  np.testing.assert_array_equal(argmax(x), jnp.argmax(x, axis=-1))


def test_argmax_takes_the_first_of_tied_maxima():
  x = jnp.array([[0.0, 2.0, 1.0, 2.0], [-jnp.inf, -jnp.inf, 3.0, 3.0], [5.0, 5.0, 5.0, 5.0]])
  np.testing.assert_array_equal(argmax(x), [1, 2, 0])
  assert argmax(x).dtype == jnp.int32


def test_categorical_follows_top_p_processed_distribution():
  from scipy.stats import chisquare
  logits = jnp.log(jnp.array([0.4, 0.3, 0.15, 0.1, 0.05]))
  params = SamplingParams(temperature=0.7, top_p=0.9)
  probs = np.exp(np.asarray(processed_logprobs(logits, params), np.float64))
  n = 40_000
  draws = sample(jax.random.key(3), jnp.broadcast_to(logits, (n, 5)), params)
  observed = np.bincount(np.asarray(draws), minlength=5)
  support = probs > 0
  assert observed[~support].sum() == 0, "drew a token outside the top-p support"
  _, p_value = chisquare(observed[support], probs[support] / probs[support].sum() * n)
  assert p_value > 1e-3, (observed, probs * n)


def test_categorical_never_draws_minus_inf_logits():
  logits = jnp.array([-jnp.inf, 0.0, -jnp.inf, 1.0])
  draws = categorical(jax.random.key(0), jnp.broadcast_to(logits, (5000, 4)))
  assert set(np.unique(np.asarray(draws)).tolist()) == {1, 3}


def test_categorical_follows_a_distribution_spread_over_blocks():
  """V = 1000 is not a multiple of the 256-token block: mass in four blocks (one padded),
  whole blocks and single tokens at -inf in between."""
  from scipy.stats import chisquare
  support = np.array([3, 4, 255, 256, 600, 700, 999])
  weights = np.array([0.05, 0.2, 0.1, 0.3, 0.15, 0.01, 0.19])
  logits = np.full(1000, -np.inf, np.float32)
  logits[support] = np.log(weights) + 7.0       # unnormalized
  n = 60_000
  draws = np.asarray(categorical(jax.random.key(5), jnp.broadcast_to(logits, (n, 1000))))
  assert set(np.unique(draws).tolist()) <= set(support.tolist()), "drew an unreachable token"
  observed = np.array([(draws == t).sum() for t in support])
  _, p_value = chisquare(observed, weights * n)
  assert p_value > 1e-3, (observed, weights * n)


def test_categorical_draws_the_only_token_with_mass_whatever_the_uniform():
  """A single reachable token at either end of a block is drawn on every row: rounding at
  the edges of the cumulative mass never lands on an unreachable neighbour."""
  for token in (0, 255, 256, 511):
    logits = jnp.full((2000, 512), -jnp.inf).at[:, token].set(3.0)
    np.testing.assert_array_equal(categorical(jax.random.key(token), logits), token)


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.6, top_k=5),
                                    SamplingParams(0.0)])
def test_policy_logprob_of_reads_policy_logprobs_at_the_tokens(params):
  logits = jax.random.normal(jax.random.key(1), (3, 4, 300)) * 4
  tokens = jax.random.randint(jax.random.key(2), (3, 4), 0, 300)
  expected = jnp.take_along_axis(policy_logprobs(logits, params), tokens[..., None], -1)[..., 0]
  np.testing.assert_allclose(policy_logprob_of(logits, tokens, params), expected, atol=1e-5)

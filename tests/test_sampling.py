"""The sampling primitives: the fast argmax agrees with jnp.argmax (ties included) and the
Gumbel-max draw follows the processed distribution."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.rollout.sampling import SamplingParams, argmax, categorical, processed_logprobs, sample


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

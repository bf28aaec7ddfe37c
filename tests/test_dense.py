"""The seam's `dense` (on CPU, a hand-written backward laid out for XLA:CPU) equals
autodiff's of `x @ w`."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.ops import dense


@pytest.mark.parametrize("x_shape", [(5, 7), (2, 3, 7)])
def test_dense_grad_equals_autodiff(x_shape):
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], x_shape)
  w = jax.random.normal(keys[1], (7, 4))
  probe = jax.random.normal(keys[2], x_shape[:-1] + (4,))
  loss = lambda f: (lambda x, w: jnp.sum(jnp.sin(f(x, w)) * probe))
  ours = jax.jit(jax.grad(loss(dense), argnums=(0, 1)))(x, w)
  reference = jax.jit(jax.grad(loss(lambda x, w: x @ w), argnums=(0, 1)))(x, w)
  np.testing.assert_allclose(dense(x, w), x @ w, rtol=1e-6)
  for got, want in zip(ours, reference):
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_dense_backward_keeps_input_dtypes():
  x = jnp.ones((3, 4), jnp.bfloat16)
  w = jnp.ones((4, 2), jnp.bfloat16)
  dx, dw = jax.grad(lambda x, w: jnp.sum(dense(x, w).astype(jnp.float32)), argnums=(0, 1))(x, w)
  assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(dx, np.float32), 2.0)
  np.testing.assert_array_equal(np.asarray(dw, np.float32), 3.0)

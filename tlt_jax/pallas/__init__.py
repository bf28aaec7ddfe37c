"""Hand-written kernels, each beside the plain-jnp reference it must match."""

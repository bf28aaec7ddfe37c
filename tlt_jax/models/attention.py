"""The attention of every model here, at its old import path: it is
`tlt_jax.reference_ops.attend` (with MASKED), the plain-jnp reference behind the kernel seam
(`tlt_jax.ops.attention`). Kept for the scripts that still import it from here."""
from tlt_jax.reference_ops import MASKED, attend

__all__ = ["MASKED", "attend"]

"""Huge-page malloc moved to tlt_jax/runtime/host.py; this name stays only until
benchmarks/decode.py and benchmarks/rl_step.py import it from there."""
from tlt_jax.runtime.host import (huge_pages_available, reexec_with_huge_pages,  # noqa: F401
                                  tunables_with_huge_pages, tunables_without_huge_pages)

"""The kernel seam: every op the models run whose implementation depends on the machine, as
a table of registered implementations beside its plain-jnp reference
(`tlt_jax.reference_ops`), and the one place that chooses among them. Model code calls
these functions and never asks which backend it runs on.

  op              implementations (IMPLEMENTATIONS[op])
  dense           reference (x @ w); cpu (XLA's dot, backward laid out for the CPU,
                  `tlt_jax.cpu.dense`); packed (C++ kernel over the rollout layout's packed
                  panels, `tlt_jax.cpu.packed_matmul`)
  logits          reference (float32 einsum); packed
  attention       reference; pallas, triton (GPU, `tlt_jax.pallas`); cpu (C++ kernel,
                  `tlt_jax.cpu.attention`): new tokens against a KV cache (decode, verify,
                  prefill)
  self_attention  reference; cpu (C++ kernel with its own backward,
                  `tlt_jax.cpu.self_attention`): the trainer's packed rows, no cache
  token_logprobs  reference; cpu (`tlt_jax.cpu.token_logprobs`): the trainer's LM-head
                  softmax

How one is chosen: per platform a program is lowered for (`by_platform`: the choice is
staged with `lax.platform_dependent` and settled when lowering, so a program exported here
for a GPU or TPU holds that platform's implementations, never a CPU-only kernel). On CPU
the C++ kernels run where `tlt_jax.cpu.kernels.enabled` says (TLT_JAX_CPU_KERNELS, the
CPU's flags, float32) on one device's buffers (operands split over several devices take
the reference); attention runs Pallas on GPU; the rest is the reference. A packed weight
(`PackedWeight`) exists only in the rollout's layout (`tlt_jax.rollout.weights`, where
`packs_weights` says), never in the params a trainer or checkpoint holds, and takes the
packed kernel wherever it is passed.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from tlt_jax import reference_ops
from tlt_jax.cpu import attention as cpu_attention
from tlt_jax.cpu import dense as cpu_dense
from tlt_jax.cpu import kernels as cpu_kernels
from tlt_jax.cpu import packed_matmul
from tlt_jax.cpu import self_attention as cpu_self_attention
from tlt_jax.cpu import token_logprobs as cpu_token_logprobs
from tlt_jax.cpu.packed_matmul import PackedWeight
from tlt_jax.pallas.tree_attention import tree_attention_pallas
from tlt_jax.pallas.tree_attention_triton import tree_attention_triton

Weight = jax.Array | PackedWeight
ATTENTION_IMPLS = ("auto", "reference", "pallas", "triton", "cpu")
# Activations of the kernels' forward passes that their backward passes read: a training
# checkpoint policy keeps them rather than rerun the forward.
SAVED_RESIDUALS = cpu_self_attention.RESIDUALS

IMPLEMENTATIONS: dict[str, dict[str, Callable]] = {
    "dense": {"reference": reference_ops.matmul, "cpu": cpu_dense.dense,
              "packed": packed_matmul.packed_matmul},
    "logits": {"reference": reference_ops.logits, "packed": packed_matmul.packed_matmul},
    "attention": {"reference": reference_ops.attend, "pallas": tree_attention_pallas,
                  "triton": tree_attention_triton, "cpu": cpu_attention.cpu_attention},
    "self_attention": {"reference": reference_ops.self_attention,
                       "cpu": cpu_self_attention.self_attention},
    "token_logprobs": {"reference": reference_ops.token_logprobs,
                       "cpu": cpu_token_logprobs.token_logprobs},
}


def register(op: str, name: str, implementation: Callable) -> None:
  """Adds (or replaces) an implementation of `op`, called with the reference's arguments."""
  IMPLEMENTATIONS[op][name] = implementation


# ---- weights ---------------------------------------------------------------------------

def packs_weights(dtype, platform: str | None = None) -> bool:
  """Whether the rollout's layout holds matrices of this dtype packed for the CPU matmul
  kernel, for programs on `platform` (None: this process's default backend): float32 where
  the CPU kernels run."""
  return (platform or _default_platform()) == "cpu" and cpu_kernels.enabled(dtype)


def pack(w: jax.Array) -> PackedWeight:
  """A weight [..., K, N] as the packed kernel's column panels (exact: only moves values)."""
  return packed_matmul.pack(w)


_pack_jitted = jax.jit(packed_matmul.pack)


def pack_like(w: jax.Array, like: Weight) -> Weight:
  """`w` laid out as `like` is: packed where `like` is packed, else as it is."""
  return _pack_jitted(w) if isinstance(like, PackedWeight) else w


def dense(x: jax.Array, w: Weight) -> jax.Array:
  """x [..., in] @ w [in, out]. The cpu variant is XLA's own ops (only its backward is laid
  out for the CPU), valid on every platform: it is chosen by this process's backend, not
  staged per platform (`by_platform`), which would trace each of a model's matmuls twice."""
  if isinstance(w, PackedWeight):
    impl = "packed"
  else:
    impl = "cpu" if _default_platform() == "cpu" else "reference"
  return IMPLEMENTATIONS["dense"][impl](x, w)


def dense_shared_input(x: jax.Array, weights: Sequence[Weight]) -> tuple[jax.Array, ...]:
  """`dense(x, w)` for each weight; packed weights in one kernel call (one fork-join)."""
  if all(isinstance(w, PackedWeight) for w in weights):
    return packed_matmul.packed_matmuls(x, weights)
  return tuple(dense(x, w) for w in weights)


def logits(hidden: jax.Array, head: Weight) -> jax.Array:
  """Float32 logits [..., V] from hidden states [..., E] and an LM head [E, V]."""
  impl = "packed" if isinstance(head, PackedWeight) else "reference"
  return IMPLEMENTATIONS["logits"][impl](hidden, head)


# ---- choosing by platform ------------------------------------------------------------

# The platforms a program can be lowered for; 'gpu' (what `jax.default_backend` says on
# either GPU) stands for cuda and rocm.
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def _default_platform() -> str:
  return jax.default_backend()


def by_platform(args: tuple, chosen: dict[str, str], implementations: dict[str, Callable]):
  """`implementations[chosen[p]](*args)` on the platform p the program is lowered for: the
  choice is staged with `lax.platform_dependent`, so a program lowered here for another
  platform (`jit(f).trace(...).lower(lowering_platforms=...)`, `jax.export`) holds that
  platform's implementation, not this process's. One implementation everywhere is called
  directly."""
  if len(set(chosen.values())) == 1:
    return implementations[next(iter(chosen.values()))](*args)
  return jax.lax.platform_dependent(
      *args, **{p: implementations[name] for p, name in chosen.items()})


# ---- attention -------------------------------------------------------------------------

# The trainer's packed rows (no cache): `auto` among implementations with a backward pass of
# their own (the CPU self-attention kernel), else the reference, which training
# differentiates through (a compiled kernel's backward is the reference's).
TRAINING_AUTO = "auto_training"


def resolve_attention(impl: str, platform: str | None = None, sharded: bool = False) -> str:
  """The implementation `impl` runs as on `platform` (None: this process's default
  backend): 'auto' -> the Pallas kernel on GPU (cuda, rocm); on CPU the C++ kernel where the
  CPU kernels run and the operands are not sharded (it sees one device's buffers); the
  reference elsewhere (TPU) and for `TRAINING_AUTO` off the CPU."""
  if impl not in ATTENTION_IMPLS + (TRAINING_AUTO,):
    raise ValueError(f"tree attention impl must be one of {', '.join(ATTENTION_IMPLS)}; "
                     f"got {impl!r}")
  if impl not in ("auto", TRAINING_AUTO):
    return impl
  platform = platform or _default_platform()
  if platform in ("gpu", "cuda", "rocm") and impl == "auto":
    return "pallas"
  if platform == "cpu" and not sharded and cpu_kernels.enabled(jnp.float32):
    return "cpu"
  return "reference"


def attention(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, cache_mask: jax.Array,
              k: jax.Array, v: jax.Array, new_mask: jax.Array, *, impl: str = "auto",
              interpret: bool | None = None, sharded: bool = False) -> jax.Array:
  """`reference_ops.attend` by an implementation, chosen for each platform the program is
  lowered for (`resolve_attention`, `by_platform`); interpret=None compiles Pallas on GPU
  and TPU and interprets it elsewhere. On CPU, over cpu_attention.MAX_NEW_TOKENS new tokens
  without a cache (the trainer's packed rows) take the self-attention kernel; with a cache
  (a prefill) they take the reference; under 'auto', operands a kernel does not take
  (bfloat16) do too."""
  args = (q, cache_k, cache_v, cache_mask, k, v, new_mask)
  chosen = {}
  for platform in PLATFORMS:
    chosen[platform] = resolve_attention(impl, platform, sharded)
    if chosen[platform] == "cpu":
      chosen[platform] = _cpu_attention_path(q, cache_k, cache_v, k, v,
                                             strict=impl == "cpu")
  # Under 'auto' Pallas runs only where it compiles: no interpreted variant to trace.
  if impl == "auto" and interpret is None:
    interpret = False
  implementations = {
      "reference": IMPLEMENTATIONS["attention"]["reference"],
      "self_attention": lambda q, cache_k, cache_v, cache_mask, k, v, new_mask:
          IMPLEMENTATIONS["self_attention"]["cpu"](q, k, v, new_mask),
      **{name: functools.partial(_kernel_with_reference_vjp, impl=name, interpret=interpret)
         for name in ("pallas", "triton", "cpu")}}
  return by_platform(args, chosen, implementations)


def _cpu_attention_path(q, cache_k, cache_v, k, v, strict: bool) -> str:
  """Where the CPU backend sends attention: 'self_attention', 'cpu' or 'reference'. strict
  (the cpu impl asked for by name): operands the kernel does not take fail in it."""
  many = q.shape[1] > cpu_attention.MAX_NEW_TOKENS
  if many and cache_k.shape[2] == 0 and cpu_self_attention.supports(q, k, v):
    return "self_attention"
  if many or (not strict and not cpu_attention.supports(q, cache_k, cache_v, k, v)):
    return "reference"
  return "cpu"


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _kernel_with_reference_vjp(q, cache_k, cache_v, cache_mask, k, v, new_mask, impl: str,
                               interpret: bool) -> jax.Array:
  """A kernel forward whose backward is the reference's (`pallas_call` has no transpose
  rule, so a loss through the kernel, such as the drafter's, could not be differentiated)."""
  kernel = IMPLEMENTATIONS["attention"][impl]
  args = (q, cache_k, cache_v, cache_mask, k, v, new_mask)
  return kernel(*args, interpret=interpret) if impl == "pallas" else kernel(*args)


def _kernel_fwd(q, cache_k, cache_v, cache_mask, k, v, new_mask, impl, interpret):
  out = _kernel_with_reference_vjp(q, cache_k, cache_v, cache_mask, k, v, new_mask, impl,
                                   interpret)
  return out, (q, cache_k, cache_v, cache_mask, k, v, new_mask)


def _reference_bwd(impl, interpret, residuals, grad):
  del impl, interpret
  q, cache_k, cache_v, cache_mask, k, v, new_mask = residuals
  _, pullback = jax.vjp(lambda q, cache_k, cache_v, k, v: reference_ops.attend(
      q, cache_k, cache_v, cache_mask, k, v, new_mask), q, cache_k, cache_v, k, v)
  dq, dcache_k, dcache_v, dk, dv = pullback(grad)
  return dq, dcache_k, dcache_v, None, dk, dv, None


_kernel_with_reference_vjp.defvjp(_kernel_fwd, _reference_bwd)


# ---- the trainer's LM-head softmax -----------------------------------------------------

def token_logprobs(logits: jax.Array, tokens: jax.Array, temperature: float, *,
                   sharded: bool = False) -> tuple[jax.Array, jax.Array]:
  """(log-prob of tokens [K], entropy [K]) under log_softmax(logits [K, V] / temperature):
  `reference_ops.token_logprobs` by the CPU kernel where it runs, else by the reference."""
  kernel = cpu_kernels.enabled(logits.dtype) and not sharded
  chosen = {p: "cpu" if p == "cpu" and kernel else "reference" for p in PLATFORMS}
  implementations = {name: functools.partial(fn, temperature=temperature)
                     for name, fn in IMPLEMENTATIONS["token_logprobs"].items()}
  return by_platform((logits, tokens), chosen, implementations)

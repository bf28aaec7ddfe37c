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

How one is chosen: the C++ kernels run where `tlt_jax.cpu.kernels.enabled` says
(TLT_JAX_CPU_KERNELS, the CPU's flags, float32) on one device's buffers (operands split
over several devices take the reference); attention runs Pallas on GPU. A packed weight
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

def packs_weights(dtype) -> bool:
  """Whether the rollout's layout holds matrices of this dtype packed for the CPU matmul
  kernel: float32 where the CPU kernels run."""
  return cpu_kernels.enabled(dtype)


def pack(w: jax.Array) -> PackedWeight:
  """A weight [..., K, N] as the packed kernel's column panels (exact: only moves values)."""
  return packed_matmul.pack(w)


_pack_jitted = jax.jit(packed_matmul.pack)


def pack_like(w: jax.Array, like: Weight) -> Weight:
  """`w` laid out as `like` is: packed where `like` is packed, else as it is."""
  return _pack_jitted(w) if isinstance(like, PackedWeight) else w


def dense(x: jax.Array, w: Weight) -> jax.Array:
  """x [..., in] @ w [in, out]."""
  if isinstance(w, PackedWeight):
    impl = "packed"
  else:
    impl = "cpu" if jax.default_backend() == "cpu" else "reference"
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


# ---- attention -------------------------------------------------------------------------

def resolve_attention(impl: str, backend: str | None = None, sharded: bool = False) -> str:
  """'auto' -> the compiled kernel on GPU; on CPU the C++ kernel where the CPU kernels run
  and the operands are not sharded (it sees one device's buffers), else the reference."""
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"tree attention impl must be one of {', '.join(ATTENTION_IMPLS)}; "
                     f"got {impl!r}")
  if impl != "auto":
    return impl
  backend = backend or jax.default_backend()
  if backend == "gpu":
    return "pallas"
  if backend == "cpu" and not sharded and cpu_kernels.enabled(jnp.float32):
    return "cpu"
  return "reference"


def packed_rows_attention_impl(sharded: bool) -> str:
  """The attention_impl for the trainer's packed rows (no cache): 'auto' where the CPU
  self-attention kernel takes them (it has a backward pass of its own), else the reference,
  which training differentiates through (a compiled kernel's backward is the reference's)."""
  return "auto" if resolve_attention("auto", sharded=sharded) == "cpu" else "reference"


def attention(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, cache_mask: jax.Array,
              k: jax.Array, v: jax.Array, new_mask: jax.Array, *, impl: str = "auto",
              interpret: bool | None = None, sharded: bool = False) -> jax.Array:
  """`reference_ops.attend` by an implementation; interpret=None interprets Pallas off-GPU
  only. On CPU, over cpu_attention.MAX_NEW_TOKENS new tokens without a cache (the trainer's
  packed rows) take the self-attention kernel; with a cache (a prefill) they take the
  reference; under 'auto', operands a kernel does not take (bfloat16) do too."""
  chosen = resolve_attention(impl, sharded=sharded)
  if chosen == "cpu":
    chosen = _cpu_attention_path(q, cache_k, cache_v, k, v, strict=impl != "auto")
  if chosen == "self_attention":
    return IMPLEMENTATIONS["self_attention"]["cpu"](q, k, v, new_mask)
  if chosen == "reference":
    return IMPLEMENTATIONS["attention"]["reference"](q, cache_k, cache_v, cache_mask, k, v,
                                                      new_mask)
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  return _kernel_with_reference_vjp(q, cache_k, cache_v, cache_mask, k, v, new_mask, chosen,
                                    interpret)


def _cpu_attention_path(q, cache_k, cache_v, k, v, strict: bool) -> str:
  """Where the CPU backend sends attention: 'self_attention', 'cpu' or 'reference'. strict
  (the cpu impl asked for by name): operands the kernel does not take fail in it."""
  many = q.shape[1] > cpu_attention.MAX_NEW_TOKENS
  if many and cache_k.shape[2] == 0 and cpu_self_attention.supports(q, k, v):
    return "self_attention"
  if many or (not strict and not cpu_attention.supports(q, cache_k, cache_v, k, v)):
    return "reference"
  return "cpu"


def self_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *,
                   sharded: bool = False) -> jax.Array:
  """`reference_ops.self_attention` (packed rows, no cache) by the CPU kernel where it runs
  and takes the operands, else by the reference."""
  kernel = (resolve_attention("auto", sharded=sharded) == "cpu"
            and cpu_self_attention.supports(q, k, v))
  return IMPLEMENTATIONS["self_attention"]["cpu" if kernel else "reference"](q, k, v, mask)


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
  impl = "cpu" if cpu_kernels.enabled(logits.dtype) and not sharded else "reference"
  return IMPLEMENTATIONS["token_logprobs"][impl](logits, tokens, temperature)

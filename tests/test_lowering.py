"""GPU and TPU lowering on a CPU-only machine: every program of a small rollout (prefill,
admission into freed rows under a row budget, compaction, plain decode chunks, the SD switch, learned-tree, model-free and hybrid chain
verify chunks; `Rollout.programs` enumerates them, so new programs are covered) and one
training micro-step, lowered for cuda and tpu in float32 and bfloat16 with the kernels
`auto` picks there. A lowered program must hold no CPU-only custom call (the C++ kernels'
FFI targets) and must hold the kernel `auto` picks (Triton on cuda). On tpu `auto` runs
XLA's attention; the Pallas kernel, named, must lower to Mosaic there too.

Each check would fail on a defect found before: the attention choice read from
`jax.default_backend()` at trace time (the CPU kernel in GPU/TPU programs), the Pallas
kernel's new-K/V block breaking TPU's (8, 128) rule, its Triton params missing (jax 0.10's
default Pallas GPU backend, Mosaic GPU, cannot lower it).
"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax import ops
from tlt_jax.models import drafter as drafter_lib
from tlt_jax.models import transformer
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.kv_cache import init_cache
from tlt_jax.rl.batching import empty_rows
from tlt_jax.rl.config import LossConfig
from tlt_jax.rl.update import accumulate_grads, zero_grads
from tlt_jax.rollout.bandit import BanditConfig, parse_strategies
from tlt_jax.rollout.buckets import BucketSpec
from tlt_jax.rollout.weights import rollout_layout
from tlt_jax.rollout.engine import prepare_rollout, windowed_attention
from tlt_jax.rollout.hybrid import HybridConfig
from tlt_jax.rollout.lowering import lower_rollout
from tlt_jax.rollout.ngram import NgramConfig
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.spec_config import SpecConfig
from tlt_jax.rollout.weights import DraftWeights

CONFIG = ModelConfig(model_type="llama", vocab_size=61, hidden_size=32, intermediate_size=64,
                     num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                     max_position_embeddings=256)
# Each platform's kernel call, where `auto` picks one; the C++ kernels' FFI targets
# (`tlt_jax.cpu`) are all named tlt_*.
KERNEL_CALLS = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}
CPU_ONLY = re.compile(r"^tlt_")
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def custom_calls(text: str) -> set[str]:
  return set(re.findall(r"stablehlo\.custom_call @([\w$.\-]+)", text))


def _cast(tree, dtype):
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating)
                      else x, tree)


@functools.cache
def _params(dtype) -> tuple:
  """(model params, drafter params) in `dtype`: random numpy values in the structure init
  gives them (lowering reads only their shapes; no program is compiled to make them)."""
  rng = np.random.default_rng(0)
  fill = lambda tree: jax.tree.map(
      lambda x: jnp.asarray(rng.normal(0, 0.02, x.shape), dtype), tree)
  shapes = lambda init: jax.eval_shape(functools.partial(init, CONFIG), jax.random.key(0))
  return (fill(shapes(transformer.init_params)),
          fill(shapes(drafter_lib.init_drafter_params)))


def _rollout(platform: str, dtype, attention_impl: str = "auto"):
  """A rollout that reaches every kind of program: 6 prompts in groups of 2 under a budget
  of 4 rows (the third group admitted into rows that finish), compacting from batch 4 to 2
  and 1, SD on at 2 rows with a pool of a learned tree, a model-free chain and a hybrid
  chain."""
  params, drafter_params = _params(dtype)
  drafter = DraftWeights(drafter_params)
  strategies = parse_strategies("learned:3_2_5,ngram:3_1_4,hybrid:3_1_4")
  spec = SpecConfig(bandit=BanditConfig(strategies), ngram_config=NgramConfig(),
                    hybrid=HybridConfig(), threshold=2, patience=1)
  prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [6, 7, 8], [6, 7, 8], [9, 10], [9, 10]]
  return prepare_rollout(
      params, CONFIG, prompts, max_new_tokens=12, spec=spec, drafter=drafter, eos_ids=(0,),
      group_ids=[0, 0, 1, 1, 2, 2], draft_context=None, rules=None,
      attention_impl=attention_impl,
      buckets=BucketSpec(batch_buckets=(1, 2, 4), cache_page=32, prompt_page=8),
      min_row_tokens=0, sampling=SamplingParams(temperature=1.0), chunk_steps=2,
      compact=True, platform=platform, max_rows=4)


@functools.cache
def _lowered(dtype: str, attention_impl: str = "auto", platforms=("cuda", "tpu")):
  """(the programs, `lower_rollout`'s texts) of `_rollout`, traced once and lowered for each
  platform: their host layouts (packed weights, attention windows) are the same."""
  layout = lambda p: (ops.packs_weights(DTYPES[dtype], p),
                      windowed_attention(attention_impl, None, p))
  assert len({layout(p) for p in platforms}) == 1
  rollout, groups, extras = _rollout(platforms[0], DTYPES[dtype], attention_impl)
  return rollout.programs(), lower_rollout(rollout, groups, extras, platforms)


def _attends(program) -> bool:
  """Whether a program runs the model's attention (compaction and a model-free switch do
  not)."""
  return program.kind in ("prefill", "admit", "decode", "spec") or (
      program.kind == "switch" and program.size > 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_every_rollout_program_lowers_with_the_kernels_auto_picks(platform, dtype):
  programs, lowered = _lowered(dtype)
  assert {p.kind for p in programs} == {"prefill", "admit", "compact", "decode", "switch",
                                        "spec_compact", "spec"}
  assert {s.drafter for p in programs if p.kind == "spec" for s in [p.strategy]} == {
      "learned", "ngram", "hybrid"}
  kernel = (KERNEL_CALLS[platform] if ops.resolve_attention("auto", platform) == "pallas"
            else None)
  for program in programs:
    calls = set().union(*map(custom_calls, lowered[program, platform]))
    assert not {c for c in calls if CPU_ONLY.match(c)}, (program, calls)
    assert calls <= {kernel}, (program, calls)
    if kernel is not None and _attends(program):
      assert kernel in calls, program


def test_the_pallas_kernel_lowers_to_mosaic_in_every_tpu_rollout_program():
  programs, lowered = _lowered("bf16", "pallas", ("tpu",))
  for program in programs:
    calls = set().union(*map(custom_calls, lowered[program, "tpu"]))
    assert calls <= {KERNEL_CALLS["tpu"]}, (program, calls)
    if _attends(program):
      assert KERNEL_CALLS["tpu"] in calls, program


def _lower_micro_step(platform: str, dtype) -> str:
  """A micro-step as a run computing in `dtype` makes it: float32 master weights, the
  forward cast to `dtype` (`rl.precision`)."""
  params = _params(jnp.float32)[0]
  rows = empty_rows(1, 128, 16)   # over cpu_attention.MAX_NEW_TOKENS: self-attention
  compute_dtype = None if dtype == jnp.float32 else jnp.dtype(dtype).name
  return accumulate_grads.trace(
      params, zero_grads(params), rows, config=CONFIG, sampling=SamplingParams(),
      loss=LossConfig(), compute_dtype=compute_dtype).lower(
          lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_a_training_micro_step_lowers_without_cpu_kernels(platform, dtype):
  calls = custom_calls(_lower_micro_step(platform, DTYPES[dtype]))
  assert not {c for c in calls if CPU_ONLY.match(c)}, calls
  # The trainer differentiates through XLA's attention off the CPU (`ops.TRAINING_AUTO`).
  assert calls == set(), calls


def test_one_trace_lowers_each_platform_with_its_own_kernels():
  """The choice is made when lowering, not when tracing: one traced decode step and one
  traced micro-step hold the C++ kernels lowered for the CPU (where they build), Triton on
  cuda, XLA's attention on tpu."""
  from tlt_jax.cpu import kernels
  if not kernels.enabled(jnp.float32):
    pytest.skip(f"the CPU kernels do not run here: {kernels.build_problem() or 'disabled'}")
  params = rollout_layout(_params(jnp.float32)[0], pack_weights=False)
  cache = init_cache(CONFIG, 2, 32, per_layer=True)
  tokens = jnp.ones((2, 1), jnp.int32)
  traced = jax.jit(lambda p, c: transformer.forward(p, CONFIG, tokens, c.lengths[:, None],
                                                    c)[0]).trace(params, cache)
  lowered = {p: custom_calls(traced.lower(lowering_platforms=(p,)).as_text())
             for p in ("cpu", "cuda", "tpu")}
  assert lowered == {"cpu": {"tlt_attention"}, "cuda": {KERNEL_CALLS["cuda"]}, "tpu": set()}
  calls = custom_calls(_lower_micro_step("cpu", jnp.float32))
  assert {"tlt_self_attention_forward", "tlt_token_logprobs_forward"} <= calls, calls

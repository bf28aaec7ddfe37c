"""bfloat16 as the accelerator path (`rl.precision`): the rollout and the update compute in
bfloat16 over float32 master weights. On SmolLM2 the trainer's bfloat16 log-probs of the
rollout's sampled tokens agree with the rollout's own within the tolerances below, and the
update reports the gap as `rollout/logprob_diff_*`; master weights, gradients and AdamW
moments stay float32, so an update far below bfloat16's resolution still moves them."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax import optim
from tlt_jax.models import transformer
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.loading import load_model
from tlt_jax.rl.batching import Sequences, empty_rows
from tlt_jax.rl.config import LossConfig
from tlt_jax.rl.precision import compute_params
from tlt_jax.rl.rollout import RolloutSettings, sample_groups
from tlt_jax.rl.update import (UpdateConfig, UpdateContext, accumulate_grads,
                               init_policy_state, update_policy, zero_grads)
from tlt_jax.rollout.sampling import SamplingParams

# |trainer - rollout| log-prob of a sampled token (nats), bfloat16 on both sides: the two
# run different programs (a packed forward over whole sequences vs. a prefill and decode
# steps over a bfloat16 KV cache), each rounding its activations to bfloat16 at other
# points. The mean is over every response token, the max its worst token (the figures
# these bounds were set from: docs/architecture.md, Precision).
BF16_MEAN_TOLERANCE = 0.06
BF16_MAX_TOLERANCE = 0.5
QUESTIONS = ("What is 7 times 8?", "Name a primary color.",
             "Write one sentence about the moon and the tides.")
SAMPLING = SamplingParams(temperature=1.0)


def _context(config, compute_dtype, lr=1e-6, max_response_len=32):
  return UpdateContext(config=config, sampling=SAMPLING, loss=LossConfig(),
                       update=UpdateConfig(micro_batch_rows=2, train_seq_len=128),
                       optimizer=optim.make_optimizer(lr, 1, weight_decay=0.0),
                       learning_rate=optim.learning_rate_schedule(lr, 1),
                       max_response_len=max_response_len, compute_dtype=compute_dtype)


def _rollout_then_update(model, compute_dtype):
  """SmolLM2 (float32 master weights) samples 3 prompts x 2 in `compute_dtype`, then one
  update computing in it: the update's metrics and the new state."""
  prompts = [model.tokenizer.chat_prompt(q) for q in QUESTIONS]
  settings = RolloutSettings(group_size=2, max_new_tokens=32, sampling=SAMPLING,
                             eos_ids=tuple(model.tokenizer.eos_token_ids))
  groups = sample_groups(compute_params(model.params, compute_dtype), model.config, prompts,
                         settings, seed=0)
  ctx = _context(model.config, compute_dtype)
  n = len(groups.responses)
  state, metrics = update_policy(
      init_policy_state(model.params, ctx), Sequences(groups.prompts, groups.responses),
      np.linspace(-1.0, 1.0, n).astype(np.float32), groups.logprobs, None,
      np.ones(n, bool), ctx, seed=0)
  return metrics, state


@pytest.fixture(scope="module")
def smollm2():
  return load_model("smollm2")        # float32: the master weights


def test_bf16_trainer_and_rollout_logprobs_agree_on_smollm2(smollm2):
  metrics, state = _rollout_then_update(smollm2, "bfloat16")
  assert metrics["rollout/logprob_diff_mean"] <= BF16_MEAN_TOLERANCE, metrics
  assert metrics["rollout/logprob_diff_max"] <= BF16_MAX_TOLERANCE, metrics
  # The gap is bfloat16's: float32 on both sides agrees to rounding (test_rl_run_cli).
  assert metrics["rollout/logprob_diff_mean"] > 1e-3, metrics
  # What the update wrote is float32: master weights and AdamW moments.
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
  assert {x.dtype for x in jax.tree.leaves(state.opt_state)
          if x.ndim > 0} == {jnp.dtype(jnp.float32)}


TINY = ModelConfig(model_type="llama", vocab_size=61, hidden_size=32, intermediate_size=64,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                   max_position_embeddings=256)


def test_master_weights_keep_updates_below_bf16_resolution():
  """AdamW's first step moves each weight by about lr; at lr 1e-5 (weights ~1 in the
  norms) that is far below a bfloat16 step there (2^-7): float32 master weights keep it,
  the bfloat16 weights the forward reads would not have moved."""
  params = transformer.init_params(TINY, jax.random.key(0))
  ctx = _context(TINY, "bfloat16", lr=1e-5, max_response_len=8)
  rng = np.random.RandomState(0)
  prompts = [rng.randint(0, 61, 6).tolist() for _ in range(4)]
  responses = [rng.randint(0, 61, 8).tolist() for _ in range(4)]
  logprobs = [np.full(8, -4.0, np.float32) for _ in range(4)]
  state, _ = update_policy(init_policy_state(params, ctx), Sequences(prompts, responses),
                           np.array([1.0, -1.0, 0.5, -0.5], np.float32), logprobs, None,
                           np.ones(4, bool), ctx, seed=0)
  before, after = params["layers"]["mlp_norm"], state.params["layers"]["mlp_norm"]
  assert after.dtype == jnp.float32
  moved = np.asarray(after != before)
  assert moved.mean() > 0.9
  as_bf16 = lambda x: np.asarray(x.astype(jnp.bfloat16))
  assert (as_bf16(after) == as_bf16(before)).mean() > 0.9


def test_the_update_computes_in_bf16_and_accumulates_in_float32():
  params = transformer.init_params(TINY, jax.random.key(0))
  rows = empty_rows(2, 64, 16)
  kwargs = dict(config=TINY, sampling=SAMPLING, loss=LossConfig())
  text = accumulate_grads.lower(params, zero_grads(params), rows, compute_dtype="bfloat16",
                                **kwargs).as_text()
  assert "bf16" in text
  grads, _ = accumulate_grads(params, zero_grads(params), rows, compute_dtype="bfloat16",
                              **kwargs)
  assert {x.dtype for x in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
  assert "bf16" not in accumulate_grads.lower(params, zero_grads(params), rows,
                                              **kwargs).as_text()


def test_a_bf16_run_reports_the_logprob_gap(tiny_hf_dirs, tmp_path):
  """`experiments.run --dtype=bfloat16`, one step with a reference model (KL on): the
  step's `rollout/logprob_diff_*` is bfloat16's gap, within the tolerances above."""
  from tests.test_rl_run_cli import run_cli
  run_dir = tmp_path / "run"
  run_cli(str(run_dir), tiny_hf_dirs["qwen2"], "--steps=1", "--eval_every=0",
          "--dtype=bfloat16")
  record = [json.loads(line) for line in open(run_dir / "metrics.jsonl")][-1]
  assert 0 < record["rollout/logprob_diff_mean"] <= BF16_MEAN_TOLERANCE, record
  assert record["rollout/logprob_diff_max"] <= BF16_MAX_TOLERANCE, record

"""A policy update with params, optimizer state and rows sharded over a 4 x 2 (fsdp x tp)
trainer mesh of 8 simulated CPU devices equals the single-device update, and hands its
state back laid out as it came (so the next update compiles nothing). The RL rollout runs
on the same mesh: the synced policy is laid out by the trainer's rules, samples what one
device samples, and a later sync compiles no rollout program again.

Under data-parallel rules (a trainer spanning several processes: params whole on every
shard) each data shard accumulates its own gradient and the optimizer step sums them: the
update equals the single-device one, each micro-batch's program reduces no gradient, and
the optimizer step's reduces all of it, once.

The device count is fixed before jax starts, so the check runs in a child process
(`python -m tests.test_rl_sharded_update`) with XLA_FLAGS set.
"""
import json
import re

import numpy as np

from tests.simulated_devices import run_on_8_devices



def _sharded_vs_single() -> dict:
  import dataclasses

  import jax
  import numpy as np

  from tlt_jax import optim
  from tlt_jax.models import transformer
  from tlt_jax.models.config import ModelConfig
  from tlt_jax.rl.batching import Sequences
  from tlt_jax.rl.config import LossConfig
  from tlt_jax.rl.rollout import RolloutSettings, lay_out_for_rollout, sample_groups
  from tlt_jax.rl.update import (UpdateConfig, UpdateContext, compiled_programs,
                                 init_policy_state, update_policy)
  from tlt_jax.rollout import engine
  from tlt_jax.rollout.sampling import SamplingParams
  from tlt_jax.sharding.mesh import make_mesh
  from tlt_jax.sharding.rules import MeshRules, param_logical_axes, tree_shardings

  config = ModelConfig(model_type="qwen2", vocab_size=256, hidden_size=64,
                       intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=16, qkv_bias=True)
  # Host copies: each update donates (consumes) the params it is given.
  params = jax.device_get(transformer.init_params(config, jax.random.key(0)))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 256, n).tolist() for n in (5, 9, 3, 7, 6, 4)]
  responses = [rng.integers(0, 256, n).tolist() for n in (8, 3, 11, 5, 6, 9)]
  sequences = Sequences(prompts, responses)
  rollout_logp = [rng.normal(-5, 0.3, len(r)).astype(np.float32) for r in responses]
  advantages = rng.normal(size=6).astype(np.float32)
  # Adam moves every weight by about lr at its first step whatever the gradient's size,
  # so a tiny gradient differing in rounding moves its weight by up to ~lr: keep lr small.
  optimizer = optim.make_optimizer(1e-3, total_steps=1, b2=0.999, schedule="constant")

  def step(rules, micro_batch_rows=2, ppo_epochs=1, train_seq_len=32, state=None):
    placed = jax.device_put(params) if rules is None else jax.device_put(
        params, tree_shardings(param_logical_axes(config), params, rules))
    update = UpdateConfig(micro_batch_rows=micro_batch_rows, train_seq_len=train_seq_len,
                          ppo_epochs=ppo_epochs)
    ctx = UpdateContext(config=config, sampling=SamplingParams(1.0),
                        loss=LossConfig(), update=update,
                        optimizer=optimizer, learning_rate=lambda s: 1e-3,
                        max_response_len=16, rules=rules)
    state = init_policy_state(placed, ctx) if state is None else state
    state, metrics = update_policy(state, sequences, advantages, rollout_logp, None,
                                   np.ones(6, bool), ctx, seed=0)
    return state, metrics, ctx

  single, single_metrics, _ = step(None)
  result = {"data_parallel": {f"{fsdp}x{tp}": _data_parallel(step, fsdp, tp)
                              for fsdp, tp in ((2, 1), (4, 2))}}
  sharded, sharded_metrics, ctx = step(MeshRules(make_mesh(fsdp=4, tp=2)))
  diffs = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))),
                       single.params, sharded.params)
  mu = sharded.opt_state[1][0].mu["layers"]["wq"]
  result.update({"devices": len(jax.devices()),
                 "params_max_abs_diff": max(jax.tree.leaves(diffs)),
                 "params_moved": float(np.max(np.abs(np.asarray(single.params["layers"]["wq"])
                                                     - np.asarray(params["layers"]["wq"])))),
                 "wq_spec": str(sharded.params["layers"]["wq"].sharding.spec),
                 "mu_wq_spec": str(mu.sharding.spec),
                 "loss_diff": abs(single_metrics["actor/loss"] - sharded_metrics["actor/loss"])})
  # The rollout on the trainer's mesh (laid out by its rules) against one device's.
  settings = RolloutSettings(group_size=2, max_new_tokens=6, sampling=SamplingParams(0.0),
                             eos_ids=(), rules=ctx.rules)

  def rollout(params, settings):
    synced = lay_out_for_rollout(params, config, settings)
    groups = sample_groups(synced, config, prompts[:2], settings, seed=0)
    return synced, groups.responses, np.concatenate(groups.logprobs)

  single_params = jax.device_put(jax.device_get(sharded.params))
  _, single_tokens, single_logp = rollout(single_params, dataclasses.replace(settings,
                                                                             rules=None))
  synced, tokens, logp = rollout(sharded.params, settings)
  result.update({"rollout_tokens_equal": tokens == single_tokens,
                 "rollout_logprob_diff": float(np.max(np.abs(logp - single_logp))),
                 "rollout_wq_spec": str(synced["layers"][0]["wq"].sharding.spec)})

  # A second update on the same shapes: the state must come back laid out as it went in,
  # or every program (and the rollout's, which read the params) compiles again.
  layout = lambda state: [str(x.sharding) for x in jax.tree.leaves(state)]
  before, programs = layout(sharded), compiled_programs()
  engine_programs = engine.compiled_programs()
  again, _ = update_policy(sharded, sequences, advantages, rollout_logp, None,
                           np.ones(6, bool), ctx, seed=1)
  result["second_update_new_programs"] = compiled_programs() - programs
  result["layout_changes"] = sum(a != b for a, b in zip(before, layout(again)))
  _, again_tokens, _ = rollout(again.params, settings)
  result["rollout_tokens"] = len(again_tokens)
  result["rollout_new_programs_after_sync"] = engine.compiled_programs() - engine_programs
  return result


def reduced_elements(hlo: str) -> int:
  """Elements a device all-reduces in a compiled program (its HLO text): the sizes of its
  all-reduces' results, summed."""
  total = 0
  for line in hlo.splitlines():
    if re.search(r"= .*\ball-reduce(-start)?\(", line):
      result = line.split("=", 1)[1].split("all-reduce", 1)[0]
      for dims in re.findall(r"[a-z0-9]+\[([0-9,]*)\]", result):
        total += int(np.prod([int(d) for d in dims.split(",") if d]))
  return total


def _data_parallel(step, fsdp: int, tp: int) -> dict:
  """Updates of one epoch (metrics from the program, maxima too) and of two (the second's
  `old` log-probs scored by the trainer), of two or three micro-batches each, under
  data-parallel rules on an fsdp x tp mesh, against the single-device ones; what they
  compile after `precompile_training`, and the elements their programs all-reduce."""
  import jax

  from tlt_jax.rl.batching import empty_rows
  from tlt_jax.rl.update import (accumulate_grads, apply_grads, compiled_programs,
                                 precompile_training, zero_grads)
  from tlt_jax.sharding.mesh import make_mesh
  from tlt_jax.sharding.rules import DATA_PARALLEL_RULES, MeshRules

  # 16-slot rows hold one sample each: six rows, in micro-batches of one row a shard.
  rules = MeshRules(make_mesh(fsdp=fsdp, tp=tp, devices=jax.devices()[:fsdp * tp]),
                    DATA_PARALLEL_RULES)
  diffs = {}
  for epochs in (1, 2):
    single, single_metrics, _ = step(None, ppo_epochs=epochs, train_seq_len=16)
    state, metrics, ctx = step(rules, micro_batch_rows=fsdp, ppo_epochs=epochs,
                               train_seq_len=16)
    diffs.update({f"{k} ({epochs} epochs)": abs(single_metrics[k] - metrics[k])
                  for k in single_metrics if k.startswith(("actor/", "rollout/"))})
  params_diff = max(jax.tree.leaves(jax.tree.map(
      lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))),
      single.params, state.params)))
  precompile_training(state, ctx)
  layout = lambda state: [str(x.sharding) for x in jax.tree.leaves(state)]
  before, programs = layout(state), compiled_programs()
  again, _, _ = step(rules, micro_batch_rows=fsdp, ppo_epochs=2, train_seq_len=16,
                     state=state)
  grads = zero_grads(again.params, rules)
  rows = empty_rows(fsdp, 16, fsdp * 4)
  micro = accumulate_grads.lower(again.params, grads, rows, loss=ctx.loss, config=ctx.config,
                                 sampling=ctx.sampling, rules=rules)
  optimizer_step = apply_grads.lower(again, grads, optimizer=ctx.optimizer,
                                     config=ctx.config, rules=rules)
  return {"params_max_abs_diff": params_diff,
          "metrics_max_abs_diff": diffs,
          "micro_batches": metrics["train/micro_batches"],
          "new_programs_after_precompile": compiled_programs() - programs,
          "layout_changes": sum(a != b for a, b in zip(before, layout(again))),
          "grads_data_axis": grads["layers"]["wq"].sharding.spec[0],
          "params": sum(x.size for x in jax.tree.leaves(again.params)),
          "micro_batch_reduced": reduced_elements(micro.compile().as_text()),
          "optimizer_step_reduced": reduced_elements(optimizer_step.compile().as_text())}


def test_sharded_update_matches_single_device():
  result = run_on_8_devices("tests.test_rl_sharded_update")
  assert result["devices"] == 8
  assert "fsdp" in result["wq_spec"] and "tp" in result["wq_spec"], result
  assert result["mu_wq_spec"] == result["wq_spec"], result   # optimizer state sharded alike
  assert result["params_moved"] > 1e-4, result
  assert result["params_max_abs_diff"] <= 1e-5, result
  assert result["loss_diff"] <= 1e-5, result
  assert result["layout_changes"] == 0, result
  assert result["second_update_new_programs"] == 0, result
  assert "tp" in result["rollout_wq_spec"], result         # the rollout is sharded too
  assert result["rollout_tokens_equal"], result
  assert result["rollout_logprob_diff"] <= 1e-5, result
  assert result["rollout_tokens"] == 4, result
  assert result["rollout_new_programs_after_sync"] == 0, result
  for mesh, data_parallel in result["data_parallel"].items():
    assert data_parallel["grads_data_axis"] == "fsdp", (mesh, result)
    assert data_parallel["micro_batches"] >= 2, (mesh, result)
    assert data_parallel["params_max_abs_diff"] <= 1e-5, (mesh, result)
    # The loss, the gradient's norm (a gradient counted per shard would differ), the
    # in-program maxima and the trainer's log-probs (scored per shard) against the rollout's.
    assert {f"{k} ({epochs} epochs)" for k in ("actor/grad_norm", "actor/loss",
                                                "rollout/logprob_diff_max")
            for epochs in (1, 2)} <= data_parallel["metrics_max_abs_diff"].keys(), result
    assert max(data_parallel["metrics_max_abs_diff"].values()) <= 1e-5, (mesh, result)
    assert data_parallel["new_programs_after_precompile"] == 0, (mesh, result)
    assert data_parallel["layout_changes"] == 0, (mesh, result)
  # With the data axis alone (every all-reduce is over it), a micro-batch reduces its few
  # metric sums, never a gradient; the optimizer step reduces every gradient.
  data_parallel = result["data_parallel"]["2x1"]
  assert data_parallel["micro_batch_reduced"] < 100, result
  assert data_parallel["params"] <= data_parallel["optimizer_step_reduced"], result


if __name__ == "__main__":
  print(json.dumps(_sharded_vs_single()))

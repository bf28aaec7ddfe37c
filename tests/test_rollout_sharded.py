"""A rollout replica sharded over a 2 x 2 (fsdp x tp) sub-mesh of 8 simulated CPU devices
gives the tokens and log-probs of one device, plain and speculative (greedy, fp32; a
learned drafter, and model-free).

The device count is fixed before jax starts, so the check runs in a child process
(`python -m tests.test_rollout_sharded`) with XLA_FLAGS set.
"""
import json

from tests.simulated_devices import run_on_8_devices



def _sharded_vs_single() -> dict:
  import jax
  import numpy as np
  from jax.sharding import PartitionSpec

  from tlt_jax.models import drafter as drafter_lib
  from tlt_jax.models import transformer
  from tlt_jax.models.config import ModelConfig
  from tlt_jax.models.kv_cache import init_cache
  from tlt_jax.rollout import engine
  from tlt_jax.rollout.engine import generate
  from tlt_jax.rollout.ngram import NgramConfig
  from tlt_jax.rollout.sampling import SamplingParams
  from tlt_jax.rollout.spec_config import SpecConfig
  from tlt_jax.rollout.strategy import SpecStrategy
  from tlt_jax.rollout.weights import DraftWeights, place_rollout
  from tlt_jax.sharding.mesh import make_mesh
  from tlt_jax.sharding.rules import MeshRules

  # XLA compilations of the engine's programs (a program whose inputs came laid out anew
  # would compile again).
  compiles = []
  names = {fn.__name__ for fn in engine._PROGRAMS}
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, _, fun_name=None, **kw: compiles.append(fun_name)
      if event == "/jax/core/compile/backend_compile_duration"
      and any(name in str(fun_name) for name in names) else None)

  config = ModelConfig(model_type="qwen3", vocab_size=97, hidden_size=32, intermediate_size=64,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                       max_position_embeddings=256)
  params = jax.device_get(transformer.init_params(config, jax.random.key(0)))
  drafter = jax.device_get(drafter_lib.init_drafter_params(config, jax.random.key(1)))
  rng = np.random.RandomState(0)
  prompts = [rng.randint(0, 97, n).tolist() for n in (5, 9, 3, 12)]
  # Rows finish apart: the batch is compacted and SD switches on mid-run.
  caps = [20, 3, 10, 6]
  spec = SpecConfig(strategy=SpecStrategy(3, 2, 5), threshold=2, patience=2)
  weights = DraftWeights(drafter)
  # The replica is a sub-mesh: the last four devices, none of them the default one.
  rules = MeshRules(make_mesh(fsdp=2, tp=2, devices=jax.devices()[4:]))

  def run(rules, spec=spec, drafter=weights):
    before = len(compiles)
    result = generate(params, config, prompts, max_new_tokens=caps,
                      sampling=SamplingParams(temperature=0.0), chunk_steps=4, spec=spec,
                      drafter=drafter, rules=rules)
    return (result, [o.token_ids for o in result.outputs], [o.logprobs for o in result.outputs],
            len(compiles) - before)

  # One rollout runs both: plain chunks for the full batch, SD chunks for the tail.
  _, single_tokens, single_logp, single_compiles = run(None)
  sharded, sharded_tokens, sharded_logp, sharded_compiles = run(rules)
  out = {"devices": len(jax.devices()),
         "tokens_equal": single_tokens == sharded_tokens,
         "logprob_max_abs_diff": max(float(np.max(np.abs(np.subtract(a, b))))
                                     for a, b in zip(single_logp, sharded_logp)),
         "batch_buckets": sharded.stats["rollout/batch_buckets"],
         "plain_chunks": sharded.stats["decode_chunks/plain"],
         "spec_chunks": sharded.stats["decode_chunks/spec"],
         "single_compiles": single_compiles, "sharded_compiles": sharded_compiles,
         "sharded_reported_programs": sharded.stats["compile/new_programs"],
         "again_compiles": run(rules)[3]}
  # Model-free: the draft context's pool is replicated, its rows' member lists sharded.
  model_free = SpecConfig(kind="ngram", ngram_config=NgramConfig(),
                          strategy=SpecStrategy(3, 1, 4), threshold=2, patience=2)
  single, sharded = run(None, model_free, None), run(rules, model_free, None)
  out.update(model_free_tokens_equal=single[1] == sharded[1],
             model_free_spec_chunks=sharded[0].stats["decode_chunks/spec"],
             model_free_compiles=(single[3], sharded[3]))
  placed, placed_drafter = place_rollout(params, config, weights, rules)
  replica = {d.id for d in rules.mesh.devices.flat}
  out["wq_spec"] = str(placed["layers"][0]["wq"].sharding.spec)
  out["drafter_wk_spec"] = str(placed_drafter.params["layers"]["wk"].sharding.spec)
  out["cache_spec"] = str(init_cache(config, 4, 128, rules=rules, per_layer=True).k[0]
                          .sharding.spec) == str(PartitionSpec(None, "fsdp", "tp"))
  out["on_replica"] = all({d.id for d in x.devices()} == replica
                          for x in jax.tree.leaves((placed, placed_drafter.params)))
  return out


def test_sharded_replica_matches_single_device():
  result = run_on_8_devices("tests.test_rollout_sharded")
  assert result["devices"] == 8
  assert result["on_replica"], result
  assert "tp" in result["wq_spec"] and "tp" in result["drafter_wk_spec"], result
  assert result["cache_spec"], result                      # batch over fsdp, kv heads over tp
  assert result["tokens_equal"], result
  assert result["logprob_max_abs_diff"] <= 1e-5, result
  assert len(result["batch_buckets"]) >= 2, result         # compacted mid-run
  assert result["plain_chunks"] > 0 and result["spec_chunks"] > 0, result
  # Each program's output sits as its input came: no layout compiles a program twice.
  assert result["sharded_compiles"] == result["single_compiles"] > 0, result
  assert result["again_compiles"] == 0, result
  # The engine reports the programs it really built, not its dispatch-cache entries.
  assert result["sharded_reported_programs"] == result["sharded_compiles"], result
  assert result["model_free_tokens_equal"] and result["model_free_spec_chunks"] > 0, result
  single, sharded = result["model_free_compiles"]
  assert single == sharded > 0, result


if __name__ == "__main__":
  print(json.dumps(_sharded_vs_single()))

"""Sharded (fsdp x tp over 8 simulated CPU devices) forward equals the unsharded one.

The device count must be fixed before jax starts, so the check runs in a child process
(`python -m tests.test_sharding`) with XLA_FLAGS set.
"""
import json

import pytest

from tests.simulated_devices import run_on_8_devices



def _sharded_vs_unsharded() -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from tlt_jax.models import transformer
  from tlt_jax.models.config import ModelConfig
  from tlt_jax.models.kv_cache import init_cache
  from tlt_jax.sharding.mesh import make_mesh
  from tlt_jax.sharding.rules import MeshRules, param_logical_axes, tree_shardings

  config = ModelConfig(model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True,
                       qkv_bias=True)
  params = transformer.init_params(config, jax.random.key(0))
  batch, length, cache_len = 4, 12, 32
  tokens = jax.random.randint(jax.random.key(1), (batch, length), 0, config.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(length), (batch, length))

  def run(params, cache, rules=None):
    hidden, cache = transformer.forward(params, config, tokens, positions, cache, None, rules)
    return transformer.lm_logits(params, config, hidden, rules), cache.k

  ref_logits, ref_k = jax.jit(run)(params, init_cache(config, batch, cache_len))

  rules = MeshRules(make_mesh(fsdp=4, tp=2))
  shardings = tree_shardings(param_logical_axes(config), params, rules)
  sharded_params = jax.device_put(params, shardings)
  cache = init_cache(config, batch, cache_len, rules=rules)
  logits, k = jax.jit(lambda p, c: run(p, c, rules))(sharded_params, cache)
  return {
      "devices": len(jax.devices()),
      "wq_spec": str(sharded_params["layers"]["wq"].sharding.spec),
      "embed_shards": len(sharded_params["embed"].addressable_shards),
      "logits_max_abs_diff": float(np.max(np.abs(np.asarray(logits) - np.asarray(ref_logits)))),
      "cache_max_abs_diff": float(np.max(np.abs(np.asarray(k) - np.asarray(ref_k)))),
  }


def test_sharded_forward_matches_unsharded():
  result = run_on_8_devices("tests.test_sharding")
  assert result["devices"] == 8
  assert "fsdp" in result["wq_spec"] and "tp" in result["wq_spec"], result
  assert result["embed_shards"] == 8
  assert result["logits_max_abs_diff"] <= 1e-5, result
  assert result["cache_max_abs_diff"] <= 1e-5, result


def test_rules_keep_indivisible_dims_whole():
  import jax
  from jax.sharding import PartitionSpec

  from tlt_jax.sharding.mesh import make_mesh
  from tlt_jax.sharding.rules import MeshRules

  rules = MeshRules(make_mesh(fsdp=1, tp=1, devices=jax.devices()[:1]))
  assert rules.spec(("embed", "heads"), (6, 9)) == PartitionSpec("fsdp", "tp")
  # One mesh axis may appear once per spec: the second use is dropped.
  assert rules.spec(("batch", "embed"), (4, 4)) == PartitionSpec("fsdp")


def test_make_mesh_rejects_wrong_device_count():
  import jax

  from tlt_jax.errors import UserInputError
  from tlt_jax.sharding.mesh import make_mesh

  with pytest.raises(UserInputError, match="fsdp=2 x tp=2"):
    make_mesh(fsdp=2, tp=2, devices=jax.devices()[:1])


def test_data_parallel_shards_split_micro_batches_evenly():
  """Data-parallel rules make each fsdp shard accumulate its own gradient (FSDP rules do
  not); a micro-batch's rows must then split evenly over the shards."""
  from jax.sharding import AbstractMesh, AxisType

  from tlt_jax.errors import UserInputError
  from tlt_jax.rl.config import LossConfig
  from tlt_jax.rl.update import UpdateConfig, UpdateContext
  from tlt_jax.rollout.sampling import SamplingParams
  from tlt_jax.sharding.data_parallel import data_shards
  from tlt_jax.sharding.mesh import MESH_AXES
  from tlt_jax.sharding.rules import DATA_PARALLEL_RULES, MeshRules

  mesh = AbstractMesh((4, 2), MESH_AXES, axis_types=(AxisType.Auto,) * 2)
  data_parallel = MeshRules(mesh, DATA_PARALLEL_RULES)
  assert data_shards(data_parallel) == 4
  assert data_shards(MeshRules(mesh)) == 1 and data_shards(None) == 1
  context = lambda rows: UpdateContext(
      config=None, sampling=SamplingParams(), loss=LossConfig(),
      update=UpdateConfig(micro_batch_rows=rows), optimizer=None, learning_rate=None,
      max_response_len=8, rules=data_parallel)
  assert context(8).data_shards == 4
  with pytest.raises(UserInputError, match="--micro_batch_rows=6: must be a multiple"):
    context(6)


if __name__ == "__main__":
  print(json.dumps(_sharded_vs_unsharded()))

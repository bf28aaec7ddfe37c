"""The params a trainer or checkpoint holds are one structure on every machine: the pytree
(structure, leaf shapes, dtypes) of the model and drafter params, from init and from
loading (an HF dir, a converted checkpoint, a drafter export), is the same with the CPU
kernels on (TLT_JAX_CPU_KERNELS=kernel) and off (=xla). Only the rollout's own layout,
derived from them in tlt_jax/rollout/weights.py, may differ by backend."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent

# Run in a fresh process per setting: the kernels' mode is read from the environment.
DESCRIBE = r'''
import json, sys
import jax, jax.numpy as jnp
from tlt_jax import ops
from tlt_jax.drafter.trainer import load_drafter
from tlt_jax.models import drafter, transformer
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.loading import load_model

hf_dir, ckpt_dir, drafter_dir = sys.argv[1:4]

def describe(tree):
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  return [str(treedef)] + [[jax.tree_util.keystr(path), list(leaf.shape), str(leaf.dtype)]
                           for path, leaf in leaves]

config = ModelConfig(model_type="qwen3", vocab_size=61, hidden_size=48, intermediate_size=72,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=12, qk_norm=True,
                     max_position_embeddings=64)
loaded = load_model(hf_dir)
trees = {
    "init": transformer.init_params(config, jax.random.key(0)),
    "init_bf16": transformer.init_params(config, jax.random.key(0), jnp.bfloat16),
    "drafter_init": drafter.init_drafter_params(config, jax.random.key(1)),
    "hf_dir": loaded.params,
    "checkpoint": load_model(ckpt_dir).params,
    "drafter_export": load_drafter(drafter_dir, loaded.config)[0],
}
try:
  packs = ops.packs_weights(jnp.float32)
except RuntimeError:   # TLT_JAX_CPU_KERNELS=kernel where they do not build
  packs = False
print(json.dumps({"packs_float32": packs,
                  "trees": {name: describe(tree) for name, tree in trees.items()}}))
'''


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
  """A tiny HF dir, its converted checkpoint and a drafter export for it."""
  import jax
  from tests.hf_fixtures import make_tiny_hf_checkpoint
  from tlt_jax.drafter.trainer import export_drafter
  from tlt_jax.models import drafter
  from tlt_jax.models.checkpoint import save_model_checkpoint
  from tlt_jax.models.loading import load_model
  root = tmp_path_factory.mktemp("param_structure")
  hf_dir = make_tiny_hf_checkpoint("qwen2", str(root / "hf"))
  model = load_model(hf_dir)
  save_model_checkpoint(str(root / "ckpt"), model.params, model.config)
  export_drafter(str(root / "drafter"),
                 drafter.init_drafter_params(model.config, jax.random.key(2)), None,
                 model.config, step=0, target_source=hf_dir)
  return hf_dir, str(root / "ckpt"), str(root / "drafter")


def _describe(mode: str, sources) -> dict:
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "TLT_JAX_CPU_KERNELS": mode}
  result = subprocess.run([sys.executable, "-c", DESCRIBE, *sources], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_params_have_one_structure_whatever_the_kernels(sources):
  from tlt_jax.cpu import kernels
  on, off = _describe("kernel", sources), _describe("xla", sources)
  # The setting took effect: the rollout would pack with the kernels, not without.
  assert on["packs_float32"] == (kernels.build_problem() is None)
  assert off["packs_float32"] is False
  assert on["trees"] == off["trees"]
  assert set(on["trees"]) == {"init", "init_bf16", "drafter_init", "hf_dir", "checkpoint",
                              "drafter_export"}
  for name, description in on["trees"].items():
    assert len(description) > 1, name

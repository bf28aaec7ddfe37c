"""HF safetensors <-> params <-> orbax checkpoint I/O, and convert_hf end to end."""
import glob
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from tests.hf_fixtures import TINY_KINDS
from tlt_jax.models import checkpoint
from tlt_jax.errors import UserInputError
from tlt_jax.models import hf
from tlt_jax.models.config import ModelConfig

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _hf_tensors(hf_dir):
  """All tensors of a (possibly sharded) HF dir, by name."""
  tensors = {}
  for path in glob.glob(os.path.join(hf_dir, "*.safetensors")):
    tensors.update(safetensors.numpy.load_file(path))
  return tensors


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _copy(src, tmp_path):
  return shutil.copytree(src, tmp_path / "hf")


def _leftovers(parent):
  return [p for p in os.listdir(parent) if ".tmp-" in p]


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_hf_round_trip_is_exact(kind, tiny_hf_dirs, tmp_path):
  config, params = hf.load_hf_dir(tiny_hf_dirs[kind])
  hf.save_hf_dir(params, config, str(tmp_path / "out"))
  before, after = _hf_tensors(tiny_hf_dirs[kind]), _hf_tensors(str(tmp_path / "out"))
  assert sorted(before) == sorted(after)
  for name, value in before.items():
    assert after[name].dtype == value.dtype, name
    np.testing.assert_array_equal(after[name], value, err_msg=name)
  assert ModelConfig.from_hf_dir(str(tmp_path / "out")) == config
  assert not _leftovers(tmp_path)


def test_sharded_round_trip_matches_single_file(tiny_hf_dirs, tiny_hf_sharded_dir, tmp_path):
  assert os.path.isfile(os.path.join(tiny_hf_sharded_dir, hf.SAFETENSORS_INDEX))
  config, params = hf.load_hf_dir(tiny_hf_sharded_dir)
  _assert_trees_equal(params, hf.load_hf_dir(tiny_hf_dirs["llama"])[1])
  hf.save_hf_dir(params, config, str(tmp_path / "out"))
  before, after = _hf_tensors(tiny_hf_sharded_dir), _hf_tensors(str(tmp_path / "out"))
  assert sorted(before) == sorted(after)
  for name, value in before.items():
    np.testing.assert_array_equal(after[name], value, err_msg=name)


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_params_follow_the_layout_contract(kind, tiny_hf_dirs):
  """Spot checks against HF names, so a symmetric load/save mix-up cannot pass."""
  config, params = hf.load_hf_dir(tiny_hf_dirs[kind])
  t = _hf_tensors(tiny_hf_dirs[kind])
  layers = params["layers"]
  np.testing.assert_array_equal(params["embed"], t["model.embed_tokens.weight"])
  np.testing.assert_array_equal(params["final_norm"], t["model.norm.weight"])
  np.testing.assert_array_equal(layers["wq"][1], t["model.layers.1.self_attn.q_proj.weight"].T)
  np.testing.assert_array_equal(layers["wk"][0], t["model.layers.0.self_attn.k_proj.weight"].T)
  np.testing.assert_array_equal(layers["wv"][1], t["model.layers.1.self_attn.v_proj.weight"].T)
  np.testing.assert_array_equal(layers["wo"][0], t["model.layers.0.self_attn.o_proj.weight"].T)
  np.testing.assert_array_equal(layers["w_gate"][1], t["model.layers.1.mlp.gate_proj.weight"].T)
  np.testing.assert_array_equal(layers["w_up"][0], t["model.layers.0.mlp.up_proj.weight"].T)
  np.testing.assert_array_equal(layers["w_down"][1], t["model.layers.1.mlp.down_proj.weight"].T)
  np.testing.assert_array_equal(layers["attn_norm"][1], t["model.layers.1.input_layernorm.weight"])
  np.testing.assert_array_equal(layers["mlp_norm"][0],
                                t["model.layers.0.post_attention_layernorm.weight"])
  assert ("lm_head" in params) == (not config.tie_word_embeddings)
  if "lm_head" in params:
    np.testing.assert_array_equal(params["lm_head"], t["lm_head.weight"].T)
  assert ("bq" in layers) == config.qkv_bias == (kind == "qwen2")
  if config.qkv_bias:
    np.testing.assert_array_equal(layers["bk"][1], t["model.layers.1.self_attn.k_proj.bias"])
  assert ("q_norm" in layers) == config.qk_norm == (kind == "qwen3")
  if config.qk_norm:
    np.testing.assert_array_equal(layers["q_norm"][1], t["model.layers.1.self_attn.q_norm.weight"])
  assert jax.tree.map(lambda x: x.shape, params) == hf.param_shapes(config)


def test_load_casts_and_places_with_shardings(tiny_hf_dirs):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
  config = ModelConfig.from_hf_dir(tiny_hf_dirs["qwen3"])
  shardings = jax.tree.map(lambda _: sharding, hf.param_shapes(config),
                           is_leaf=lambda x: isinstance(x, tuple))
  _, params = hf.load_hf_dir(tiny_hf_dirs["qwen3"], dtype=jnp.bfloat16, shardings=shardings)
  for leaf in jax.tree.leaves(params):
    assert leaf.dtype == jnp.bfloat16 and leaf.sharding == sharding


def test_model_checkpoint_round_trip(tiny_hf_dirs, tmp_path):
  hf_dir = tiny_hf_dirs["qwen2"]
  config, params = hf.load_hf_dir(hf_dir)
  out = str(tmp_path / "ckpt")
  checkpoint.save_model_checkpoint(out, params, config, checkpoint.find_tokenizer_files(hf_dir))
  assert checkpoint.is_model_checkpoint(out) and not checkpoint.is_model_checkpoint(hf_dir)
  assert os.path.isfile(os.path.join(out, "tokenizer.json"))
  loaded_config, loaded = checkpoint.load_model_checkpoint(out)
  assert loaded_config == config
  _assert_trees_equal(loaded, params)
  _, cast = checkpoint.load_model_checkpoint(out, dtype=jnp.bfloat16)
  _assert_trees_equal(cast, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))
  with pytest.raises(UserInputError, match="exists and is not empty"):
    checkpoint.save_model_checkpoint(out, params, config)
  checkpoint.save_model_checkpoint(out, params, config, overwrite=True)
  assert not os.path.exists(os.path.join(out, "tokenizer.json"))
  assert not _leftovers(tmp_path)


def test_failed_save_leaves_nothing_behind(tiny_hf_dirs, tmp_path):
  config, params = hf.load_hf_dir(tiny_hf_dirs["qwen3"])
  with pytest.raises(UserInputError, match="no_such_tokenizer.json"):
    checkpoint.save_model_checkpoint(str(tmp_path / "ckpt"), params, config,
                                     [str(tmp_path / "no_such_tokenizer.json")])
  assert os.listdir(tmp_path) == []


# ---- bad inputs: one UserInputError naming the file and tensor ------------------------

def _rewrite(path, edit):
  tensors = safetensors.numpy.load_file(path)
  edit(tensors)
  safetensors.numpy.save_file(tensors, path, metadata={"format": "pt"})


def test_missing_config(tiny_hf_dirs, tmp_path):
  hf_dir = _copy(tiny_hf_dirs["llama"], tmp_path)
  os.remove(hf_dir / "config.json")
  with pytest.raises(UserInputError, match=r"config\.json"):
    hf.load_hf_dir(str(hf_dir))


def test_unknown_model_type(tiny_hf_dirs, tmp_path):
  hf_dir = _copy(tiny_hf_dirs["llama"], tmp_path)
  config = json.loads((hf_dir / "config.json").read_text())
  (hf_dir / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
  with pytest.raises(UserInputError, match=r"config\.json.*gpt2"):
    hf.load_hf_dir(str(hf_dir))


@pytest.mark.parametrize("fields,rejected", [
    ({"sliding_window": 64}, "sliding_window=64"),                # Mistral style
    ({"use_sliding_window": True, "sliding_window": 64}, "use_sliding_window"),
    ({"use_sliding_window": False, "sliding_window": 64}, None),  # Qwen's off switch
    ({"sliding_window": None}, None),
])
def test_sliding_window_is_rejected_unless_off(tiny_hf_dirs, tmp_path, fields, rejected):
  hf_dir = _copy(tiny_hf_dirs["llama"], tmp_path)
  config = json.loads((hf_dir / "config.json").read_text())
  (hf_dir / "config.json").write_text(json.dumps({**config, **fields}))
  if rejected is None:
    hf.load_hf_dir(str(hf_dir))
    return
  with pytest.raises(UserInputError, match=rf"config\.json: {rejected}.*not supported"):
    hf.load_hf_dir(str(hf_dir))


def test_wrong_shape(tiny_hf_dirs, tmp_path):
  hf_dir = _copy(tiny_hf_dirs["qwen2"], tmp_path)
  name = "model.layers.1.self_attn.k_proj.bias"
  _rewrite(hf_dir / "model.safetensors", lambda t: t.update({name: t[name][:-1].copy()}))
  with pytest.raises(UserInputError, match=rf"model\.safetensors: tensor {name} has shape"):
    hf.load_hf_dir(str(hf_dir))


def test_missing_tensor(tiny_hf_dirs, tmp_path):
  hf_dir = _copy(tiny_hf_dirs["qwen3"], tmp_path)
  name = "model.layers.0.self_attn.q_norm.weight"
  _rewrite(hf_dir / "model.safetensors", lambda t: t.pop(name))
  with pytest.raises(UserInputError, match=rf"model\.safetensors: missing tensor {name}"):
    hf.load_hf_dir(str(hf_dir))


def test_untied_model_without_lm_head(tiny_hf_dirs, tmp_path):
  hf_dir = _copy(tiny_hf_dirs["llama"], tmp_path)
  _rewrite(hf_dir / "model.safetensors", lambda t: t.pop("lm_head.weight"))
  with pytest.raises(UserInputError, match=r"missing tensor lm_head\.weight"):
    hf.load_hf_dir(str(hf_dir))


def test_truncated_safetensors(tiny_hf_dirs, tmp_path):
  hf_dir = _copy(tiny_hf_dirs["llama"], tmp_path)
  path = hf_dir / "model.safetensors"
  os.truncate(path, os.path.getsize(path) - 100)
  with pytest.raises(UserInputError, match=r"model\.safetensors: not a readable safetensors"):
    hf.load_hf_dir(str(hf_dir))


def test_sharded_missing_tensor_and_shard(tiny_hf_sharded_dir, tmp_path):
  hf_dir = _copy(tiny_hf_sharded_dir, tmp_path)
  index_path = hf_dir / hf.SAFETENSORS_INDEX
  index = json.loads(index_path.read_text())
  name = "model.layers.2.mlp.up_proj.weight"
  shard = index["weight_map"].pop(name)
  index_path.write_text(json.dumps(index))
  with pytest.raises(UserInputError, match=rf"index\.json: missing tensor {name}"):
    hf.load_hf_dir(str(hf_dir))
  index["weight_map"][name] = shard
  index_path.write_text(json.dumps(index))
  os.remove(hf_dir / shard)
  with pytest.raises(UserInputError, match=rf"{shard}: missing safetensors file"):
    hf.load_hf_dir(str(hf_dir))


# A failed orbax metadata read can leave a tensorstore callback that fires on a closed
# asyncio loop; it is reported as unraisable but does not affect the result.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_bad_model_checkpoints(tiny_hf_dirs, tmp_path):
  config, params = hf.load_hf_dir(tiny_hf_dirs["qwen3"])
  out = tmp_path / "ckpt"
  checkpoint.save_model_checkpoint(str(out), params, config)
  shutil.copy(tiny_hf_dirs["llama"] + "/config.json", out / "config.json")
  with pytest.raises(UserInputError, match="params do not match config.json"):
    checkpoint.load_model_checkpoint(str(out))
  for path in glob.glob(str(out / "params" / "**" / "d" / "*"), recursive=True):
    os.truncate(path, 10)
  with pytest.raises(UserInputError, match=r"params: unreadable orbax checkpoint"):
    checkpoint.load_model_checkpoint(str(out))
  shutil.rmtree(out / "params")
  with pytest.raises(UserInputError, match="missing params directory"):
    checkpoint.load_model_checkpoint(str(out))


# ---- convert_hf CLI -------------------------------------------------------------------

def _convert(*args):
  return subprocess.run([sys.executable, "-m", "experiments.convert_hf", *args], cwd=REPO_ROOT,
                        capture_output=True, text=True, timeout=120)


def test_convert_hf_cli(tiny_hf_dirs, tmp_path):
  hf_dir = tiny_hf_dirs["llama_tied"]
  out = tmp_path / "ckpt"
  result = _convert(f"--hf_dir={hf_dir}", f"--out={out}", "--dtype=bfloat16")
  assert result.returncode == 0, result.stderr
  assert result.stdout.startswith("converted ")
  config, params = hf.load_hf_dir(hf_dir, dtype=jnp.bfloat16)
  loaded_config, loaded = checkpoint.load_model_checkpoint(str(out))
  assert loaded_config == config
  _assert_trees_equal(loaded, params)
  assert os.path.isfile(out / "tokenizer_config.json")


def test_convert_hf_cli_bad_input(tiny_hf_dirs, tmp_path):
  hf_dir = _copy(tiny_hf_dirs["llama"], tmp_path)
  name = "model.layers.2.mlp.down_proj.weight"
  _rewrite(hf_dir / "model.safetensors", lambda t: t.update({name: t[name].T.copy()}))
  out = tmp_path / "ckpt"
  result = _convert(f"--hf_dir={hf_dir}", f"--out={out}")
  assert result.returncode == 2
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and errors[0] == result.stderr.splitlines()[-1]
  assert name in errors[0] and "model.safetensors" in errors[0]
  assert sorted(os.listdir(tmp_path)) == ["hf"]
  result = _convert(f"--hf_dir={hf_dir}")
  assert result.returncode == 2 and result.stderr.startswith("error: ") and "--out" in result.stderr

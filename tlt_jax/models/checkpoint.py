"""Model checkpoints: HF config.json + orbax params/ + the tokenizer files, in one dir.

The dir reads like a HF model dir for everything but the weights (ModelConfig and
AutoTokenizer load it directly), while the orbax params restore straight into any
sharding and dtype without a pass through safetensors.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from tlt_jax.errors import UserInputError
from tlt_jax.files import atomic_dir
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.hf import param_shapes

CONFIG = "config.json"
PARAMS = "params"
# Files a HF model dir may carry besides weights that a trained checkpoint should keep.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")


def find_tokenizer_files(model_dir: str) -> list[str]:
  """Paths of the TOKENIZER_FILES present in `model_dir`."""
  return [os.path.join(model_dir, f) for f in TOKENIZER_FILES
          if os.path.isfile(os.path.join(model_dir, f))]


def is_model_checkpoint(path: str) -> bool:
  return (os.path.isfile(os.path.join(path, CONFIG))
          and os.path.isdir(os.path.join(path, PARAMS)))


def save_model_checkpoint(out_dir: str, params: dict[str, Any], config: ModelConfig,
                          tokenizer_files: Sequence[str] = (), overwrite: bool = False) -> None:
  """Writes `out_dir` atomically: it appears only once every piece is on disk."""
  with atomic_dir(out_dir, overwrite) as tmp:
    for path in tokenizer_files:
      if not os.path.isfile(path):
        raise UserInputError(f"{path}: tokenizer file not found")
      shutil.copy2(path, tmp)
    with open(os.path.join(tmp, CONFIG), "w") as f:
      json.dump(config.to_hf_dict(), f, indent=2)
    save_tree(os.path.join(tmp, PARAMS), params)


def load_model_checkpoint(ckpt_dir: str, dtype=None, shardings: Any = None
                          ) -> tuple[ModelConfig, dict[str, Any]]:
  """Restores (config, params); `dtype` casts on read (default: as saved).

  Without `shardings` every leaf is read to the host and lands on the default device
  uncommitted (as the HF loader's do), so a multi-process job can lay it out on a mesh of
  every process's devices.
  """
  config = ModelConfig.from_hf_dir(ckpt_dir)
  params_dir = epath.Path(ckpt_dir) / PARAMS
  if not params_dir.is_dir():
    raise UserInputError(f"{params_dir}: missing params directory")
  stored = read_tree_metadata(params_dir)
  check_tree_shapes(stored, param_shapes(config), params_dir, f"params do not match {CONFIG}",
                    f"{CONFIG} implies")
  if shardings is None:
    host = jax.tree.map(lambda m: np.empty(m.shape, dtype or m.dtype), stored)
    return config, jax.tree.map(jnp.asarray, restore_tree(params_dir, host))
  target = jax.tree.map(
      lambda m, s: jax.ShapeDtypeStruct(m.shape, dtype or m.dtype, sharding=s), stored, shardings)
  return config, restore_tree(params_dir, target)


# ---- orbax trees: shared by model and drafter checkpoints ----------------------------

def read_tree_metadata(path: epath.Path) -> Any:
  """The stored tree's array metadata (shape, dtype), or a one-line error."""
  try:
    return ocp.StandardCheckpointHandler().metadata(_absolute(path)).tree
  except (OSError, ValueError) as e:
    raise UserInputError(f"{path}: unreadable orbax checkpoint ({_first_line(e)})") from None


def check_tree_shapes(stored: Any, expected: Any, path: epath.Path, what: str,
                      implied_by: str) -> None:
  """Names the first leaf whose stored shape differs from `expected` (shape tuples)."""
  is_shape = lambda x: isinstance(x, tuple)
  flat = lambda tree: {jax.tree_util.keystr(k): v for k, v in
                       jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_shape)[0]}
  got = flat(jax.tree.map(lambda m: tuple(m.shape), stored))
  want = flat(expected)
  for key in sorted(got.keys() | want.keys()):
    if got.get(key) != want.get(key):
      raise UserInputError(f"{path}: {what}: {key} is stored as {got.get(key, 'absent')}, "
                           f"{implied_by} {want.get(key, 'absent')}")


def save_tree(path: epath.Path | str, tree: Any) -> None:
  """Writes a pytree of arrays as an orbax checkpoint at `path` (which must not exist)."""
  with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:
    checkpointer.save(_absolute(path), args=ocp.args.StandardSave(tree))


def restore_tree(path: epath.Path, target: Any) -> Any:
  """Restores a tree shaped and placed like `target` (ShapeDtypeStructs; numpy arrays
  restore to the host)."""
  try:
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:
      return checkpointer.restore(_absolute(path), args=ocp.args.StandardRestore(target))
  except (OSError, ValueError) as e:
    raise UserInputError(f"{path}: cannot restore ({_first_line(e)})") from None


def _absolute(path: epath.Path | str) -> epath.Path:
  """orbax rejects relative paths; command-line paths often are."""
  return epath.Path(os.path.abspath(path))


def _first_line(e: Exception) -> str:
  """tensorstore errors run to pages of JSON spec; the cause is in the first sentence."""
  return str(e).split("\n")[0].split(" [tensorstore_spec")[0][:300]

"""Drafter training: the train state, optimizer, jitted train step, draft vocabulary and
drafter files.

A step trains on packed rows (see packing.py). The target's hidden states come either from
the caller (the rollout keeps the ones it computed anyway) or from one target forward over
the packed rows; no gradient flows into the target, whose embedding and head the drafter
only borrows.

Files in a drafter dir:
  checkpoint/state/       orbax: drafter params (+ optimizer state and step when saved from
                          a TrainState), to resume training exactly
  drafter.safetensors     deployable weights, HF EAGLE names, nn.Linear [out, in] layout,
                          plus `draft_vocab` (int64 target ids) with a reduced vocabulary
  drafter_config.json     drafter shapes and the identity of the target it was trained on
"""
from __future__ import annotations

import functools
import json
import os
from typing import Any, Iterable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
import safetensors
import safetensors.numpy
from etils import epath

from tlt_jax.models.checkpoint import (check_tree_shapes, read_tree_metadata,
                                       restore_tree, save_tree)
from tlt_jax.drafter.losses import CE_WEIGHT, eagle_loss
from tlt_jax.data.packing import PackedRows
from tlt_jax.errors import UserInputError
from tlt_jax.files import atomic_dir, write_atomic
from tlt_jax.models import transformer
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.drafter import (DrafterParams, draft_head, drafter_forward,
                                    init_drafter_cache, init_drafter_params)

CHECKPOINT = "checkpoint"
STATE = "state"
WEIGHTS = "drafter.safetensors"
CONFIG = "drafter_config.json"
DRAFT_VOCAB = "draft_vocab"

# Drafter param -> (exported name, transposed). Params are [in, out], nn.Linear [out, in];
# layer tensors drop the leading layer axis (the drafter has exactly one layer).
_EXPORT_NAMES = {
    ("fc",): ("fc.weight", True),
    ("fc_bias",): ("fc.bias", False),
    ("layers", "wq"): ("layers.0.self_attn.q_proj.weight", True),
    ("layers", "wk"): ("layers.0.self_attn.k_proj.weight", True),
    ("layers", "wv"): ("layers.0.self_attn.v_proj.weight", True),
    ("layers", "wo"): ("layers.0.self_attn.o_proj.weight", True),
    ("layers", "mlp_norm"): ("layers.0.post_attention_layernorm.weight", False),
    ("layers", "w_gate"): ("layers.0.mlp.gate_proj.weight", True),
    ("layers", "w_up"): ("layers.0.mlp.up_proj.weight", True),
    ("layers", "w_down"): ("layers.0.mlp.down_proj.weight", True),
}
# Target fields a drafter depends on beyond its tensor shapes.
_TARGET_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rope_theta")


@flax.struct.dataclass
class TrainState:
  params: DrafterParams
  opt_state: optax.OptState
  step: jax.Array            # int32: optimizer steps taken


def init_train_state(params: DrafterParams, optimizer: optax.GradientTransformation
                     ) -> TrainState:
  return TrainState(params=params, opt_state=optimizer.init(params), step=jnp.int32(0))


# ---- the step ----------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("config",))
def target_hidden(target_params: transformer.Params, batch: PackedRows, *,
                  config: ModelConfig) -> jax.Array:
  """The target's post-norm hidden states [B, T, E] for packed rows, samples kept apart."""
  return transformer.forward_packed(target_params, config, batch.tokens, batch.positions,
                                    batch.segment_ids)


def _shift(x: jax.Array, k: int) -> jax.Array:
  """x[:, j + k] at j (zeros past the end)."""
  if k == 0:
    return x
  pad = [(0, 0), (0, k)] + [(0, 0)] * (x.ndim - 2)
  return jnp.pad(x[:, k:], pad)


def drafter_pairs(batch: PackedRows, hidden: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Slot j's input token x_{j+1} (0 past its sample's end) and its target h_{j+1}.

  The slot at a sample's last token has no successor; it is visible only to itself and
  carries no loss weight, so whatever it holds never reaches the loss.
  """
  same_sample = _shift(batch.segment_ids, 1) == batch.segment_ids
  return jnp.where(same_sample, _shift(batch.tokens, 1), 0), _shift(hidden, 1)


def unrolled_forward(params: DrafterParams, target_params: transformer.Params,
                     config: ModelConfig, tokens: jax.Array, hidden: jax.Array,
                     positions: jax.Array, context: jax.Array, unroll: int,
                     attention_impl: str = "auto") -> list[jax.Array]:
  """Drafter predictions of `unroll` passes over drafter pairs (tokens [B, T] = x_{j+1},
  hidden [B, T, E] = h_j, context [B, T, T] the teacher-forced visibility).

  Pass 1 is teacher-forced: slot j consumes the true h_j. Pass m (m >= 2) is what tree level
  m-1 computes at rollout ("training-time test"): its index j stands for slot j+m-1 and
  consumes the drafter's own prediction from pass m-1 at j; it attends to pass 1's keys
  visible from slot j (the true context), to its own chain's keys from passes 2..m-1 (its
  tree ancestors) and to itself. All passes share one cache of unroll x T slots.
  """
  b, t = tokens.shape
  cache = init_drafter_cache(config, b, t * unroll, params["fc"].dtype)
  itself = jnp.broadcast_to(jnp.eye(t, dtype=bool), (b, t, t))
  preds, inputs = [], hidden
  for m in range(1, unroll + 1):
    if m == 1:
      new_mask, cache_mask = context, None
    else:
      blocks = [context] + [itself] * (m - 2) + [jnp.zeros_like(itself)] * (unroll - m + 1)
      new_mask, cache_mask = itself, jnp.concatenate(blocks, axis=-1)
    inputs, cache = drafter_forward(
        params, target_params, config, _shift(tokens, m - 1), inputs,
        _shift(positions, m - 1), cache.replace(lengths=jnp.full((b,), (m - 1) * t, jnp.int32)),
        new_mask, cache_mask, attention_impl)
    preds.append(inputs)
  return preds


def _loss(params: DrafterParams, target_params: transformer.Params, batch: PackedRows,
          hidden: jax.Array, vocab_ids: jax.Array | None, config: ModelConfig,
          ce_weight: float, unroll: int, attention_impl: str
          ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The EAGLE loss averaged over the unrolled passes. Pass m weighs slot j when slots j and
  j + m - 1 hold the same sample (samples are contiguous, so the whole chain does) and
  the slot it predicts is in the loss mask (a response token); the chain may start in
  the prompt."""
  hidden = jax.lax.stop_gradient(hidden)
  tokens, targets = drafter_pairs(batch, hidden)
  head = draft_head(target_params, config, vocab_ids)
  preds = unrolled_forward(params, target_params, config, tokens, hidden, batch.positions,
                           batch.new_mask, unroll, attention_impl)
  total, metrics = 0.0, {}
  for k, pred in enumerate(preds):
    weights = _shift(batch.loss_mask, k) * (_shift(batch.segment_ids, k) == batch.segment_ids)
    loss, step_metrics = eagle_loss(pred, _shift(targets, k), head, weights, ce_weight)
    total += loss / unroll
    if k == 0:
      metrics = step_metrics
    else:
      metrics[f"top1_acc_pass{k + 1}"] = step_metrics["top1_acc"]
      metrics[f"sampled_accept_pass{k + 1}"] = step_metrics["sampled_accept"]
  metrics["loss"] = total
  return total, metrics


@functools.partial(jax.jit, static_argnames=("config", "optimizer", "ce_weight", "unroll",
                                             "attention_impl"),
                   donate_argnames=("state",))
def train_step(state: TrainState, target_params: transformer.Params, batch: PackedRows,
               vocab_ids: jax.Array | None = None, hidden: jax.Array | None = None, *,
               config: ModelConfig, optimizer: optax.GradientTransformation,
               ce_weight: float = CE_WEIGHT, unroll: int = 1, attention_impl: str = "auto"
               ) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimizer step on packed rows [B, T]; `hidden` None runs the target forward.
  unroll: passes of the loss (1: teacher-forced only; see `_loss`). attention_impl: the
  drafter layer's attention; kernels differentiate through the jnp reference."""
  if hidden is None:
    hidden = target_hidden(target_params, batch, config=config)
  grad_fn = jax.value_and_grad(_loss, has_aux=True)
  (_, metrics), grads = grad_fn(state.params, target_params, batch, hidden, vocab_ids, config,
                                ce_weight, unroll, attention_impl)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics["grad_norm"] = optax.tree.norm(grads)
  return TrainState(params=params, opt_state=opt_state, step=state.step + 1), metrics


@functools.partial(jax.jit, static_argnames=("config", "ce_weight", "unroll", "attention_impl"))
def eval_step(params: DrafterParams, target_params: transformer.Params, batch: PackedRows,
              vocab_ids: jax.Array | None = None, hidden: jax.Array | None = None, *,
              config: ModelConfig, ce_weight: float = CE_WEIGHT,
              unroll: int = 1, attention_impl: str = "auto") -> dict[str, jax.Array]:
  """The train step's metrics without an update, e.g. on held-out rows."""
  if hidden is None:
    hidden = target_hidden(target_params, batch, config=config)
  return _loss(params, target_params, batch, hidden, vocab_ids, config, ce_weight, unroll,
               attention_impl)[1]


def select_draft_vocab(token_id_lists: Iterable[Sequence[int]], size: int, *,
                       vocab_size: int, among: np.ndarray | None = None) -> np.ndarray:
  """The `size` most frequent ids (ties and unseen fill-ins by lowest id), sorted, int32.

  among: choose only from these ids (shrinking an existing draft vocabulary)."""
  limit = vocab_size if among is None else np.size(among)
  if not 1 <= size <= limit:
    raise UserInputError(f"--draft_vocab_size={size}: must be in [1, {limit}]")
  ids = np.concatenate([np.asarray(x, np.int64).reshape(-1) for x in token_id_lists]
                       + [np.zeros((0,), np.int64)])
  if ids.size and not (0 <= ids.min() and ids.max() < vocab_size):
    raise UserInputError(f"drafter corpus: token ids outside [0, {vocab_size})")
  counts = np.bincount(ids, minlength=vocab_size)
  if among is not None:   # -1 ranks every other id after the unseen ones of `among`
    counts = np.where(np.isin(np.arange(vocab_size), among), counts, -1)
  return np.sort(np.argsort(-counts, kind="stable")[:size]).astype(np.int32)


# ---- files -------------------------------------------------------------------------------

def save_drafter(out_dir: str, state_or_params: TrainState | DrafterParams,
                 vocab_ids: Any | None, model_config: ModelConfig, *,
                 target_source: str | None = None) -> None:
  """Writes the resumable orbax checkpoint and the safetensors export into `out_dir`.

  Each piece is replaced atomically, and other files in `out_dir` are left alone.
  """
  state = state_or_params if isinstance(state_or_params, TrainState) else None
  params = state.params if state is not None else state_or_params
  tree = {"params": params}
  if state is not None:
    tree.update(opt_state=state.opt_state, step=state.step)
  os.makedirs(out_dir, exist_ok=True)
  with atomic_dir(os.path.join(out_dir, CHECKPOINT), overwrite=True) as tmp:
    save_tree(os.path.join(tmp, STATE), tree)
  export_drafter(out_dir, params, vocab_ids, model_config,
                 step=int(state.step) if state is not None else None,
                 target_source=target_source)


def export_drafter(out_dir: str, params: DrafterParams, vocab_ids: Any | None,
                   model_config: ModelConfig, *, step: int | None,
                   target_source: str | None, dtype: str | None = None) -> None:
  """Writes the deployable files (safetensors + config) into `out_dir`, each atomically.

  dtype: the stored weight dtype ("float16", "float32"; None keeps the params'). float16
  halves a float32 file; a weight beyond its range is an error, never a silent inf."""
  tensors = {}
  for path, (name, transposed) in _EXPORT_NAMES.items():
    value = np.asarray(functools.reduce(lambda node, key: node[key], path, params))
    value = value[0] if path[0] == "layers" else value
    if dtype is not None:
      limit = np.finfo(dtype).max
      if np.abs(value).max() > limit:
        raise UserInputError(f"{name}: holds values beyond {dtype}'s range {limit:g}")
      value = value.astype(dtype)
    tensors[name] = np.ascontiguousarray(value.T if transposed else value)
  if vocab_ids is not None:
    tensors[DRAFT_VOCAB] = np.asarray(vocab_ids, np.int64)
  os.makedirs(out_dir, exist_ok=True)
  write_atomic(os.path.join(out_dir, WEIGHTS),
                safetensors.numpy.save(tensors, metadata={"format": "np"}))

  target = model_config.to_hf_dict()
  drafter_config = {
      "architecture": "eagle",
      "fc_input": ["embed(x_{t+1})", "h_t"],
      "num_hidden_layers": 1,
      **{k: target[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                "num_key_value_heads", "head_dim", "rms_norm_eps",
                                "rope_parameters", "vocab_size")},
      "draft_vocab_size": None if vocab_ids is None else int(np.size(vocab_ids)),
      "torch_dtype": str(tensors["fc.weight"].dtype),
      "step": step,
      "target": target,
      "target_source": target_source,
  }
  write_atomic(os.path.join(out_dir, CONFIG),
                json.dumps(drafter_config, indent=1).encode())


def load_drafter(drafter_dir: str, model_config: ModelConfig, dtype=jnp.float32
                 ) -> tuple[DrafterParams, np.ndarray | None]:
  """(drafter params, draft vocabulary ids or None) from the safetensors export.

  Every tensor is checked against what `model_config` implies before use, so a drafter for
  another model fails here with one line, not deep inside jit.
  """
  config_path = os.path.join(drafter_dir, CONFIG)
  weights_path = os.path.join(drafter_dir, WEIGHTS)
  for path in (config_path, weights_path):
    if not os.path.isfile(path):
      raise UserInputError(f"{path}: missing (not a drafter dir)")
  try:
    with open(config_path) as f:
      stored_config = json.load(f)
    stored_target = stored_config["target"]
  except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
    raise UserInputError(f"{config_path}: cannot read ({e!r})") from None

  shapes = jax.eval_shape(lambda: init_drafter_params(model_config, jax.random.key(0)))
  params: dict[str, Any] = {"layers": {}}
  try:
    with safetensors.safe_open(weights_path, "numpy") as f:
      names = set(f.keys())
      for path, (name, transposed) in _EXPORT_NAMES.items():
        shape = functools.reduce(lambda node, key: node[key], path, shapes).shape
        layer = path[0] == "layers"
        want = shape[1:] if layer else shape
        want = want[::-1] if transposed else want
        if name not in names:
          raise UserInputError(f"{weights_path}: missing tensor {name}")
        got = tuple(f.get_slice(name).get_shape())
        if got != want:
          raise UserInputError(f"{weights_path}: tensor {name} has shape {got}, the model "
                               f"implies {want} (drafter trained for another model?)")
        value = f.get_tensor(name)
        value = value.T if transposed else value
        value = jnp.asarray(value[None] if layer else value, dtype)
        if layer:
          params["layers"][path[1]] = value
        else:
          params[path[0]] = value
      vocab_ids = f.get_tensor(DRAFT_VOCAB) if DRAFT_VOCAB in names else None
  except (OSError, safetensors.SafetensorError) as e:
    raise UserInputError(f"{weights_path}: not a readable safetensors file ({e})") from None

  if vocab_ids is not None:
    v = model_config.vocab_size
    if (vocab_ids.ndim != 1 or not vocab_ids.size or vocab_ids.min() < 0
        or vocab_ids.max() >= v or np.any(np.diff(vocab_ids) <= 0)):
      raise UserInputError(f"{weights_path}: tensor {DRAFT_VOCAB} must hold sorted unique "
                           f"ids in [0, {v}) for this model")
    vocab_ids = vocab_ids.astype(np.int32)
  model_target = model_config.to_hf_dict()
  for field in _TARGET_FIELDS:
    if stored_target.get(field) != model_target[field]:
      raise UserInputError(f"{config_path}: target.{field} is {stored_target.get(field)}, "
                           f"the model has {model_target[field]}")
  return params, vocab_ids


def restore_train_state(drafter_dir: str, template: TrainState) -> TrainState:
  """The TrainState saved by `save_drafter`, shaped like `template` (same model and
  optimizer), to resume training exactly."""
  state_dir = epath.Path(drafter_dir) / CHECKPOINT / STATE
  if not state_dir.is_dir():
    raise UserInputError(f"{state_dir}: missing drafter checkpoint")
  stored = read_tree_metadata(state_dir)
  if "opt_state" not in stored:
    raise UserInputError(f"{state_dir}: holds drafter params only, no optimizer state")
  check_tree_shapes(stored["params"], jax.tree.map(lambda x: tuple(x.shape), template.params),
                    state_dir, "drafter params", "the model implies")
  tree = {"params": template.params, "opt_state": template.opt_state, "step": template.step}
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), tree)
  restored = restore_tree(state_dir, target)
  return TrainState(**restored)

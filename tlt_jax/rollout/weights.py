"""The rollout's weights: the policy and the learned drafter laid out for the rollout.

The params a trainer or checkpoint holds are one structure on every machine
(tests/test_param_structure.py); the rollout runs them in its own layout, derived here and
nowhere else (`rollout_layout`): per layer, with the matrices and heads packed where the
kernel seam says (`ops.packs_weights`), placed on the replica's mesh by the sharding
rules. The learned drafter reaches the rollout as `DraftWeights`, a pytree argument: a new
drafter (say after a spot trainer's update) is a new argument, never a new config or a
recompile.
"""
from __future__ import annotations

import functools
import weakref

import flax.struct
import jax
from jax.sharding import NamedSharding, PartitionSpec

from tlt_jax import ops
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.drafter import DrafterParams, draft_head, drafter_logical_axes
from tlt_jax.models.transformer import ROLLOUT_HEAD, Params
from tlt_jax.sharding.rules import MeshRules, param_logical_axes, place, spans_devices


PACKED_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def rollout_layout(params: Params, pack_weights: bool | None = None) -> Params:
  """The params with their layers split into a tuple of per-layer pytrees (each weight
  [1, ...]), the layout `transformer.forward` runs as an unrolled loop (its module doc says
  why the rollout wants it). Copies the layer weights once; params already in this layout
  are returned as they are.

  pack_weights also packs every matrix, and the LM head as ROLLOUT_HEAD, into the seam's
  packed form (`ops.pack`); None packs where the seam says it runs (`ops.packs_weights`)."""
  packed = ROLLOUT_HEAD in params
  if isinstance(params["layers"], tuple):
    if pack_weights is False and packed:
      raise ValueError("params are in the packed CPU layout; pass them stacked instead")
    return params
  if pack_weights is None:
    pack_weights = ops.packs_weights(params["embed"].dtype)
  layers = split_layers(params["layers"], pack_weights)
  if not pack_weights:
    return {**params, "layers": layers}
  return {**params, "layers": layers, ROLLOUT_HEAD: _packed_head(params)}


@functools.partial(jax.jit, static_argnums=1)
def split_layers(layers: Params, pack_weights: bool) -> tuple[Params, ...]:
  """Stacked layers [L, ...] as a tuple of per-layer pytrees [1, ...], their matrices packed
  where pack_weights (`rollout_layout`)."""
  if pack_weights:
    layers = {name: ops.pack(w) if name in PACKED_MATRICES else w
              for name, w in layers.items()}
  num_layers = jax.tree.leaves(layers)[0].shape[0]
  return tuple(jax.tree.map(lambda w: w[i:i + 1], layers) for i in range(num_layers))


@jax.jit
def _packed_head(params: Params) -> ops.PackedWeight:
  return ops.pack(params["lm_head"] if "lm_head" in params else params["embed"].T)


@flax.struct.dataclass
class DraftWeights:
  """A learned drafter's weights and its reduced draft vocabulary (sorted target ids;
  None: the target's whole vocabulary)."""
  params: DrafterParams
  vocab_ids: jax.Array | None = None


class _LastMade:
  """The last value made from some arrays, reused while they are the same arrays (held by
  weak references, so a new array, say after a policy update, makes a new value)."""

  def __init__(self):
    self._refs, self._value = (), None

  def get(self, sources: tuple, make):
    # None (say no draft vocabulary) matches only None, not a reference that has died since.
    same = lambda ref, source: (ref is None) == (source is None) and (
        source is None or ref() is source)
    if not (self._refs and len(self._refs) == len(sources)
            and all(map(same, self._refs, sources))):
      self._value = make()
      self._refs = tuple(None if x is None else weakref.ref(x) for x in sources)
    return self._value


_draft_heads, _rollout_drafters = _LastMade(), _LastMade()
_pack = jax.jit(ops.pack)


def drafter_layout(drafter: DrafterParams) -> DrafterParams:
  """The drafter beside target params in the rollout's packed layout (`rollout_layout`):
  its layer split out and its matrices packed as a target layer's are, as a drafting level
  multiplies a few rows by each weight. A drafter the seam does not pack (not float32)
  stays as it is."""
  if isinstance(drafter["layers"], tuple) or not ops.packs_weights(drafter["fc_bias"].dtype):
    return drafter
  return {**drafter, "fc": _pack(drafter["fc"]),
          "layers": split_layers(drafter["layers"], True)}


def rollout_draft_head(params: Params, config: ModelConfig,
                       vocab_ids: jax.Array | None) -> ops.Weight:
  """`draft_head` laid out as the target's head is (packed beside a packed target, as a
  drafting level multiplies a few rows by the whole head), reused while the target's head
  weights (and their packed panels) and the draft vocabulary are the same arrays as the
  last rollout's: its column gather is paid again by every call of a caller that generates
  in many small calls otherwise."""
  packed = params.get(ROLLOUT_HEAD)
  sources = (params["embed"] if config.tie_word_embeddings else params["lm_head"], vocab_ids,
             None if packed is None else packed.panels)
  return _draft_heads.get(sources, lambda: _laid_out_draft_head(params, config, vocab_ids))


def _laid_out_draft_head(params: Params, config: ModelConfig,
                         vocab_ids: jax.Array | None) -> ops.Weight:
  packed = params.get(ROLLOUT_HEAD)
  if packed is None:
    return draft_head(params, config, vocab_ids)
  if vocab_ids is None:
    return packed
  return ops.pack_like(draft_head(params, config, vocab_ids), packed)


def rollout_drafter(drafter: DrafterParams) -> DrafterParams:
  """`drafter_layout`, reused while the drafter's weights are the same arrays (a spot
  trainer's update makes new ones): packing copies every weight."""
  return _rollout_drafters.get(tuple(jax.tree.leaves(drafter)),
                               lambda: drafter_layout(drafter))


def place_rollout(params: Params, config: ModelConfig, drafter: DraftWeights | None,
                  rules: MeshRules | None, platform: str | None = None
                  ) -> tuple[Params, DraftWeights | None]:
  """The params in the rollout's layout (`rollout_layout`) for programs on `platform` (None:
  this process's default backend), and the drafter, laid out on the replica's mesh by the
  rules (tensor-parallel over heads, batch over the data axis); the same rules place every
  cache and constrain every activation of the rollout's programs."""
  # The CPU kernels' packed weights are one device's buffers: they run without a mesh or on
  # a one-device one (the CPU trainer's), where every array is whole; a replica split over
  # devices keeps plain weights.
  one_device = not spans_devices(rules)
  params = rollout_layout(params, pack_weights=one_device and ops.packs_weights(
      params["embed"].dtype, platform))
  if one_device and rules is not None:
    params = jax.device_put(params, NamedSharding(rules.mesh, PartitionSpec()))
  else:
    params = place(params, param_logical_axes(config, per_layer=True), rules)
  if drafter is None:
    return params, None
  packed = ROLLOUT_HEAD in params   # then the drafter is packed beside its target
  layer = rollout_drafter(drafter.params) if packed else drafter.params
  if rules is None:
    return params, drafter.replace(params=layer)
  vocab_ids = None if drafter.vocab_ids is None else place(drafter.vocab_ids, (None,), rules)
  layer = (jax.device_put(layer, NamedSharding(rules.mesh, PartitionSpec())) if packed
           else place(layer, drafter_logical_axes(config), rules))
  return params, DraftWeights(layer, vocab_ids)

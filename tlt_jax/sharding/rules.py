"""Logical-axis -> mesh-axis rules, declared once for params, activations and KV caches.

Params and activations use different logical names for the model width ("embed" vs
"act_embed") because FSDP shards the weights' width but the activations' batch over the
same mesh axis, and one mesh axis may appear only once in a PartitionSpec.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

if TYPE_CHECKING:   # for the annotation only: sharding sits below the models
  from tlt_jax.models.config import ModelConfig

FSDP_TP_RULES: tuple[tuple[str, str], ...] = (
    # params
    ("embed", "fsdp"), ("vocab", "tp"), ("heads", "tp"), ("kv_heads", "tp"), ("mlp", "tp"),
    # activations and caches
    ("batch", "fsdp"), ("act_heads", "tp"), ("act_kv_heads", "tp"), ("act_mlp", "tp"),
    ("act_vocab", "tp"),
)

# Data parallel over the fsdp axis: the batch is split, every param and optimizer buffer
# is whole on every device. For a trainer mesh spanning several processes (one rollout
# replica each), so that each process holds the whole new policy for its next rollout.
DATA_PARALLEL_RULES: tuple[tuple[str, str], ...] = tuple(
    rule for rule in FSDP_TP_RULES if rule != ("embed", "fsdp"))


@dataclasses.dataclass(frozen=True)
class MeshRules:
  """A mesh plus the rules that place logical axes on it; static under jit (hashable)."""
  mesh: Mesh
  rules: tuple[tuple[str, str], ...] = FSDP_TP_RULES

  def spec(self, logical_axes: Sequence[str | None], shape: Sequence[int]) -> PartitionSpec:
    """Maps logical axes to mesh axes; a dim the mesh axis does not divide stays whole."""
    table = dict(self.rules)
    used: set[str] = set()
    out = []
    for name, dim in zip(logical_axes, shape):
      axis = table.get(name) if name else None
      if axis is not None and (axis in used or dim % self.mesh.shape[axis]):
        if axis not in used:
          logging.info("sharding: %s=%d not divisible by mesh axis %s=%d; replicated",
                       name, dim, axis, self.mesh.shape[axis])
        axis = None
      if axis is not None:
        used.add(axis)
      out.append(axis)
    # Canonical form, trailing whole dims dropped, as jit gives its outputs: P(x, None) and
    # P(x) are unequal keys, so an input placed one way would compile a program again.
    while out and out[-1] is None:
      out.pop()
    return PartitionSpec(*out)

  def sharding(self, logical_axes: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
    return NamedSharding(self.mesh, self.spec(logical_axes, shape))


def spans_devices(rules: MeshRules | None) -> bool:
  """Whether arrays laid out by `rules` may be split over several devices. A one-device
  mesh (the CPU trainer's) splits nothing: kernels that see one device's buffers run."""
  return rules is not None and rules.mesh.size > 1


def constrain(x: jax.Array, logical_axes: Sequence[str | None], rules: MeshRules | None):
  """Sharding hint for an activation inside a jitted function; a no-op without a mesh."""
  if rules is None:
    return x
  return jax.lax.with_sharding_constraint(x, rules.sharding(logical_axes, x.shape))


def param_logical_axes(config: ModelConfig, per_layer: bool = False) -> dict[str, Any]:
  """Logical axes of every parameter, the same tree structure as the params; per_layer:
  for the rollout's layout (`rollout.weights.rollout_layout`: each layer's weights [1, ...])."""
  layers = {
      "attn_norm": ("layers", None),
      "wq": ("layers", "embed", "heads"),
      "wk": ("layers", "embed", "kv_heads"),
      "wv": ("layers", "embed", "kv_heads"),
      "wo": ("layers", "heads", "embed"),
      "mlp_norm": ("layers", None),
      "w_gate": ("layers", "embed", "mlp"),
      "w_up": ("layers", "embed", "mlp"),
      "w_down": ("layers", "mlp", "embed"),
  }
  if config.qkv_bias:
    layers.update(bq=("layers", "heads"), bk=("layers", "kv_heads"), bv=("layers", "kv_heads"))
  if config.qk_norm:
    layers.update(q_norm=("layers", None), k_norm=("layers", None))
  axes = {"embed": ("vocab", "embed"), "layers": (layers,) * config.num_layers if per_layer
          else layers, "final_norm": (None,)}
  if not config.tie_word_embeddings:
    axes["lm_head"] = ("embed", "vocab")
  return axes


def tree_shardings(logical_axes: Mapping[str, Any], shapes: Mapping[str, Any],
                   rules: MeshRules) -> Any:
  """NamedShardings for a tree of arrays (or ShapeDtypeStructs) given its logical axes."""
  return jax.tree.map(lambda axes, x: rules.sharding(axes, x.shape), logical_axes, shapes,
                      is_leaf=_is_axes)


def _is_axes(node) -> bool:
  """A leaf of a logical-axes tree: a tuple of axis names (tuples of subtrees are not)."""
  return isinstance(node, tuple) and all(a is None or isinstance(a, str) for a in node)


def place(tree: Any, logical_axes: Mapping[str, Any], rules: MeshRules | None) -> Any:
  """`tree` laid out on the rules' mesh by its logical axes; as it is without rules."""
  if rules is None:
    return tree
  return jax.device_put(tree, tree_shardings(logical_axes, tree, rules))

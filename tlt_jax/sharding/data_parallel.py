"""Data-parallel training steps: each data shard runs its own rows against its whole copy
of the params, with no collective inside, and the shards meet once per optimizer step.

Under `DATA_PARALLEL_RULES` (a trainer mesh spanning several processes) the params are
whole on every shard of the data axis. Left to GSPMD, a micro-batch's gradient with
respect to replicated params comes out replicated, so every micro-batch all-reduces the
whole gradient; here a micro-batch runs inside `shard_map` over the data axis: each shard
adds its own gradient to its own slice of an accumulator with a leading data axis, and the
optimizer step sums that axis (one all-reduce per optimizer step, what DDP's `no_sync`
does). Any other mesh axis (tp) stays automatic inside a shard.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec

from tlt_jax.errors import UserInputError
from tlt_jax.sharding.mesh import MESH_AXES
from tlt_jax.sharding.rules import DATA_PARALLEL_RULES, MeshRules

DATA_AXIS = MESH_AXES[0]   # the mesh axis the batch is split over


def data_shards(rules: MeshRules | None) -> int:
  """How many shards compute their own gradients: the data axis's size under
  `DATA_PARALLEL_RULES` (params whole on each of its shards), else 1 (FSDP splits the
  params over it, and each micro-batch's gradient is reduce-scattered as it comes)."""
  if rules is None or rules.rules != DATA_PARALLEL_RULES:
    return 1
  return rules.mesh.shape[DATA_AXIS]


def check_micro_batch_rows(micro_batch_rows: int, rules: MeshRules | None) -> None:
  """A micro-batch's rows split evenly over the data shards."""
  shards = data_shards(rules)
  if micro_batch_rows % shards:
    raise UserInputError(f"--micro_batch_rows={micro_batch_rows}: must be a multiple of the "
                         f"trainer's {shards} data-parallel shards (a micro-batch's rows split "
                         "evenly over them)")


def _rules_in_shard(rules: MeshRules) -> MeshRules | None:
  """The rules inside one data shard: its rows are not split further; the other axes (tp)
  as before, on the mesh `shard_map` traces with (the data axis manual). None when nothing
  else is split: a shard is then one device, and kernels see its buffers."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.size == mesh.shape[DATA_AXIS]:
    return None
  return MeshRules(mesh, tuple(r for r in rules.rules if r[1] != DATA_AXIS))


def per_shard(fn: Callable[..., Any], rules: MeshRules, in_specs: Any, out_specs: Any
              ) -> Callable[..., Any]:
  """`fn(*args, rules=<rules in a shard>)` run on each data shard (`shard_map` over the data
  axis only). Specs name the data axis alone: `SHARDED` for a leading data axis, `WHOLE`
  for a value every shard holds whole."""
  body = lambda *args: fn(*args, rules=_rules_in_shard(rules))
  # Unchecked, for two reasons. With checking, the gradient with respect to params that
  # are WHOLE would be all-reduced inside `fn` (the transpose of their implicit broadcast to
  # the shards): the per-micro-batch all-reduce again, and `shards` times the gradient once
  # the optimizer step sums the shards. And the kernel seam's per-platform branches
  # (`ops.by_platform`) do not say which of their outputs vary across shards. `fn` reduces
  # what it returns WHOLE itself.
  return jax.shard_map(body, mesh=rules.mesh, in_specs=in_specs, out_specs=out_specs,
                       axis_names={DATA_AXIS}, check_vma=False)


SHARDED = PartitionSpec(DATA_AXIS)
WHOLE = PartitionSpec()


def with_data_axis(x: jax.Array, rules: MeshRules) -> NamedSharding:
  """The sharding of a per-shard stack of arrays like `x` ([shards, *x.shape]): one slice
  per data shard, each laid out as `x` within its shard."""
  return NamedSharding(rules.mesh, PartitionSpec(DATA_AXIS, *x.sharding.spec))

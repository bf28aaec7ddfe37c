"""Host-side collectives over every process of the job, and each process's own copy of a
replicated array.

The RL step moves rollouts between replicas as fixed-shape arrays through a collective
(`allgather`: every process gets every process's rows), never through the key-value store.
Arrays laid out on a mesh of several processes are read on the host through a gather
(`to_host`), or used by a process through its own copy (`local_copy`): for a replicated
array the whole value on one of its devices, for one split only within processes (--tp
inside each process of a data-parallel mesh) its shards on this process's devices.
"""
from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding


def process_count() -> int:
  return jax.process_count()


def allgather(tree: Any) -> Any:
  """Every process's `tree` of same-shaped host arrays, stacked on a new leading axis
  [process_count, ...] in process order, on every process. The leaves travel as one byte
  buffer: one collective, whatever the tree's size (each collective costs a round trip)."""
  leaves, treedef = jax.tree.flatten(tree)
  leaves = [np.asarray(x).copy(order="C") for x in leaves]
  if jax.process_count() == 1:
    return jax.tree.unflatten(treedef, [x[None] for x in leaves])
  buffer = np.concatenate([x.reshape(-1).view(np.uint8) for x in leaves]) if leaves else (
      np.zeros(0, np.uint8))
  gathered = multihost_utils.process_allgather(buffer, tiled=False)
  out, offset = [], 0
  for x in leaves:
    chunk = gathered[:, offset:offset + x.nbytes]
    out.append(chunk.copy(order="C").view(x.dtype).reshape((len(gathered), *x.shape)))
    offset += x.nbytes
  return jax.tree.unflatten(treedef, out)


def allgather_json(value: Any) -> list[Any]:
  """Every process's JSON-serializable `value`, in process order, on every process (small
  host state such as a bandit's counts: two collectives, the lengths and then the bytes)."""
  data = np.frombuffer(json.dumps(value).encode(), np.uint8)
  lengths = allgather(np.array(len(data), np.int64))
  padded = np.zeros(int(lengths.max()), np.uint8)
  padded[:len(data)] = data
  gathered = allgather(padded)
  return [json.loads(row[:n].tobytes()) for row, n in zip(gathered, lengths)]


def to_host(tree: Any) -> Any:
  """`jax.device_get`, for arrays split across processes too: those are gathered first
  (a collective: every process must call it)."""
  def one(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return multihost_utils.process_allgather(x, tiled=True)
    return jax.device_get(x)
  return jax.tree.map(one, tree)


def local_copy(tree: Any) -> Any:
  """Each leaf as this process can use it alone: unchanged when all its shards are local;
  else, when it is split only over mesh axes inside each process (replicated, or --tp
  inside each process of a data-parallel mesh), the same layout over this process's part
  of the mesh, from its own shards. A leaf split across processes raises: it has no whole
  local copy."""
  def one(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
      return x
    return _local_part(x)
  return jax.tree.map(one, tree)


def _local_part(x: jax.Array) -> jax.Array:
  """`x` on the sub-mesh of this process's slabs of its mesh's leading axis (the one that
  runs across processes), from its local shards; a replicated `x` on another layout: its
  first local shard."""
  mesh, spec = getattr(x.sharding, "mesh", None), getattr(x.sharding, "spec", None)
  if mesh is not None:
    mine = np.vectorize(lambda d: d.process_index == jax.process_index())(mesh.devices)
    slabs = mine.reshape(mine.shape[0], -1).all(axis=1)
    if slabs.any() and mine.sum() == mine[slabs].size:
      local = NamedSharding(Mesh(mesh.devices[slabs], mesh.axis_names), spec)
      expected = local.devices_indices_map(x.shape)
      shards = {s.device: s for s in x.addressable_shards}
      if all(expected[d] == shards[d].index for d in local.device_set):
        return jax.make_array_from_single_device_arrays(
            x.shape, local, [shards[d].data for d in local.mesh.devices.flat])
  if x.is_fully_replicated:
    return x.addressable_data(0)
  raise ValueError(f"an array of shape {x.shape} is split across processes "
                   f"({x.sharding}); it has no whole local copy")

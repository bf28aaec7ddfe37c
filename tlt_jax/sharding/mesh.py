"""Device meshes: one per role (trainer, each rollout replica), as disjoint device slices.

Axis types are always passed explicitly: `jax.make_mesh` defaults differ across jax 0.10
and 0.11, and the code relies on automatic (GSPMD) propagation inside jitted functions.
"""
from __future__ import annotations

from typing import Sequence

import jax
from jax.sharding import AxisType, Mesh

from tlt_jax.errors import UserInputError

MESH_AXES = ("fsdp", "tp")


def make_mesh(fsdp: int, tp: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (fsdp, tp) mesh over `devices` (default: all devices of this process group)."""
  devices = list(jax.devices() if devices is None else devices)
  if fsdp < 1 or tp < 1 or fsdp * tp != len(devices):
    raise UserInputError(
        f"mesh: fsdp={fsdp} x tp={tp} must equal the number of devices ({len(devices)})")
  return jax.make_mesh((fsdp, tp), MESH_AXES, axis_types=(AxisType.Auto,) * 2, devices=devices)

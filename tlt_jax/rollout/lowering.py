"""Every program of a rollout lowered for a platform this machine may lack (GPU, TPU).

JAX lowers for another platform with no extra package and no device:
`jit(f).trace(*args).lower(lowering_platforms=("cuda",))` is the StableHLO a GPU would
compile, Pallas kernels included (Triton IR on cuda, Mosaic on tpu), and the kernel seam
picks each kernel for the platform being lowered for (`tlt_jax.ops.by_platform`).
`lower_rollout` walks `Rollout.programs` as `precompile` does (`ProgramBuilder`), but its
runner traces each program instead of running it: states are shapes, nothing is compiled or
run here, and every program a rollout can dispatch is covered, new ones included.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax

from tlt_jax.rollout.engine import Program, Rollout
from tlt_jax.rollout.precompile import ProgramBuilder


class LoweringError(Exception):
  """A program that does not lower for a platform: which one, and JAX's reason."""


def lower_rollout(rollout: Rollout, groups: Sequence[int], extras: Sequence[Sequence[int]],
                  platforms: Sequence[str]) -> dict[tuple[Program, str], list[str]]:
  """(program, platform) -> the StableHLO text of each jitted call building that program
  (a prefill runs one per distinct prompt count), for every program of `rollout.programs`.
  The rollout comes from `prepare_rollout(..., platform=P)` (weights laid out for P); its
  groups and extras too. Raises `LoweringError` naming the program that fails."""
  lowerer = _Lowerer(tuple(platforms))
  builder = ProgramBuilder(dataclasses.replace(rollout, runner=lowerer), len(groups), groups,
                           extras)
  for program in rollout.programs():
    lowerer.program = program
    builder.build(program)
  return lowerer.texts


class _Lowerer:
  """A `Rollout.runner` that traces each program, lowers it for every platform, and hands
  back its outputs' shapes as the next program's inputs."""

  def __init__(self, platforms: tuple[str, ...]):
    self.platforms = platforms
    self.program: Program | None = None
    self.texts: dict[tuple[Program, str], list[str]] = {}

  def __call__(self, fn: Callable, args: tuple, kwargs: dict):
    if hasattr(fn, "trace"):             # a jitted program
      traced = fn.trace(*args, **kwargs)
    else:                                # a few eager ops (a model-free switch)
      traced = jax.jit(functools.partial(fn, **kwargs)).trace(*args)
    for platform in self.platforms:
      try:
        text = traced.lower(lowering_platforms=(platform,)).as_text()
      except Exception as e:  # noqa: BLE001 -- any lowering failure, named by program
        raise LoweringError(f"{self.program} ({traced.fun_name}) for {platform}: "
                            f"{type(e).__name__}: {e}") from e
      self.texts.setdefault((self.program, platform), []).append(text)
    return traced.out_info

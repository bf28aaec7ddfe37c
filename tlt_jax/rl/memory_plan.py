"""Per-device memory of an RL run, estimated from its config and flags before anything loads.

An RL step has two phases that never hold their working sets at once: the rollout (the
policy laid out for it, the KV cache of at most `max_rows` rows, the drafter's cache once
SD is on) and the update (gradients, a bfloat16 run's compute copy of the weights, and the
micro-batch's activations). Both sit on the state that stays for the whole run: the
policy's float32 master weights and AdamW moments (`rl.precision`), the reference model
(in the compute dtype) with KL on, and a learned drafter with its AdamW state. A run fits
when each phase's peak fits a device.

Sizes come from the same definitions the run uses: param shapes from `jax.eval_shape` of
the model's init, split per device by the run's sharding rules on an abstract mesh of
--fsdp x --tp devices (so a plan for 8 GPUs runs on one CPU; with --replicas > 1 the
trainer is data parallel, params whole on every device, and each replica's rollout runs
its share of the rows on its share of the devices, as `rl_flags.trainer_rules` and
`replica_rules` lay them out), a row's rollout bytes from
`rollout.budget`, the cache length from `engine.cache_length`. Activations are an estimate
per micro-batch (its rows are split over fsdp only when fsdp divides them):
  without remat: every layer keeps its weight matmuls' outputs (q, k, v, attention out,
    gate, up, down) and its input, L x n x (H*D + 2*K*D + 2*F)/tp + 3*E values;
  with remat: every layer's input, L x n x E, plus one layer recomputed;
  both: one layer's attention scores and probabilities in float32 (the jnp attention the
    update differentiates: rows x H/tp x T^2 x 2), and float32 logits of the scored slots
    and their gradient (at most n x V/tp x 2);
with n the micro-batch's tokens on a device and T its row length. XLA's own temporaries
come on top: leave headroom (a --kv_cache_memory_fraction below 1).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType

from tlt_jax.errors import UserInputError
from tlt_jax.models import drafter as drafter_lib
from tlt_jax.models import transformer
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.kv_cache import CACHE_AXES
from tlt_jax.rollout.budget import kv_bytes_per_row, row_bytes, rows_within
from tlt_jax.rollout.buckets import BucketSpec
from tlt_jax.rollout.engine import cache_length
from tlt_jax.rollout.spec_config import SpecConfig
from tlt_jax.sharding.data_parallel import check_micro_batch_rows
from tlt_jax.sharding.mesh import MESH_AXES
from tlt_jax.sharding.rules import DATA_PARALLEL_RULES, MeshRules, param_logical_axes

GIB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class RunShape:
  """What sizes a run's memory: the model, its devices and the step's shapes (flags)."""
  config: ModelConfig
  dtype: str
  fsdp: int
  tp: int
  rollout_rows: int          # rows of a replica's largest rollout (its groups, or validation)
  max_prompt_len: int
  max_new_tokens: int
  micro_batch_rows: int
  train_seq_len: int
  remat: bool
  reference: bool            # --kl_coef > 0 keeps a reference model
  spec: SpecConfig | None
  drafter: bool              # a learned drafter is loaded (and trained online)
  max_rows: int              # --rollout_max_rows; 0: none
  kv_fraction: float         # --kv_cache_memory_fraction; 0: none
  device_bytes: int
  capture_hidden: bool = False   # the rollout hands back hidden states (online drafter)
  replicas: int = 1          # --replicas: rollout replicas, one process each

  @property
  def rules(self) -> MeshRules:
    """The trainer's: fsdp x tp; data parallel over every process with several replicas."""
    mesh = _abstract_mesh(self.fsdp, self.tp)
    return MeshRules(mesh) if self.replicas == 1 else MeshRules(mesh, DATA_PARALLEL_RULES)

  @property
  def rollout_rules(self) -> MeshRules:
    """A rollout replica's: the trainer's devices with one, else its process's share."""
    if self.replicas == 1:
      return self.rules
    return MeshRules(_abstract_mesh(max(self.fsdp // self.replicas, 1), self.tp))

  @property
  def keep_hidden(self) -> bool:
    """Whether rollout rows keep a token and hidden-state record (`Rollout.keep_hidden`)."""
    return self.capture_hidden or (self.spec is not None and self.spec.learned)

  @property
  def itemsize(self) -> int:
    return jnp.dtype(self.dtype).itemsize

  @property
  def cache_len(self) -> int:
    buckets = BucketSpec()
    return cache_length(self.max_prompt_len + self.max_new_tokens,
                        buckets.prompt_length(self.max_prompt_len), self.spec, buckets)


def _abstract_mesh(fsdp: int, tp: int) -> AbstractMesh:
  return AbstractMesh((fsdp, tp), MESH_AXES, axis_types=(AxisType.Auto,) * 2)


def sharded_bytes(shapes, logical_axes, rules: MeshRules) -> int:
  """Bytes one device holds of a tree of ShapeDtypeStructs laid out by its logical axes."""
  def leaf(axes, x):
    spec = rules.spec(axes, x.shape)
    split = math.prod(rules.mesh.shape[a] for a in spec if a is not None)
    return x.size * x.dtype.itemsize // split
  return sum(jax.tree.leaves(jax.tree.map(
      leaf, logical_axes, shapes, is_leaf=lambda n: isinstance(n, tuple) and all(
          a is None or isinstance(a, str) for a in n))))


def _shard(rules: MeshRules, axis: str, dim: int) -> int:
  """How many ways a dim of logical `axis` splits (1 when the mesh axis does not divide)."""
  spec = rules.spec((axis,), (dim,))
  return rules.mesh.shape[spec[0]] if spec else 1


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """Bytes per device of each part of a run, and the rollout's row budget."""
  shape: RunShape
  params: int
  optimizer: int
  reference: int
  drafter: int               # drafter params + AdamW moments
  rollout_weights: int       # the policy's copy for the rollout (its layers, or all of it
                             # in the compute dtype)
  update_weights: int        # the update's compute-dtype copy of the params (0 in float32)
  drafter_cache: int         # the drafter's KV cache at the SD batch
  per_row: int               # one rollout row (KV cache, outputs, hidden record)
  grads: int                 # the accumulator and one micro-batch's gradient
  activations: dict          # {"remat": bytes, "no_remat": bytes}
  max_rows: int              # rows the rollout holds at most
  row_shards: int            # devices the rollout's batch is split over

  @property
  def resident(self) -> int:
    return self.params + self.optimizer + self.reference + self.drafter

  @property
  def kv_cache(self) -> int:
    return self.per_row * -(-self.max_rows // self.row_shards)

  @property
  def rollout_peak(self) -> int:
    return self.resident + self.rollout_weights + self.drafter_cache + self.kv_cache

  def train_peak(self, remat: bool | None = None) -> int:
    remat = self.shape.remat if remat is None else remat
    return (self.resident + self.grads + self.update_weights
            + self.activations["remat" if remat else "no_remat"])

  @property
  def waves(self) -> int:
    """Batches' worth of rows a rollout admits: its first wave and the refills."""
    return -(-self.shape.rollout_rows // self.max_rows)


def plan_memory(shape: RunShape) -> MemoryPlan:
  """Every part's bytes per device, and the row budget: --rollout_max_rows, else the rows
  --kv_cache_memory_fraction of the memory the rollout leaves free holds, else every row
  of the largest rollout at once."""
  config, rules, rollout_rules = shape.config, shape.rules, shape.rollout_rules
  dtype = jnp.dtype(shape.dtype)
  drafter = 0
  if shape.drafter:
    draft_shapes = jax.eval_shape(lambda: drafter_lib.init_drafter_params(
        config, jax.random.key(0), dtype))
    drafter = 3 * sharded_bytes(draft_shapes, drafter_lib.drafter_logical_axes(config), rules)
  row_shards = _shard(rollout_rules, "batch", shape.max_rows or shape.rollout_rows)
  kv_split = _shard(rollout_rules, CACHE_AXES[2], config.num_kv_heads)
  kv = kv_bytes_per_row(config, shape.cache_len, dtype)
  # tp splits a row's KV heads; its outputs and hidden record stay whole.
  per_row = kv // kv_split + row_bytes(config, shape.cache_len, shape.max_new_tokens, dtype,
                                       shape.keep_hidden) - kv
  learned = shape.spec is not None and shape.spec.learned
  sd_rows = BucketSpec().batch_bucket(shape.spec.threshold) if learned else 0
  drafter_cache = sd_rows * kv_bytes_per_row(drafter_lib.drafter_layer_config(config),
                                             shape.cache_len, dtype) // kv_split
  plan = MemoryPlan(shape=shape, **_policy_weights(shape), drafter=drafter,
                    drafter_cache=drafter_cache, per_row=per_row,
                    activations=_activations(shape), max_rows=0, row_shards=row_shards)
  max_rows = _max_rows(plan)
  return dataclasses.replace(plan, max_rows=max_rows,
                             row_shards=_shard(rollout_rules, "batch", max(max_rows, 1)))


def _policy_weights(shape: RunShape) -> dict[str, int]:
  """The policy's bytes per device: float32 master weights, their AdamW moments and
  gradients (the accumulator and a micro-batch's), the reference model and the copies the
  forwards read. A float32 run's rollout copies only the layers (into its per-layer
  layout); a bfloat16 run's rollout and update each read a bfloat16 copy of it all."""
  config, axes = shape.config, param_logical_axes(shape.config)
  in_dtype = lambda dtype: jax.eval_shape(
      lambda: transformer.init_params(config, jax.random.key(0), dtype))
  master, computed = in_dtype(jnp.float32), in_dtype(jnp.dtype(shape.dtype))
  params = sharded_bytes(master, axes, shape.rules)
  copy = sharded_bytes(computed, axes, shape.rules)
  mixed = jnp.dtype(shape.dtype) != jnp.float32
  return dict(params=params, optimizer=2 * params, grads=2 * params,
              reference=copy if shape.reference else 0,
              rollout_weights=(sharded_bytes(computed, axes, shape.rollout_rules) if mixed
                               else sharded_bytes(master["layers"], axes["layers"],
                                                  shape.rollout_rules)),
              update_weights=copy if mixed else 0)


def _max_rows(plan: MemoryPlan) -> int:
  shape = plan.shape
  if shape.max_rows:
    return min(shape.max_rows, shape.rollout_rows)
  if not shape.kv_fraction:
    return shape.rollout_rows
  free = shape.device_bytes - (plan.rollout_peak - plan.kv_cache)
  rules = shape.rollout_rules
  shards = _shard(rules, "batch", rules.mesh.shape["fsdp"])
  return min(rows_within(shape.kv_fraction * max(free, 0), plan.per_row, shards),
             shape.rollout_rows)


def _activations(shape: RunShape) -> dict[str, int]:
  """The micro-batch's activation estimate per device (module doc), with and without remat."""
  c, rules, b = shape.config, shape.rules, shape.itemsize
  rows = shape.micro_batch_rows // _shard(rules, "batch", shape.micro_batch_rows)
  n, t = rows * shape.train_seq_len, shape.train_seq_len
  heads = c.num_heads // _shard(rules, "act_heads", c.num_heads)
  split_tp = lambda width, axis: width // _shard(rules, axis, width)
  per_layer = (heads * c.head_dim + 2 * split_tp(c.num_kv_heads, "act_kv_heads") * c.head_dim
               + 2 * split_tp(c.intermediate_size, "act_mlp") + 3 * c.hidden_size)
  attention = rows * heads * t * t * 4 * 2
  logits = n * split_tp(c.vocab_size, "act_vocab") * 4 * 2
  return {"no_remat": c.num_layers * n * per_layer * b + attention + logits,
          "remat": (c.num_layers * n * c.hidden_size + n * per_layer) * b + attention + logits}


def check(plan: MemoryPlan) -> None:
  """Refuses, in one line naming the flag to change, a run whose rollout or update does
  not fit a device, or whose micro-batches do not split over its data shards."""
  shape, gib = plan.shape, lambda x: f"{x / GIB:.1f} GiB"
  check_micro_batch_rows(shape.micro_batch_rows, shape.rules)
  have = shape.device_bytes
  if plan.resident > have:
    # With several replicas the trainer is data parallel: only --tp splits the params.
    flag, fix = ((f"--fsdp={shape.fsdp}", "shard them over more devices") if shape.replicas == 1
                 else (f"--replicas={shape.replicas}", "every device holds them whole with "
                       "several replicas: run one, or split them over more --tp"))
    raise UserInputError(
        f"{flag}: params, optimizer state{', reference' if shape.reference else ''}"
        f"{' and drafter' if shape.drafter else ''} take {gib(plan.resident)} per device of "
        f"{gib(have)}; {fix}")
  if plan.train_peak() > have:
    flag = ("--remat" if not shape.remat and plan.train_peak(True) <= have else
            f"--micro_batch_rows={shape.micro_batch_rows}")
    activations = plan.activations["remat" if shape.remat else "no_remat"]
    raise UserInputError(
        f"{flag}: the update needs {gib(plan.train_peak())} per device (gradients "
        f"{gib(plan.grads)}, activations {gib(activations)}) of {gib(have)}")
  if plan.max_rows < 1 or plan.rollout_peak > have:
    room = have - (plan.rollout_peak - plan.kv_cache)
    fits = rows_within(max(room, 0), plan.per_row, plan.row_shards)
    flag = (f"--rollout_max_rows={shape.max_rows}" if shape.max_rows else
            f"--kv_cache_memory_fraction={shape.kv_fraction}" if shape.kv_fraction else
            "--rollout_max_rows (unset: every row at once)")
    raise UserInputError(
        f"{flag}: the rollout's {plan.max_rows} rows x {shape.cache_len} cache slots need "
        f"{gib(plan.kv_cache)} per device beside {gib(plan.rollout_peak - plan.kv_cache)} of "
        f"weights, of {gib(have)}; at most {fits} rows fit"
        + ("" if fits else " (lower --max_new_tokens or add devices)"))


def describe(plan: MemoryPlan) -> list[str]:
  """The plan as lines of text, per device."""
  shape, gib = plan.shape, lambda x: f"{x / GIB:8.2f} GiB"
  act = plan.activations
  replicas = "" if shape.replicas == 1 else (
      f"; {shape.replicas} rollout replicas, the update data parallel")
  return [
      f"per device ({shape.fsdp} fsdp x {shape.tp} tp, {shape.device_bytes / GIB:.1f} GiB "
      f"each; {shape.dtype}{replicas}):",
      f"  params (float32 master) {gib(plan.params)}",
      f"  optimizer state (AdamW) {gib(plan.optimizer)}",
      f"  reference model         {gib(plan.reference)}",
      f"  drafter + its AdamW     {gib(plan.drafter)}",
      f"  rollout: policy weights {gib(plan.rollout_weights)}",
      f"  rollout: KV cache       {gib(plan.kv_cache)}  ({plan.max_rows} rows x "
      f"{shape.cache_len} slots, {plan.per_row / 2**20:.1f} MiB a row per device)",
      f"  rollout: drafter cache  {gib(plan.drafter_cache)}",
      f"  update: gradients       {gib(plan.grads)}",
      f"  update: compute weights {gib(plan.update_weights)}",
      f"  update: activations     {gib(act['remat'])} with remat, {gib(act['no_remat'])} "
      f"without ({shape.micro_batch_rows} rows x {shape.train_seq_len} tokens per micro-batch)",
      f"  peak: rollout {gib(plan.rollout_peak)}, update {gib(plan.train_peak())}"
      f" (remat {'on' if shape.remat else 'off'})",
      f"rollout{' (per replica)' if shape.replicas > 1 else ''}: {shape.rollout_rows} rows, "
      f"at most {plan.max_rows} at once: {plan.waves} batches' worth (admission waves: the "
      f"first and at least {plan.waves - 1} refills)",
  ]

"""The drafter's side of an RL step, what TLT adds to GRPO: train the drafter online on the
devices the long tail leaves idle, keep every replica's drafter the same, deploy it only
when it beats the deployed one.

Per replica and RL step:
1. `observe`: the replica's own responses, with the hidden states its rollout computed
   anyway, go into its online buffer (`drafter/buffer.py`: one-step offset, held-out split).
2. `score`: once its rows are done, a replica that is not the last to finish scores the
   drafters the gate decides between on its held-out windows (below).
3. `train_while_idle`: then it trains the drafter from its buffer until the control plane
   says the last replica has finished (`stop`, read between drafter steps only, so the
   rollout's end waits at most one drafter step).
4. `gate`, at the step end: the scores are summed over replicas (a collective) and decide
   (`drafter/gate.py`). What is scored is the candidate of the last sync, the deployed
   drafter (which this step's rollout used) and the drafter the run started from (the
   shipped one), so what online training gained over never training is measured on the
   same tokens, not across runs that sampled others. The candidate replaces the deployed
   drafter only if it beats both; else the shipped drafter comes back if it beats the
   deployed one (a candidate that won on one step's few held-out windows can lose on the
   next). Scoring on the idle replicas keeps the gate off the rollout's critical path; the
   price is a step of lag: a candidate trained in step t is judged on the held-out windows
   of steps t and t + 1 (no candidate ever trains on held-out windows; two steps' make up
   for the last replica's, which are not scored) and deployed for step t + 2. A drafter
   equal to another scored one (the candidate no sync has changed since it was deployed;
   the shipped drafter while it is deployed) is not scored again.
5. `sync`: one collective leaves the same candidate on every replica: the replicas'
   drafters averaged, weighted by the steps each trained. Every replica starts a step from
   the same drafter, so this is one round of local SGD; a replica that did not train counts
   zero, and where none trained nothing changes. Optimizer moments average alike; integer
   leaves (step counts) come from the replica that trained most. The average is formed on
   every process from the gathered copies in process order, so every replica holds the
   same bits.
6. `share_long`, at the step end too: each replica's own long responses of the step, with
   their hidden states, go to every other replica's buffer, for later steps to replay
   beside their own (the one-step offset, job-wide). The long tail's responses are on the
   replica that decoded them, the last to finish; the replica the tail leaves idle holds
   the short ones, and would otherwise train on those alone and run out of data first.
With `train="on_decay"` training waits until the deployed drafter's measured accept length
decays.

A drafter step that raises (say the device ran out of memory) loses the state it was
given (train steps donate it): the candidate falls back to the last synced one, kept on the
host, and the round counts as untrained. The rollout never depends on the candidate.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Iterable, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax import optim
from tlt_jax.data.packing import layout_rows
from tlt_jax.drafter import gate as gate_lib
from tlt_jax.drafter import online
from tlt_jax.drafter.buffer import BufferConfig, OnlineBuffer
from tlt_jax.drafter.losses import CE_WEIGHT
from tlt_jax.drafter.trainer import TrainState, init_train_state
from tlt_jax.errors import UserInputError
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.transformer import Params
from tlt_jax.rollout.buckets import round_up
from tlt_jax.rollout.weights import DraftWeights

TRAIN_MODES = ("always", "on_decay")


@dataclasses.dataclass(frozen=True)
class SpotConfig:
  train: str = "always"            # "always" | "on_decay"
  buffer: BufferConfig = BufferConfig()
  lr: float = 3e-4
  lr_steps: int = 100_000          # the drafter's cosine schedule length, in drafter steps
  # Adam's first steps move every weight by ~lr whatever the gradient's size, which knocks
  # a warm drafter off its optimum: ramp the rate up over this many drafter steps.
  warmup_steps: int = 0
  max_steps: int = 10_000          # drafter steps per RL step, at most
  # Passes over the RL step's trainable slots, at most: a replica whose buffer holds a few
  # responses fits them within a few steps, and more steps only overfit them.
  max_epochs: float = 2.0
  # Each replica's own long responses of a step, at most this many bytes of tokens and
  # hidden states, go to every other replica's buffer at the step end (`share_long`).
  share_bytes: int = 64 << 20
  unroll: int = 2                  # loss passes; also the chain depth the gate scores
  greedy: bool = False             # gate on top-1 agreement (greedy rollouts) or sampling
  gate_margin: float = 0.0
  decay_tolerance: float = 0.1

  def __post_init__(self):
    if self.train not in TRAIN_MODES:
      raise UserInputError(f"--drafter_train={self.train!r}: expected one of "
                           f"off, {', '.join(TRAIN_MODES)}")
    if self.max_steps < 1 or self.unroll < 1:
      raise UserInputError("--drafter_max_steps and --drafter_unroll: must be >= 1")
    if self.max_epochs <= 0:
      raise UserInputError(f"--drafter_max_epochs={self.max_epochs}: must be > 0")
    if self.share_bytes < 0:
      raise UserInputError(f"--drafter_share_mib: must be >= 0 (got {self.share_bytes} B)")


class Collective(Protocol):
  """Gathers host arrays from every process, in process order (each gets every copy);
  `index` is this process's place in that order, `processes` their number."""
  index: int
  processes: int

  def allgather(self, arrays: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]: ...


class OneProcess:
  index, processes = 0, 1

  def allgather(self, arrays: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    return [arrays]


def weighted_average(copies: list[dict[str, np.ndarray]], num_leaves: int
                     ) -> list[np.ndarray] | None:
  """Leaves "0".."num_leaves-1" of every copy averaged by its "steps" (floating leaves, in
  float64, in copy order: the same bits on every process), integer leaves from the copy
  with the most steps; None where every copy has 0 steps."""
  weights = np.asarray([int(c["steps"]) for c in copies], np.float64)
  if weights.sum() == 0:
    return None
  most = int(np.argmax(weights))
  weights /= weights.sum()
  averaged = []
  for i in map(str, range(num_leaves)):
    dtype = copies[0][i].dtype
    if jnp.issubdtype(dtype, jnp.floating):
      total = sum(w * c[i].astype(np.float64) for w, c in zip(weights, copies))
      averaged.append(np.asarray(total).astype(dtype))
    else:
      averaged.append(copies[most][i])
  return averaged


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


def _host_copy(tree):
  return jax.tree.map(np.array, jax.device_get(tree))   # copies, never views of buffers


def _on_device(tree):
  """Device arrays of a `_host_copy` (the last synced candidate, kept on the host)."""
  return jax.tree.map(jnp.asarray, tree)


def _padded(a: np.ndarray, n: int) -> np.ndarray:
  """`a` with zero rows appended up to `n` rows."""
  return np.concatenate([a, np.zeros((n - len(a), *a.shape[1:]), a.dtype)])


def _unpadded(size: dict[str, np.ndarray], copy: dict[str, np.ndarray]
              ) -> dict[str, np.ndarray]:
  """One replica's `OnlineBuffer.own_long` arrays back from `share_long`'s padded copy."""
  n, tokens = int(size["n"]), int(size["tokens"])
  dtype = np.dtype(size["dtype"].tobytes().decode().strip())
  out = {k: v[:n] for k, v in copy.items() if k not in ("tokens", "hidden")}
  out["tokens"] = copy["tokens"][:tokens]
  out["hidden"] = copy["hidden"][:int(size["hidden"])].view(dtype).reshape(tokens, -1)
  return out


class SpotTrainer:
  """A replica's drafter trainer, buffer, deployed drafter and gate (module doc)."""

  def __init__(self, config: SpotConfig, model_config: ModelConfig, deployed: DraftWeights,
               collective: Collective = OneProcess()):
    self.config, self.model_config, self.collective = config, model_config, collective
    self.optimizer = optim.make_optimizer(config.lr, config.lr_steps, config.warmup_steps)
    self.deployed = deployed
    self.shipped = deployed.params   # never trained; `gate` scores it beside the others
    # train steps donate their state: the deployed drafter keeps arrays of its own.
    self.state: TrainState = init_train_state(_copy(deployed.params), self.optimizer)
    self._synced = _host_copy(self.state)   # the last candidate every replica agreed on
    # Which sync made the candidate and the deployed drafter (0: the shipped drafter), so
    # that a drafter equal to another is scored once; -1: unknown (after a restore).
    self._candidate_round, self._deployed_round = 0, 0
    self._scores: dict[str, tuple[np.ndarray, float]] = {}   # this step's, for `gate`
    self.buffer = OnlineBuffer(config.buffer)
    self.watch = gate_lib.DecayWatch(config.decay_tolerance)

  def warm_up(self, target_params: Params) -> None:
    """Compiles the drafter's train step and the gate's scoring now, on an empty batch of
    the buffer's one shape: a spot step that compiled would hold the rollout's end for the
    whole compile."""
    cfg = self.config.buffer
    rows = layout_rows([], [], cfg.seq_len, cfg.batch_rows)
    hidden = np.zeros(rows.tokens.shape + (self.model_config.hidden_size,),
                      target_params["embed"].dtype)
    # The arguments exactly as `online.train_steps` passes them: a static argument left to
    # its default is another cache key than the same value passed. Twice: a step's own
    # output state (committed to its device) is another key than a fresh or synced one.
    state = _copy(self.state)
    for _ in range(2):
      state, _ = online.guarded_step(state, target_params, rows, hidden,
                                     self.deployed.vocab_ids, config=self.model_config,
                                     optimizer=self.optimizer, ce_weight=CE_WEIGHT,
                                     unroll=self.config.unroll)
    # The gate scores the loaded drafter and host copies of synced ones.
    for params in (self.deployed.params, _on_device(self._synced.params)):
      gate_lib.heldout_levels(params, target_params, [(rows, hidden)],
                              self.deployed.vocab_ids, config=self.model_config,
                              greedy=self.config.greedy, depth=self.config.unroll)

  def observe(self, step: int, sequences: Iterable[tuple[Sequence[int], Sequence[int], Any]]
              ) -> None:
    """(prompt ids, response ids, hidden states [n_fed, E]) of this replica's rollout."""
    for prompt, response, hidden in sequences:
      if len(response):
        self.buffer.add(step, prompt, response, hidden)

  def wants_training(self, accept_len: float | None) -> bool:
    """Whether to train this step: always, or (on_decay) once the deployed drafter's accept
    length on this step's rollout fell below its best since deployment."""
    if self.config.train == "always" or accept_len is None:
      return True
    decayed = self.watch.decayed(accept_len)
    self.watch.observe(accept_len)
    return decayed

  def train_while_idle(self, step: int, target_params: Params,
                       stop: Callable[[], bool]) -> online.StepsReport:
    """Drafter steps until `stop` or the epoch cap; a step that raises discards the round
    (module doc)."""
    began = time.perf_counter()
    max_slots = math.ceil(self.config.max_epochs * self.buffer.trainable_slots(step))
    try:
      self.state, report = online.train_steps(
          self.state, target_params, self.buffer, step, stop, self.config.max_steps,
          max_slots=max_slots, config=self.model_config, optimizer=self.optimizer,
          vocab_ids=self.deployed.vocab_ids, unroll=self.config.unroll)
    except Exception as e:  # noqa: BLE001 - any failure of a step; the run goes on
      self.state = _on_device(self._synced)
      return online.StepsReport.failed(began, e)
    return report

  def sync(self, steps_trained: int) -> bool:
    """Every replica's candidate becomes the steps-weighted average of all (module doc);
    False (and nothing changes) where no replica trained."""
    leaves, treedef = jax.tree.flatten(jax.device_get(self.state))
    mine = {str(i): np.asarray(leaf) for i, leaf in enumerate(leaves)}
    mine["steps"] = np.asarray(steps_trained, np.int64)
    averaged = weighted_average(self.collective.allgather(mine), len(leaves))
    if averaged is None:
      return False
    self._synced = _host_copy(jax.tree.unflatten(treedef, averaged))
    self.state = _on_device(self._synced)
    self._candidate_round += 1
    return True

  def share_long(self, step: int) -> dict[str, Any]:
    """Every replica's own long responses of `step` into every other replica's buffer
    (module doc): two collectives, the sizes and then the arrays padded to the largest;
    metrics count what every replica sent."""
    if self.config.share_bytes == 0 or self.collective.processes == 1:
      return {}
    began = time.perf_counter()
    mine = self.buffer.own_long(step, self.config.share_bytes)
    hidden = mine.pop("hidden")
    sizes = self.collective.allgather(
        {"n": np.asarray(len(mine["length"]), np.int64),
         "tokens": np.asarray(len(mine["tokens"]), np.int64),
         "hidden": np.asarray(hidden.nbytes, np.int64),
         "dtype": np.frombuffer(hidden.dtype.name.ljust(16).encode(), np.uint8)})
    metrics = {"drafter/shared_sequences": sum(int(c["n"]) for c in sizes),
               "drafter/shared_bytes": sum(int(c["tokens"]) * 4 + int(c["hidden"])
                                           for c in sizes)}
    if metrics["drafter/shared_sequences"] == 0:
      return metrics
    # Sizes rounded up: few distinct shapes, so the gather compiles a few programs.
    top = {key: round_up(max(int(c[key]) for c in sizes), unit)
           for key, unit in (("n", 16), ("tokens", 1024), ("hidden", 1 << 20))}
    copies = self.collective.allgather(
        {**{k: _padded(v, top["n"]) for k, v in mine.items() if k != "tokens"},
         "tokens": _padded(mine["tokens"], top["tokens"]),
         "hidden": _padded(hidden.reshape(-1).view(np.uint8), top["hidden"])})
    for origin, (size, copy) in enumerate(zip(sizes, copies)):
      if origin != self.collective.index and int(size["n"]):
        self.buffer.add_received(_unpadded(size, copy))
    return {**metrics, "timing/drafter_share_s": time.perf_counter() - began}

  def score(self, step: int, target_params: Params, stop: Callable[[], bool]) -> bool:
    """Scores the deployed drafter, the last synced candidate and the shipped drafter on
    this replica's held-out windows of `step` and the step before, for `gate` (module
    doc), checking `stop` before each batch; False (nothing kept) where it was stopped or
    has no windows."""
    self._scores = {}
    windows = [(b.rows, b.hidden) for s in (step - 1, step) for b in self.buffer.heldout(s)]
    if not windows:
      return False
    same = {"candidate": self._candidate_round == self._deployed_round,
            "shipped": self._deployed_round == 0}
    drafters = {"deployed": lambda: self.deployed.params,
                "candidate": lambda: _on_device(self._synced.params),
                "shipped": lambda: self.shipped}
    scores = {}
    for name, params in drafters.items():
      scores[name] = scores["deployed"] if same.get(name) else gate_lib.heldout_levels(
          params(), target_params, windows, self.deployed.vocab_ids, config=self.model_config,
          greedy=self.config.greedy, depth=self.config.unroll, stop=stop)
      if scores[name] is None:
        return False
    self._scores = scores
    return True

  def gate(self) -> dict[str, Any]:
    """Every replica's scores of this step summed (a collective: every replica calls it,
    scored or not); deploys by them and returns the drafter/heldout_* metrics, each
    figure as the gate found it, before any deploy. Call before `sync`: what was scored
    is the candidate of the last one."""
    began = time.perf_counter()
    names, depth = ("deployed", "candidate", "shipped"), self.config.unroll
    mine = {name: self._scores.get(name, (np.zeros(depth), 0.0))[0] for name in names}
    slots = self._scores.get("deployed", (None, 0.0))[1]
    copies = self.collective.allgather({**mine, "slots": np.asarray(slots, np.float64)})
    self._scores = {}
    slots = float(sum(c["slots"] for c in copies))
    if slots == 0:
      return {"drafter/deployed": 0, "drafter/reverted": 0}
    accept = {name: gate_lib.accept_from_levels(sum(c[name] for c in copies), slots)
              for name in names}
    choice = gate_lib.DeployGate(self.config.gate_margin).choose(
        accept["deployed"], accept["candidate"], accept["shipped"])
    if choice == "candidate":
      self.deployed = self.deployed.replace(params=_on_device(self._synced.params))
      self._deployed_round = self._candidate_round
    elif choice == "shipped":
      self.deployed = self.deployed.replace(params=self.shipped)
      self._deployed_round = 0
    if choice is not None:
      self.watch.deployed_new()
    return {**{f"drafter/heldout_accept_{name}": value for name, value in accept.items()},
            "drafter/deployed": int(choice == "candidate"),
            "drafter/reverted": int(choice == "shipped"),
            "timing/drafter_gate_s": time.perf_counter() - began}

  def checkpoint_state(self) -> dict[str, Any]:
    """What `DrafterCheckpoints` saves beside the buffer: candidate train state and the
    deployed drafter (which may be older than the candidate)."""
    return {"candidate": self.state, "deployed": self.deployed.params}

  def restore(self, saved: dict[str, Any], host_state: dict[str, Any]) -> None:
    """Continues from `checkpoint_state()` as restored and `host_state()`."""
    self.state = saved["candidate"]
    self._synced = _host_copy(self.state)
    self.deployed = self.deployed.replace(params=saved["deployed"])
    self.watch.load_state_dict(host_state["watch"])
    self._candidate_round, self._deployed_round = host_state.get("rounds", (1, -1))

  def host_state(self) -> dict[str, Any]:
    return {"watch": self.watch.state_dict(),
            "rounds": [self._candidate_round, self._deployed_round]}

"""Train a policy with GRPO / DAPO on verifiable rewards.

  python -m experiments.run --flagfile=experiments/configs/quickstart.flags [--run_dir=DIR]

Flags on the command line override the flagfile's; the run dir defaults to runs/NAME
(NAME: the flagfile's name). `--resume=auto` continues the run dir's latest checkpoint.
The run dir receives metrics.jsonl, TensorBoard events, PNG plots, checkpoints/ and, at
the end (or with --export_hf), a HF checkpoint of the policy.

`--replicas=N` runs N processes, one rollout replica each (experiments/replica_flags.py;
multi-host launch examples in experiments/launch/); process 0 alone writes the run dir.
"""
from __future__ import annotations

import os
import signal
import sys
import time

from absl import flags

from experiments import budget_flags, cli, replica_flags
from experiments.rl_flags import build_run, check_run_dir, memory_plan
from tlt_jax.errors import UserInputError

_STEPS = flags.DEFINE_integer("steps", 10, "RL steps to train.")
_RUN_DIR = flags.DEFINE_string("run_dir", None, "Run directory (default: runs/<flagfile name>).")
_RESUME = flags.DEFINE_enum("resume", "never", ["never", "auto"],
                            "auto: continue from the run dir's latest checkpoint if it has one.")
_CHECKPOINT_EVERY = flags.DEFINE_integer("checkpoint_every", 5, "Save every N steps (and at "
                                         "the end).", lower_bound=1)
_KEEP = flags.DEFINE_integer("keep_checkpoints", 2, "Checkpoints kept.", lower_bound=1)
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 5, "Greedy validation every N steps (and "
                                   "before the first); 0 turns it off.", lower_bound=0)
_EXPORT_HF = flags.DEFINE_string("export_hf", None, "Where to write the final policy as a HF "
                                 "checkpoint (default: RUN_DIR/hf_export).")


# Fault injection for the resume and replica tests: "step:N" dies by SIGKILL once step N
# has run but before anything of it is written; "save:N" dies while step N's checkpoint is
# being written; a suffix "@P" (e.g. "step:1@1") limits it to process P.
FAULT_ENV = "TLT_JAX_KILL_AT"


def maybe_die(point: str, step: int, settle=None, process: int = 0) -> None:
  """Dies at `point` of `step` if the fault env asks for it, after `settle()` (if given)."""
  fault = os.environ.get(FAULT_ENV, "")
  if fault in (f"{point}:{step}", f"{point}:{step}@{process}"):
    if settle is not None:
      settle()
    os.kill(os.getpid(), signal.SIGKILL)


def default_run_dir(argv: list[str]) -> str:
  """runs/NAME for the last `--flagfile=.../NAME.flags` of the command line (absl expands
  flagfiles while parsing and keeps no value for the flag), else runs/default."""
  flagfile = None
  for i, arg in enumerate(argv):
    if arg.lstrip("-").startswith("flagfile="):
      flagfile = arg.split("=", 1)[1]
    elif arg.lstrip("-") == "flagfile" and i + 1 < len(argv):
      flagfile = argv[i + 1]
  name = os.path.splitext(os.path.basename(flagfile))[0] if flagfile else "default"
  return os.path.join("runs", name)


def check_memory(processes) -> int | None:
  """The memory plan (experiments.plan's), checked once in every process before anything
  loads (each refuses a run that cannot fit: the same plan everywhere) and printed by
  process 0; returns the rollout's row budget (None: every row at once)."""
  from tlt_jax.rl.memory_plan import GIB, check

  plan, _ = memory_plan(processes.count)
  check(plan)
  if processes.primary:
    per_replica = " per replica" if processes.count > 1 else ""
    print(f"memory plan: rollout {plan.rollout_peak / GIB:.1f} GiB, update "
          f"{plan.train_peak() / GIB:.1f} GiB of {plan.shape.device_bytes / GIB:.1f} GiB per "
          f"device; at most {plan.max_rows} rollout rows at once{per_replica}",
          file=sys.stderr)
  budget = budget_flags.MAX_ROWS.value or budget_flags.KV_FRACTION.value
  return plan.max_rows if budget else None


def main(argv):
  del argv
  processes = replica_flags.start_processes()       # before anything imports jax
  try:
    train(processes)
  except BaseException as e:
    # Another error with several replicas is most often the echo of a dead one (a failed
    # collective): let the watcher's line about it win. Errors of the run's own are shown.
    own = (UserInputError, OSError, KeyboardInterrupt, SystemExit)
    if processes.count > 1 and not isinstance(e, own):
      processes.wait_for_failure(timeout_s=5.0)
    processes.abandon()
    raise
  code = processes.finish()
  if code:
    sys.exit(code)


def train(processes) -> None:
  """The run, in every process; only process 0 (`processes.primary`) writes the run dir."""
  from tlt_jax.rl.checkpointing import RunCheckpoints
  from tlt_jax.rl.metrics import MetricsLog
  from tlt_jax.rl.replicas import Replicas

  primary = processes.primary
  run_dir = os.path.abspath(_RUN_DIR.value or default_run_dir(sys.argv))
  check_run_dir(run_dir)
  if _EXPORT_HF.value:
    cli.check_output_dir(_EXPORT_HF.value, "--export_hf")
  max_rows = check_memory(processes)
  checkpoints = RunCheckpoints(os.path.join(run_dir, "checkpoints"), keep=_KEEP.value)
  processes.settle_before_exit("the checkpoint in flight", checkpoints.wait)
  resume_step = checkpoints.latest_step() if _RESUME.value == "auto" else None
  if _RESUME.value == "never" and checkpoints.latest_step() is not None:
    raise UserInputError(f"--run_dir={run_dir}: has checkpoints (latest step "
                         f"{checkpoints.latest_step()}); pass --resume=auto to continue it or "
                         "choose another --run_dir")
  if resume_step is not None and resume_step >= _STEPS.value and primary:
    print(f"{run_dir}: already at step {resume_step} of {_STEPS.value}", file=sys.stderr)

  run = build_run(total_steps=_STEPS.value,          # every flag checked, model and data loaded
                  replicas=Replicas(processes.index, processes.count), run_dir=run_dir,
                  max_rows=max_rows)
  history: list = []
  if resume_step is not None:
    history = run.resume(checkpoints, resume_step)
    if primary:
      print(f"resumed {run_dir} at step {resume_step}", file=sys.stderr)
  run.precompile()
  log = MetricsLog(run_dir, history) if primary else None
  if primary:
    replicas = f" on {processes.count} replicas" if processes.count > 1 else ""
    print(f"training {run.describe()} for {_STEPS.value} steps{replicas} -> {run_dir}",
          file=sys.stderr)
  train_steps(run, checkpoints, log, (resume_step or 0) + 1, processes.index)
  checkpoints.wait()
  checkpoints.close()
  if primary:
    write_results(run, log, run_dir)


def train_steps(run, checkpoints, log, first: int, process: int) -> None:
  """Steps `first` .. --steps with their evaluations and checkpoints, in every process;
  `log` (process 0's only; None elsewhere) receives each step's record."""
  from tlt_jax.rl.metrics import Progress

  learner, val_items = run.learner, run.val_items
  progress = Progress(_STEPS.value, first - 1)
  write = log.write if log is not None else lambda record: None

  def eval_due(step: int) -> bool:
    return bool(val_items) and _EVAL_EVERY.value > 0 and (
        step % _EVAL_EVERY.value == 0 or step == _STEPS.value)

  if first == 1 and val_items and _EVAL_EVERY.value > 0:
    start = time.perf_counter()
    record = {"step": 0, **learner.evaluate(val_items, 0),
              "timing/eval_s": time.perf_counter() - start}
    write(record)
    if log is not None:
      print(f"step 0: val accuracy {record['val/accuracy']:.3f} over {len(val_items)} "
            "prompts", file=sys.stderr)
  for step in range(first, _STEPS.value + 1):
    record = learner.step(step)
    # A kill mid-training lands once the last checkpoint's async save has committed, so
    # the resume tests always exercise a restore (a save still in flight is the "save" point).
    maybe_die("step", step, settle=checkpoints.wait, process=process)
    if eval_due(step):
      start = time.perf_counter()
      record.update(learner.evaluate(val_items, step))
      record["timing/eval_s"] = time.perf_counter() - start
    if step % _CHECKPOINT_EVERY.value == 0 or step == _STEPS.value:
      start = time.perf_counter()
      history = log.history if log is not None else []
      run.save(checkpoints, step, history + [record])
      maybe_die("save", step, process=process)
      record["timing/checkpoint_s"] = time.perf_counter() - start
    write(record)
    if log is not None:
      progress.update(step, record)


def write_results(run, log, run_dir: str) -> None:
  """Process 0, once the last step is saved: plots, the HF export and the summary."""
  from tlt_jax.rl.metrics import summary_table
  from tlt_jax.rl.plots import write_plots

  log.close()
  write_plots(run_dir, log.history)
  export_dir = os.path.abspath(_EXPORT_HF.value or os.path.join(run_dir, "hf_export"))
  run.export_hf(run.learner.state.params, export_dir)
  print(f"\n{summary_table(log.history)}\n\nrun dir: {run_dir}\nHF export: {export_dir}",
        file=sys.stderr)


if __name__ == "__main__":
  cli.run(main)

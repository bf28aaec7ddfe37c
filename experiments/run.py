"""Train a policy with GRPO / DAPO on verifiable rewards.

  python -m experiments.run --flagfile=experiments/configs/quickstart.flags [--run_dir=DIR]

Flags on the command line override the flagfile's; the run dir defaults to runs/NAME
(NAME: the flagfile's name). `--resume=auto` continues the run dir's latest checkpoint.
The run dir receives metrics.jsonl, TensorBoard events, PNG plots, checkpoints/ and, at
the end (or with --export_hf), a HF checkpoint of the policy.
"""
from __future__ import annotations

import os
import signal
import sys
import time

from absl import flags

from experiments import cli
from experiments import budget_flags
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


# Fault injection for the resume tests: "step:N" dies by SIGKILL once step N has run but
# before anything of it is written; "save:N" dies while step N's checkpoint is being written.
FAULT_ENV = "TLT_JAX_KILL_AT"


def maybe_die(point: str, step: int, settle=None) -> None:
  """Dies at `point` of `step` if the fault env asks for it, after `settle()` (if given)."""
  if os.environ.get(FAULT_ENV) == f"{point}:{step}":
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


def check_memory() -> int | None:
  """The memory plan (experiments.plan's), checked before anything loads; returns the
  rollout's row budget (None: every row at once)."""
  from tlt_jax.rl.memory_plan import GIB, check

  plan, _ = memory_plan()
  check(plan)
  budget = budget_flags.MAX_ROWS.value or budget_flags.KV_FRACTION.value
  print(f"memory plan: rollout {plan.rollout_peak / GIB:.1f} GiB, update "
        f"{plan.train_peak() / GIB:.1f} GiB of {plan.shape.device_bytes / GIB:.1f} GiB per "
        f"device; at most {plan.max_rows} rollout rows at once", file=sys.stderr)
  return plan.max_rows if budget else None


def main(argv):
  del argv
  from tlt_jax.rl.checkpointing import RunCheckpoints
  from tlt_jax.rl.metrics import MetricsLog, Progress, summary_table
  from tlt_jax.rl.plots import write_plots

  run_dir = os.path.abspath(_RUN_DIR.value or default_run_dir(sys.argv))
  checkpoints_dir = os.path.join(run_dir, "checkpoints")
  check_run_dir(run_dir)
  if _EXPORT_HF.value:
    cli.check_output_dir(_EXPORT_HF.value, "--export_hf")
  checkpoints = RunCheckpoints(checkpoints_dir, keep=_KEEP.value)
  resume_step = checkpoints.latest_step() if _RESUME.value == "auto" else None
  if _RESUME.value == "never" and checkpoints.latest_step() is not None:
    raise UserInputError(f"--run_dir={run_dir}: has checkpoints (latest step "
                         f"{checkpoints.latest_step()}); pass --resume=auto to continue it or "
                         "choose another --run_dir")
  if resume_step is not None and resume_step >= _STEPS.value:
    print(f"{run_dir}: already at step {resume_step} of {_STEPS.value}", file=sys.stderr)

  max_rows = check_memory()
  run = build_run(_STEPS.value, max_rows)      # every flag checked, model and data loaded
  learner, val_items = run.learner, run.val_items
  history: list = []
  if resume_step is not None:
    state, meta = checkpoints.restore(resume_step, learner.state)
    run.check_resumable(meta)
    learner.restore(state, meta)
    history = meta["history"]
    print(f"resumed {run_dir} at step {resume_step}", file=sys.stderr)
  run.precompile()
  log = MetricsLog(run_dir, history)
  first = (resume_step or 0) + 1
  print(f"training {run.describe()} for {_STEPS.value} steps -> {run_dir}", file=sys.stderr)
  progress = Progress(_STEPS.value, first - 1)

  def eval_due(step: int) -> bool:
    return bool(val_items) and _EVAL_EVERY.value > 0 and (
        step % _EVAL_EVERY.value == 0 or step == _STEPS.value)

  if first == 1 and val_items and _EVAL_EVERY.value > 0:
    start = time.perf_counter()
    record = {"step": 0, **learner.evaluate(val_items, 0),
              "timing/eval_s": time.perf_counter() - start}
    log.write(record)
    print(f"step 0: val accuracy {record['val/accuracy']:.3f} over {len(val_items)} prompts",
          file=sys.stderr)
  for step in range(first, _STEPS.value + 1):
    record = learner.step(step)
    # A kill mid-training lands once the last checkpoint's async save has committed, so
    # the resume tests always exercise a restore (a save still in flight is the "save" point).
    maybe_die("step", step, settle=checkpoints.wait)
    if eval_due(step):
      start = time.perf_counter()
      record.update(learner.evaluate(val_items, step))
      record["timing/eval_s"] = time.perf_counter() - start
    if step % _CHECKPOINT_EVERY.value == 0 or step == _STEPS.value:
      start = time.perf_counter()
      checkpoints.save(step, learner.state, run.checkpoint_meta(log.history + [record]))
      maybe_die("save", step)
      record["timing/checkpoint_s"] = time.perf_counter() - start
    log.write(record)
    progress.update(step, record)
  checkpoints.wait()
  checkpoints.close()
  log.close()
  write_plots(run_dir, log.history)
  export_dir = os.path.abspath(_EXPORT_HF.value or os.path.join(run_dir, "hf_export"))
  run.export_hf(learner.state.params, export_dir)
  print(f"\n{summary_table(log.history)}\n\nrun dir: {run_dir}\nHF export: {export_dir}",
        file=sys.stderr)


if __name__ == "__main__":
  cli.run(main)

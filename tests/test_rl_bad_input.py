"""`python -m experiments.run` on bad input: each fault is one `error: ...` line naming the
flag, file, row or field, a nonzero exit and no traceback (cheap ones before the model
loads); per-item faults (bad rows in skip mode, a reward that raises or stalls) are counted
and the run goes on, but a reward that fails every item stops it; a save that fails for lack
of space keeps the last good checkpoint."""
from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys

import pytest

from tests.rl_bad_reward_helpers import STALL_MARKER_ENV

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = "basic_arithmetic:min_terms=2,max_terms=2,min_digits=1,max_digits=1"
FAULTY_REWARD = "--reward=tests.rl_bad_reward_helpers:stalls_once_then_fails_every_other"
# Per file: the checkpoint's array files are ~100-300 KB, everything written before the
# save (metrics.jsonl, TensorBoard events) a few KB.
FILE_SIZE_LIMIT = 64 * 1024


def run_cli(run_dir, model_dir, *extra, data=(f"--tasks={TASKS}", "--num_train=8"),
            env_extra=None, file_size_limit=None):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu", **(env_extra or {}))
  cmd = [sys.executable, "-m", "experiments.run", f"--model={model_dir}", *data,
         "--num_val=0", "--max_prompt_len=96", "--max_new_tokens=8", "--prompts_per_step=2",
         "--group_size=4", "--micro_batch_rows=2", "--eval_every=0", "--reward_workers=1",
         "--steps=1", f"--run_dir={run_dir}", *extra]

  def limit_file_size():  # writes past the limit fail with EFBIG instead of killing us
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

  return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
                        preexec_fn=limit_file_size if file_size_limit else None)


def error_line(proc, *needles) -> str:
  """The one-line error: exit code 2, no traceback, last stderr line naming each needle."""
  assert proc.returncode == 2, proc.stderr[-3000:]  # cli.EXIT_USAGE
  assert "Traceback" not in proc.stderr, proc.stderr[-5000:]
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("error: "), proc.stderr[-3000:]
  for needle in needles:
    assert needle in last, (needle, last)
  return last


def _row(i):
  return {"prompt": [{"role": "user", "content": f"What is {i} + 1? Answer in \\boxed{{}}."}],
          "reward_model": {"ground_truth": str(i + 1)}, "data_source": "toy"}


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
  import pyarrow
  import pyarrow.parquet

  root = tmp_path_factory.mktemp("data")
  rows = [_row(i) for i in range(12)]
  no_reward_model = {k: v for k, v in rows[0].items() if k != "reward_model"}
  no_content = dict(rows[1], prompt=[{"role": "user"}])
  lines = [json.dumps(r) for r in rows[:3] + [no_reward_model] + rows[3:8] + [no_content] +
           rows[8:]]
  paths = {"bad_rows": root / "bad_rows.jsonl", "malformed": root / "malformed.jsonl",
           "all_bad": root / "all_bad.jsonl", "parquet": root / "bad_rows.parquet"}
  paths["bad_rows"].write_text("\n".join(lines) + "\n")  # 12 good rows, bad lines 4 and 10
  paths["malformed"].write_text(json.dumps(rows[0]) + "\n{\"prompt\": [\n")
  paths["all_bad"].write_text(json.dumps(no_reward_model) + "\n")
  parquet_rows = [dict(r, reward_model={"ground_truth": None}) if i == 5 else r
                  for i, r in enumerate(rows)]
  pyarrow.parquet.write_table(pyarrow.Table.from_pylist(parquet_rows), paths["parquet"])
  return {k: str(v) for k, v in paths.items()}


# case -> (extra flags, data flags (None: --tasks), what the error line names, whether the
# model loads first: only the length filter needs its tokenizer).
_CHEAP_CASES = {
    "unknown_flag": (["--no_such_flag=1"], None, ["no_such_flag"], False),
    "malformed_int": (["--steps=three"], None, ["--steps=three"], False),
    "malformed_enum": (["--resume=sometimes"], None, ["--resume"], False),
    "bad_reward_module": (["--reward=no_such_module:fn"], None,
                          ["--reward=no_such_module:fn"], False),
    "reward_not_a_reward": (["--reward=os:system"], None,
                            ["--reward=os:system", "system(command)",
                             "(response, ground_truth, data_source, extra_info)"], False),
    "missing_model": (["--model=/nonexistent/model"], None,
                      ["--model=/nonexistent/model"], False),
    "missing_train_file": ([], ["--train_file=/nonexistent/train.jsonl"],
                           ["--train_file=/nonexistent/train.jsonl"], False),
    "missing_val_file": (["--val_file=/nonexistent/val.jsonl"], None,
                         ["--val_file=/nonexistent/val.jsonl"], False),
    "bad_row_jsonl": ([], ["--train_file={bad_rows}"],
                      ["{bad_rows}", "line 4", "'reward_model'", "--on_bad_row"], False),
    "bad_row_parquet": ([], ["--train_file={parquet}"],
                        ["{parquet}", "row 5 (0-based)", "'reward_model.ground_truth'"], False),
    "malformed_json": ([], ["--train_file={malformed}"],
                       ["{malformed}", "line 2", "malformed JSON"], False),
    "all_rows_skipped": (["--on_bad_row=skip"], ["--train_file={all_bad}"],
                         ["{all_bad}", "no usable rows", "1 bad rows skipped"], False),
    "export_hf_under_a_file": (["--export_hf={bad_rows}/export"], None,
                               ["--export_hf={bad_rows}/export", "is not a directory"], False),
    "all_filtered_out": (["--max_prompt_len=4"], None,
                         ["--max_prompt_len=4", "none of the 8 prompts fits"], True),
    # The SD flags experiments.run shares with experiments.generate (sd_flags.py).
    "sd_missing_drafter_dir": (["--drafter=/nonexistent/drafter"], None,
                               ["--drafter=/nonexistent/drafter", "no such directory"], False),
    "sd_hybrid_without_drafter": (["--hybrid"], None, ["--hybrid needs --drafter=DIR"], False),
    "sd_learned_strategy_without_drafter": (
        ["--drafter=ngram", "--strategy=learned:3_1_4,ngram:3_1_4"], None,
        ["--strategy=learned:3_1_4", "needs a learned drafter"], False),
}


@pytest.mark.parametrize("case", sorted(_CHEAP_CASES))
def test_bad_input_is_one_line(case, tiny_hf_dirs, data_files, tmp_path):
  extra, data, needles, loads_model = _CHEAP_CASES[case]
  data = [d.format(**data_files) for d in data] if data else [f"--tasks={TASKS}",
                                                              "--num_train=8"]
  extra = [e.format(**data_files) for e in extra]
  proc = run_cli(tmp_path / "run", tiny_hf_dirs["qwen2"], *extra, data=data)
  error_line(proc, *(n.format(**data_files) for n in needles))
  assert ("loading " in proc.stderr) == loads_model, proc.stderr[-2000:]


def test_unwritable_run_dir_fails_before_loading(tiny_hf_dirs, tmp_path):
  # Under a regular file: root can write anywhere chmod allows, but not there.
  (tmp_path / "file").write_text("")
  run_dir = tmp_path / "file" / "run"
  proc = run_cli(run_dir, tiny_hf_dirs["qwen2"])
  error_line(proc, f"--run_dir={run_dir}", "not writable")
  assert "loading " not in proc.stderr


@pytest.fixture(scope="module")
def faulty_run(tiny_hf_dirs, data_files, tmp_path_factory):
  """One step on a file with 2 bad rows skipped, scored by a reward that stalls once past
  --reward_timeout_s and then raises on every other item; checkpoint 1 saved at the end."""
  root = tmp_path_factory.mktemp("faulty")
  env = {STALL_MARKER_ENV: str(root / "stalled")}
  args = (tiny_hf_dirs["qwen2"], f"--train_file={data_files['bad_rows']}", FAULTY_REWARD,
          "--on_bad_row=skip", "--reward_timeout_s=1")
  run_dir = str(root / "run")
  proc = run_cli(run_dir, *args, data=(), env_extra=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return run_dir, proc, args, env


def test_skip_mode_counts_bad_rows(faulty_run):
  _, proc, _, _ = faulty_run
  assert "data: 12 train / 0 val prompts (0 over --max_prompt_len, 2 bad rows skipped)" in (
      proc.stderr)


def test_reward_errors_and_timeouts_are_counted(faulty_run):
  run_dir, proc, _, _ = faulty_run
  assert "Traceback" not in proc.stderr
  records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  assert [r["step"] for r in records] == [1]
  assert records[0]["reward/timeouts"] == 1
  assert records[0]["reward/errors"] == 3   # of the 2 * 4 - 1 items after the stall
  assert records[0]["reward/mean"] == 0.0


def test_a_reward_that_fails_every_item_stops_the_run(tiny_hf_dirs, tmp_path):
  reward = "--reward=tests.rl_bad_reward_helpers:always_raises"
  proc = run_cli(tmp_path / "run", tiny_hf_dirs["qwen2"], reward)
  error_line(proc, reward, "all 8 responses of a batch failed to score", "8 raised",
             "KeyError")
  assert not os.path.exists(tmp_path / "run" / "checkpoints" / "1")


def test_full_disk_at_save_keeps_last_checkpoint(faulty_run, tmp_path):
  source_dir, _, args, env = faulty_run
  run_dir = str(tmp_path / "run")
  shutil.copytree(source_dir, run_dir)
  failed = run_cli(run_dir, *args, "--steps=2", "--resume=auto", data=(), env_extra=env,
                   file_size_limit=FILE_SIZE_LIMIT)
  error_line(failed, os.path.join(run_dir, "checkpoints"), "checkpoint save failed",
             "File too large", "last good checkpoint is step 1")
  assert "step 2/2" in failed.stderr  # the failure was the save, after step 2 trained
  # The last good checkpoint is intact: the run resumes from it and finishes.
  resumed = run_cli(run_dir, *args, "--steps=2", "--resume=auto", data=(), env_extra=env)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"resumed {run_dir} at step 1" in resumed.stderr
  assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["1", "2"]
  records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  assert [r["step"] for r in records] == [1, 2]


def test_error_line_stays_last_over_exit_noise(tmp_path):
  """A failed orbax save can leave a never-awaited write coroutine; its RuntimeWarning
  prints at interpreter exit, after the error line, unless the CLI silences it."""
  script = tmp_path / "leaky_main.py"
  script.write_text(
      "from experiments import cli\n"
      "from tlt_jax.errors import UserInputError\n"
      "async def write_fragment(): pass\n"
      "def main(argv):\n"
      "  main.leaked = write_fragment()\n"  # collected at exit, never awaited
      "  raise UserInputError('checkpoint save failed on purpose')\n"
      "cli.run(main)\n")
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)
  error_line(proc, "checkpoint save failed on purpose")
  assert "never awaited" not in proc.stderr, proc.stderr

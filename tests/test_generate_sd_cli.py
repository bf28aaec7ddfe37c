"""The generate CLI with speculative decoding flags: same greedy output, SD stats, bad input."""
import dataclasses
import json
import os
import subprocess
import sys

import jax
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, out):
  proc = subprocess.run([sys.executable, "-m", "experiments.generate", *args,
                         f"--output_json={out}"], cwd=REPO, capture_output=True, text=True,
                        timeout=600)
  return proc, out


@pytest.fixture(scope="module")
def drafter_dirs(tiny_hf_dirs, tmp_path_factory):
  """A random drafter for the tiny Llama, and one for a model of another width."""
  from tlt_jax.drafter.trainer import save_drafter
  from tlt_jax.models.config import ModelConfig
  from tlt_jax.models.drafter import init_drafter_params
  root = tmp_path_factory.mktemp("drafters")
  config = ModelConfig.from_hf_dir(tiny_hf_dirs["llama"])
  save_drafter(str(root / "good"), init_drafter_params(config, jax.random.key(0)), None, config)
  other = dataclasses.replace(config, hidden_size=48, num_heads=3, num_kv_heads=1)
  save_drafter(str(root / "other"), init_drafter_params(other, jax.random.key(0)), None, other)
  return {"good": str(root / "good"), "other": str(root / "other")}


def test_sd_cli_matches_plain_and_reports_stats(tiny_hf_dirs, drafter_dirs, tmp_path):
  prompts = tmp_path / "prompts.json"
  prompts.write_text(json.dumps([[5, 6, 7], [9, 10, 11, 12, 13, 14], "hello"]))
  common = [f"--model={tiny_hf_dirs['llama']}", f"--prompts_json={prompts}",
            "--max_new_tokens=20", "--temperature=0"]
  plain, plain_out = _run(common, tmp_path / "plain.json")
  assert plain.returncode == 0, plain.stderr
  sd, sd_out = _run(common + [f"--drafter={drafter_dirs['good']}", "--strategy=3_2_5",
                              "--sd_threshold=4", "--sd_patience=0"],
                    tmp_path / "sd.json")
  assert sd.returncode == 0, sd.stderr
  a, b = json.loads(plain_out.read_text()), json.loads(sd_out.read_text())
  assert [o["token_ids"] for o in a["outputs"]] == [o["token_ids"] for o in b["outputs"]]
  stats = b["stats"]
  assert stats["spec/strategy"] == "3_2_5" and stats["spec/verify_steps"] > 0
  assert stats["spec/accept_len"] >= 1.0 and 0 < stats["spec/enabled_frac"] <= 1
  assert stats["compile/programs"] > 0
  # A pool: the bandit picks per chunk (epsilon 1: at random), and the output is the same.
  # Its state is saved, and a second run resumes from it; that one precompiles, so its
  # rollout compiles nothing.
  bandit_state = tmp_path / "bandit.json"
  pool_args = common + [f"--drafter={drafter_dirs['good']}", "--strategy=2_1_3,3_2_5",
                        "--bandit_epsilon=1", "--sd_threshold=4", "--sd_patience=0",
                        f"--bandit_state={bandit_state}"]
  pulls = []
  for run in range(2):
    pool, pool_out = _run(pool_args + ["--precompile"] * run, tmp_path / f"pool{run}.json")
    assert pool.returncode == 0, pool.stderr
    c = json.loads(pool_out.read_text())
    if run == 1:
      assert c["stats"]["compile/precompiled_programs"] > 0
      assert c["stats"]["compile/new_programs"] == 0
    assert [o["token_ids"] for o in a["outputs"]] == [o["token_ids"] for o in c["outputs"]]
    assert c["stats"]["spec/strategy"] == "2_1_3,3_2_5"
    pulls.append(sum(map(sum, json.loads(bandit_state.read_text())["pulls"])))
  assert 0 < pulls[0] < pulls[1]


@pytest.mark.parametrize("flag_args,needle", [
    (["--strategy=8_4"], "--strategy"),
    (["--strategy=2_2_9"], "--strategy"),
    (["--strategy=4_1_5,4_1_5"], "listed twice"),
    (["--strategy=4_1_5,2_1_3", "--bandit_epsilon=2"], "--bandit_epsilon"),
    (["--bandit_window=5"], "--bandit_window needs a pool"),
    (["--strategy=4_1_5,2_1_3", "--bandit_state=BADSTATE"], "malformed"),
    (["--sd_threshold=0"], "--sd_threshold"),
    (["--sd_threshold=100000"], "--sd_threshold"),
    (["--draft_temperature_ratio=0"], "--draft_temperature_ratio"),
    (["--drafter=OTHER"], "fc.weight"),
    (["--drafter=MISSING"], "no such directory"),
])
def test_sd_cli_bad_input(tiny_hf_dirs, drafter_dirs, tmp_path, flag_args, needle):
  prompts = tmp_path / "prompts.json"
  prompts.write_text(json.dumps([[5, 6, 7]]))
  bad_state = tmp_path / "bad_state.json"
  bad_state.write_text(json.dumps({"strategies": ["4_1_5", "2_1_3"], "bucket_bounds": [1, 4, 20],
                                   "rewards": 3}))
  flag_args = [a.replace("OTHER", drafter_dirs["other"]).replace("MISSING", str(tmp_path / "no"))
               .replace("BADSTATE", str(bad_state)) for a in flag_args]
  if not any(a.startswith("--drafter") for a in flag_args):
    flag_args.append(f"--drafter={drafter_dirs['good']}")
  proc, out = _run([f"--model={tiny_hf_dirs['llama']}", f"--prompts_json={prompts}",
                    "--max_new_tokens=4", *flag_args], tmp_path / "out.json")
  assert proc.returncode == 2, proc.stderr
  errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
  assert len(errors) == 1 and needle in errors[0], proc.stderr
  assert "Traceback" not in proc.stderr
  assert not out.exists()


def test_sd_flags_without_drafter_are_rejected(tiny_hf_dirs, tmp_path):
  prompts = tmp_path / "prompts.json"
  prompts.write_text(json.dumps([[5, 6, 7]]))
  proc, out = _run([f"--model={tiny_hf_dirs['llama']}", f"--prompts_json={prompts}",
                    "--strategy=4_1_5"], tmp_path / "out.json")
  assert proc.returncode == 2 and "needs --drafter" in proc.stderr
  assert not out.exists()


def test_sd_cli_hybrid_matches_plain(tiny_hf_dirs, drafter_dirs, tmp_path):
  """`--drafter=DIR --hybrid`: plain decoding's greedy output (equal prompts draft from
  each other model-free), both drafter kinds' stats."""
  from tlt_jax.models.loading import load_model
  from tlt_jax.rollout.engine import generate
  from tlt_jax.rollout.sampling import SamplingParams
  token_lists = [[5, 6, 7, 5, 6]] * 2 + [[9, 10, 11, 12]] * 2
  prompts = tmp_path / "prompts.json"
  prompts.write_text(json.dumps(token_lists))
  proc, out = _run([f"--model={tiny_hf_dirs['llama']}", f"--prompts_json={prompts}",
                    "--max_new_tokens=16", "--temperature=0",
                    f"--drafter={drafter_dirs['good']}", "--hybrid", "--max_ngram=2",
                    "--strategy=3_1_4", "--sd_threshold=4", "--sd_patience=0"],
                   tmp_path / "hybrid.json")
  assert proc.returncode == 0, proc.stderr
  model = load_model(tiny_hf_dirs["llama"])
  plain = generate(model.params, model.config, token_lists, max_new_tokens=16,
                   sampling=SamplingParams(temperature=0.0),
                   eos_ids=tuple(model.config.eos_token_ids))
  result = json.loads(out.read_text())
  assert [o["token_ids"] for o in result["outputs"]] == [o.token_ids for o in plain.outputs]
  stats = result["stats"]
  assert stats["spec/drafter"] == "hybrid" and stats["spec/verify_steps"] > 0
  assert set(stats["spec/verify_share_by_drafter"]) == {"learned", "ngram"}
  assert stats["spec/context_sizes"]["members"] == 2

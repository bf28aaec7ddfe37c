"""`python -m experiments.generate` as a user runs it: outputs, seeding, one-line errors."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from tlt_jax.models.loading import load_model
from tlt_jax.rollout.engine import generate
from tlt_jax.rollout.sampling import SamplingParams

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["hi there", [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
SAMPLING = ["--temperature=0.8", "--top_p=0.9", "--top_k=20", "--max_new_tokens=24"]


def _run(tmp_path, model, prompts, *flags, name="out"):
  """Runs the CLI; returns (returncode, stderr, parsed output JSON or None)."""
  prompts_path = tmp_path / f"{name}-prompts.json"
  if not isinstance(prompts, str):  # a str is a path, passed through as is
    prompts_path.write_text(json.dumps(prompts))
    prompts = str(prompts_path)
  out_dir = tmp_path / f"{name}-out"
  out_dir.mkdir()
  out = out_dir / "out.json"
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.generate", f"--model={model}",
       f"--prompts_json={prompts}", f"--output_json={out}", *flags],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  if proc.returncode == 0:
    return proc.returncode, proc.stderr, json.loads(out.read_text())
  assert not os.listdir(out_dir), "a failed run left files behind"
  return proc.returncode, proc.stderr, None


def test_greedy_chat_outputs_match_in_process(tiny_hf_dirs, tmp_path):
  hf_dir = tiny_hf_dirs["llama"]
  rc, err, got = _run(tmp_path, hf_dir, PROMPTS, "--temperature=0", "--chat",
                      "--max_new_tokens=20")
  assert rc == 0, err
  model = load_model(hf_dir)
  tok = model.tokenizer
  token_lists = [tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}]), PROMPTS[1]]
  assert len(token_lists[0]) != len(token_lists[1])
  eos = set(model.config.eos_token_ids) | set(tok.eos_token_ids)
  want = generate(model.params, model.config, token_lists, max_new_tokens=20,
                  sampling=SamplingParams(temperature=0.0), eos_ids=tuple(eos)).outputs
  assert len(got["outputs"]) == len(PROMPTS)
  for out, ref in zip(got["outputs"], want):
    assert out["token_ids"] == ref.token_ids and 1 <= len(out["token_ids"]) <= 20
    assert out["logprobs"] == pytest.approx(ref.logprobs, abs=1e-5)
    assert len(out["logprobs"]) == len(out["token_ids"])
    assert all(lp <= 0 for lp in out["logprobs"])
    assert out["finish_reason"] == ref.finish_reason
    assert out["finish_reason"] in ("eos", "length")
    assert out["text"] == tok.decode([t for t in out["token_ids"] if t not in eos])
  stats = got["stats"]
  assert stats["generated_tokens"] == sum(len(o["token_ids"]) for o in got["outputs"])
  assert stats["model"] == hf_dir and stats["dtype"] == "float32" and stats["load_s"] > 0


def test_sampling_is_seeded(tiny_hf_dirs, tmp_path):
  hf_dir = tiny_hf_dirs["qwen2"]
  runs = {}
  for name, seed in (("a", 3), ("b", 3), ("c", 4)):
    rc, err, got = _run(tmp_path, hf_dir, PROMPTS, *SAMPLING, f"--seed={seed}", name=name)
    assert rc == 0, err
    runs[name] = [(o["token_ids"], o["logprobs"]) for o in got["outputs"]]
  assert runs["a"] == runs["b"]
  assert [ids for ids, _ in runs["a"]] != [ids for ids, _ in runs["c"]]
  assert sum(len(ids) for ids, _ in runs["a"]) > 10


def _bad_model_dir(kind, hf_dir, tmp_path):
  bad = tmp_path / kind
  if kind == "no_config":
    bad.mkdir()
    (bad / "README").write_text("nothing here")
  else:
    shutil.copytree(hf_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["model_type"] = "gpt2"
    (bad / "config.json").write_text(json.dumps(config))
  return str(bad)


# case -> (prompts file: a JSON value, raw bytes, or None for a missing file; model: None
#          for the tiny dir or a _bad_model_dir kind; extra flags; what the error must name)
BAD_INPUTS = {
    "missing_prompts": (None, None, [], ["--prompts_json", "missing.json"]),
    "not_json": (b"['a', ", None, [], ["--prompts_json", "not_json.json"]),
    "object": ({"prompts": ["a"]}, None, [], ["--prompts_json", "object.json"]),
    "empty_list": ([], None, [], ["--prompts_json", "empty_list.json"]),
    "token_id_too_big": ([[5, 6], [7, 128]], None, [], ["--prompts_json", "item 1", "128"]),
    "no_config": (["hi"], "no_config", [], ["{model}:", "config.json"]),
    "unknown_arch": (["hi"], "unknown_arch", [], ["config.json", "gpt2"]),
    "top_p": (["hi"], None, ["--top_p=1.5"], ["--top_p", "1.5"]),
    "temperature": (["hi"], None, ["--temperature=-1"], ["--temperature"]),
    "output_dir_missing": (["hi"], None, ["--output_json=/nonexistent_dir/out.json"],
                           ["--output_json", "/nonexistent_dir does not exist"]),
}
# Output paths are checked before the model loads, not after the whole generation.
CHECKED_BEFORE_LOADING = ("output_dir_missing",)


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_inputs_fail_with_one_line(tiny_hf_dirs, tmp_path, case):
  prompts, model_kind, flags, names = BAD_INPUTS[case]
  hf_dir = tiny_hf_dirs["llama"]
  model = hf_dir if model_kind is None else _bad_model_dir(model_kind, hf_dir, tmp_path)
  path = tmp_path / ("missing.json" if prompts is None else f"{case}.json")
  if prompts is not None:
    path.write_bytes(prompts if isinstance(prompts, bytes) else json.dumps(prompts).encode())
  rc, err, out = _run(tmp_path, model, str(path), "--max_new_tokens=4", *flags)
  assert rc == 2 and out is None, err
  assert "Traceback" not in err, err
  lines = err.strip().splitlines()
  errors = [l for l in lines if l.startswith("error:")]
  assert len(errors) == 1 and errors[0] == lines[-1], err
  for name in names:
    assert name.format(model=model) in errors[0], (name, errors[0])
  if case in CHECKED_BEFORE_LOADING:
    assert "loading" not in err, err


def test_smollm2_chat_answers_paris(tmp_path):
  rc, err, got = _run(tmp_path, "smollm2", ["What is the capital of France?"], "--chat",
                      "--temperature=0", "--max_new_tokens=24")
  assert rc == 0, err
  (out,) = got["outputs"]
  assert "Paris" in out["text"] and out["finish_reason"] in ("eos", "length")
  assert len(out["logprobs"]) == len(out["token_ids"]) <= 24

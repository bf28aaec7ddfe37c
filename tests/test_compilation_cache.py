"""JAX's persistent compilation cache, as every entry point turns it on
(`--compilation_cache_dir`): a second run of a setting builds no program and says how many
it loaded; an empty value turns it off; a directory it cannot write is one line, exit 2."""
import json
import os
import subprocess
import sys

from tlt_jax.runtime import compilation_cache

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _generate(model: str, tmp_path, name: str, *flags) -> subprocess.CompletedProcess:
  prompts = tmp_path / "prompts.json"
  prompts.write_text(json.dumps([[5, 6, 7], [8, 9, 10, 11, 12]]))
  return subprocess.run(
      [sys.executable, "-m", "experiments.generate", f"--model={model}",
       f"--prompts_json={prompts}", f"--output_json={tmp_path / name}", "--temperature=0",
       "--max_new_tokens=6", *flags], cwd=REPO, capture_output=True, text=True, timeout=300)


def _stats(tmp_path, name: str) -> dict:
  return json.loads((tmp_path / name).read_text())["stats"]


def test_a_second_run_loads_every_program_from_the_cache(tiny_hf_dirs, tmp_path):
  cache = tmp_path / "cache"
  for name in ("cold.json", "warm.json"):
    proc = _generate(tiny_hf_dirs["llama"], tmp_path, name, f"--compilation_cache_dir={cache}")
    assert proc.returncode == 0, proc.stderr[-3000:]
  cold, warm = _stats(tmp_path, "cold.json"), _stats(tmp_path, "warm.json")
  assert cold["compile/new_programs"] > 0 and cold["compile/cache_hits"] == 0, cold
  assert warm["compile/new_programs"] == 0, warm
  assert warm["compile/cache_hits"] == cold["compile/new_programs"], (cold, warm)
  assert os.listdir(cache)


def test_an_empty_dir_turns_it_off(tiny_hf_dirs, tmp_path, monkeypatch):
  monkeypatch.setenv(compilation_cache.ENV, str(tmp_path / "from_env"))
  proc = _generate(tiny_hf_dirs["llama"], tmp_path, "out.json", "--compilation_cache_dir=")
  assert proc.returncode == 0, proc.stderr[-3000:]
  stats = _stats(tmp_path, "out.json")
  assert stats["compile/new_programs"] > 0 and stats["compile/cache_hits"] == 0, stats
  assert not (tmp_path / "from_env").exists()


def test_the_default_follows_jax_then_xdg(monkeypatch, tmp_path):
  monkeypatch.setenv(compilation_cache.ENV, str(tmp_path / "jax"))
  assert compilation_cache.default_dir() == str(tmp_path / "jax")
  monkeypatch.delenv(compilation_cache.ENV)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert compilation_cache.default_dir() == str(tmp_path / "xdg" / "tlt_jax" / "jax")


def test_an_unwritable_dir_is_one_line(tiny_hf_dirs, tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  proc = _generate(tiny_hf_dirs["llama"], tmp_path, "out.json",
                   f"--compilation_cache_dir={blocker}/jax")
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines() == [
      f"error: --compilation_cache_dir={blocker}/jax: {blocker} is not a directory"]

"""The long-context benchmark's CLI at tiny sizes: one JSON object with per-length plain and
SD figures (nothing compiled while timed), and a bad --output_json rejected up front."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench(*args):
  return subprocess.run([sys.executable, "benchmarks/long_context.py", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=300)


def test_two_lengths_print_the_figures(tmp_path):
  out = tmp_path / "long_context.json"
  proc = _bench("--cache_lengths=256,512", "--prompt_len=64", "--rows=2", "--repeats=1",
                "--prefill_rows=1", f"--output_json={out}")
  assert proc.returncode == 0, proc.stderr
  report = json.loads(proc.stdout)
  assert json.loads(out.read_text()) == report
  assert [e["cache_length"] for e in report["per_length"]] == [256, 512]
  for entry in report["per_length"]:
    assert entry["cache_length_used"] == entry["cache_length"]
    assert entry["plain"]["batch_buckets"] == [2, 1]          # compaction engaged
    assert entry["sd"]["sd_on_at_s"] is not None              # SD switched on
    for side in ("plain", "sd"):
      assert entry[side]["per_token_ms_last_window"] > 0
      assert entry[side]["new_programs_timed"] == 0
    assert entry["switch_prefill"]["prefill_len"] == entry["cache_length"]
    assert entry["memory"]["peak_rss_mib"] > 0
  assert len(report["growth_per_doubling"]["plain_per_token"]) == 1
  assert "cache length 512" in proc.stderr


def test_missing_output_directory_fails_before_any_work(tmp_path):
  proc = _bench(f"--output_json={tmp_path}/missing/out.json")
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines() == [
      f"error: --output_json={tmp_path}/missing/out.json: directory {tmp_path}/missing "
      "does not exist"]

"""The rollout benchmark's question files: written for a machine without reasoning-gym,
read back there, and rejected with one line when they do not fit the flags."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench(*args):
  return subprocess.run([sys.executable, "benchmarks/rollout.py", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=300)


def test_questions_round_trip_and_bad_files(tmp_path):
  path = tmp_path / "questions.json"
  written = _bench("--accept_prompts=3", f"--write_questions={path}")
  assert written.returncode == 0, written.stderr
  questions = json.loads(path.read_text())
  assert len(questions["main"]) == 64 and len(questions["accept"]) == 3
  assert len(set(questions["main"])) == 64 and all(q.strip() for q in questions["main"])
  # Read back: the same questions pass validation (and are written out unchanged).
  again = tmp_path / "again.json"
  reread = _bench("--accept_prompts=3", f"--questions_json={path}", f"--write_questions={again}")
  assert reread.returncode == 0, reread.stderr
  assert json.loads(again.read_text()) == questions

  bad = tmp_path / "bad.json"
  for content, needle in ((questions, "3 'accept' questions, these flags need 5"),
                          ({"main": questions["main"]}, "under 'accept'"),
                          ("not json", "cannot read")):
    bad.write_text(json.dumps(content) if content != "not json" else content)
    proc = _bench("--accept_prompts=5", f"--questions_json={bad}")
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --questions_json=") and needle in last, proc.stderr

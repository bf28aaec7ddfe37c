"""tlt_jax.files: a target holds its old content or its new, never half, and no temporary
is left behind."""
import os
import stat

import pytest

from tlt_jax.errors import UserInputError
from tlt_jax.files import atomic_dir, atomic_file, write_atomic


def _leftovers(directory):
  return [p for p in os.listdir(directory) if ".tmp-" in p]


def test_write_atomic_writes_text_and_bytes_readable_by_all(tmp_path):
  write_atomic(str(tmp_path / "a.json"), '{"x": 1}\n')
  write_atomic(str(tmp_path / "b.bin"), b"\x00\x01")
  assert (tmp_path / "a.json").read_text() == '{"x": 1}\n'
  assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
  assert stat.S_IMODE(os.stat(tmp_path / "b.bin").st_mode) == 0o644
  assert not _leftovers(tmp_path)


def test_a_failed_write_keeps_the_old_file(tmp_path):
  path = str(tmp_path / "metrics.jsonl")
  write_atomic(path, "old\n")
  with pytest.raises(RuntimeError):
    with atomic_file(path) as f:
      f.write("half")
      raise RuntimeError("disk full")
  assert open(path).read() == "old\n"
  assert not _leftovers(tmp_path)


def test_atomic_file_takes_write_modes_only(tmp_path):
  with pytest.raises(ValueError, match="mode 'a'"):
    with atomic_file(str(tmp_path / "x"), "a"):
      pass


def test_atomic_dir_replaces_a_dir_as_a_whole_or_not_at_all(tmp_path):
  out = tmp_path / "out"
  with atomic_dir(str(out)) as tmp:
    open(os.path.join(tmp, "one"), "w").close()
  with pytest.raises(UserInputError, match="exists and is not empty"):
    with atomic_dir(str(out)):
      pass
  with pytest.raises(RuntimeError):
    with atomic_dir(str(out), overwrite=True) as tmp:
      open(os.path.join(tmp, "two"), "w").close()
      raise RuntimeError("crash")
  assert os.listdir(out) == ["one"]
  with atomic_dir(str(out), overwrite=True) as tmp:
    open(os.path.join(tmp, "two"), "w").close()
  assert os.listdir(out) == ["two"]
  assert not _leftovers(tmp_path)

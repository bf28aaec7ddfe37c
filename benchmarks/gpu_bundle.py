"""Packs what the GPU check needs into gpu_bundle/, in two parts that each fit one device call.

The device machine has jax, flax, optax, orbax, triton and transformers, but no
reasoning-gym, no gguf reader, no jax-triton and no model hub, and one call carries at
most 64 MiB, working tree included, less than the 98 MB SmolLM2 GGUF. So:
  gpu_bundle/part1/  the gguf and jax-triton wheels (the kernels' checks need them first),
                     and the GGUF's first bytes, as many as fit beside the working tree
  gpu_bundle/part2/  the rest of it and its sha256, the drafter export (safetensors +
                     config), the benchmarks' questions (--write_questions)

  python benchmarks/gpu_bundle.py [--drafter=DIR]
then benchmarks/gpu_check.sh says how to run it there.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402
from experiments import cli  # noqa: E402
from tlt_jax.errors import UserInputError  # noqa: E402

_DRAFTER = flags.DEFINE_string("drafter", "assets/drafter_smollm2", "Drafter dir to ship.")
_OUT = flags.DEFINE_string("out", "gpu_bundle", "Bundle dir (replaced).")
_ACCEPT_PROMPTS = flags.DEFINE_integer("accept_prompts", 12, "Questions for part 3.")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRAFTER_FILES = ("drafter.safetensors", "drafter_config.json")
JAX_TRITON = "jax-triton>=0.3"     # pyproject's `triton` extra; the device has triton itself
CALL_BYTES = 64 * 2**20            # what one device call carries, the working tree included
MARGIN_BYTES = 2**20               # for files the working tree gains before the call


def working_tree_bytes() -> int:
  """Bytes of what travels with every call: tracked and untracked, not ignored, files."""
  listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                          cwd=REPO, check=True, capture_output=True).stdout
  paths = [os.path.join(REPO, p) for p in listed.decode().split("\0") if p]
  return sum(os.path.getsize(p) for p in paths if os.path.isfile(p))


def folder_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(root, name))
             for root, _, names in os.walk(path) for name in names)


def main(argv):
  del argv
  from tlt_jax.models.bundled import smollm2_gguf_path
  for name in DRAFTER_FILES:
    if not os.path.isfile(os.path.join(_DRAFTER.value, name)):
      raise UserInputError(f"--drafter={_DRAFTER.value}: no {name} (not a drafter export)")
  gguf = smollm2_gguf_path()
  out = os.path.abspath(_OUT.value)
  staging = out + ".partial"          # renamed into place when complete
  shutil.rmtree(staging, ignore_errors=True)
  part1, part2 = os.path.join(staging, "part1"), os.path.join(staging, "part2")
  for d in (part1, part2, os.path.join(part2, "drafter"), os.path.join(part1, "wheels")):
    os.makedirs(d)
  # Pure-Python wheels: the same file serves the device's Python 3.12.
  for requirement in (f"gguf=={importlib.metadata.version('gguf')}", JAX_TRITON):
    print(f"downloading {requirement} ...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--only-binary=:all:", "-d", os.path.join(part1, "wheels"), requirement],
                   check=True)

  with open(gguf, "rb") as f:
    data = f.read()
  # Part 1 takes all the GGUF that fits beside the working tree and the wheels; part 2 the rest.
  tree = working_tree_bytes()
  cut = min(len(data), CALL_BYTES - tree - MARGIN_BYTES - folder_bytes(part1))
  for directory, chunk in ((part1, data[:cut]), (part2, data[cut:])):
    with open(os.path.join(directory, "smollm2.gguf.part"), "wb") as f:
      f.write(chunk)
  with open(os.path.join(part2, "smollm2.gguf.sha256"), "w") as f:
    f.write(hashlib.sha256(data).hexdigest())
  for name in DRAFTER_FILES:
    shutil.copy(os.path.join(_DRAFTER.value, name), os.path.join(part2, "drafter", name))

  print("writing the benchmark's questions ...", file=sys.stderr)
  subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "rollout.py"),
                  f"--accept_prompts={_ACCEPT_PROMPTS.value}",
                  f"--write_questions={os.path.join(part2, 'questions.json')}"], check=True)
  sizes = {part: folder_bytes(os.path.join(staging, part)) for part in ("part1", "part2")}
  if tree + sizes["part2"] + MARGIN_BYTES > CALL_BYTES:
    shutil.rmtree(staging)
    raise UserInputError(f"part2 ({sizes['part2'] / 2**20:.1f} MiB) and the working tree "
                         f"({tree / 2**20:.1f} MiB) exceed one call's "
                         f"{CALL_BYTES / 2**20:.0f} MiB")
  shutil.rmtree(out, ignore_errors=True)
  os.replace(staging, out)
  for part, size in sizes.items():
    print(f"{out}/{part}: {size / 2**20:.1f} MiB (+ {tree / 2**20:.1f} MiB working tree)",
          file=sys.stderr)


if __name__ == "__main__":
  cli.run(main)

"""Shared pytest fixtures and settings."""
import os

# No test writes to the user's compilation cache: entry points the tests start (and JAX in
# this process) run with it off, unless a test passes its own --compilation_cache_dir.
os.environ["JAX_COMPILATION_CACHE_DIR"] = ""
# Nor to the user's tokenizer cache: tests/run_files.py gives the suite's files one of
# their own; a pytest started alone gets a fresh one.
if "TLT_JAX_TOKENIZER_CACHE" not in os.environ:
  import atexit, shutil, tempfile  # noqa: E401
  _tokenizers = tempfile.mkdtemp(prefix="tlt_jax_tokenizers_")
  atexit.register(shutil.rmtree, _tokenizers, True)
  os.environ["TLT_JAX_TOKENIZER_CACHE"] = _tokenizers

import jax  # noqa: E402  (after the environment it reads)
import pytest

from tests.hf_fixtures import TINY_KINDS, make_tiny_hf_checkpoint


def pytest_configure(config):
  """The float32 oracles (HF torch on the CPU, jnp references, plain decoding for SD) are
  IEEE float32; on a GPU XLA lets a float32 matmul run in TF32 (~1e-3 relative), so tests
  there ask for float32 (a CPU computes float32 either way)."""
  del config
  if jax.default_backend() == "gpu":
    jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory) -> str:
  """A persistent compilation cache for the CLI runs of one test file that repeat a setting
  (a resume, a second run): pass it as JAX_COMPILATION_CACHE_DIR in their environment and the
  later runs load the first one's programs. Each test file runs in a pytest process of its
  own (tests/run_files.py), so no file depends on another's programs."""
  return str(tmp_path_factory.mktemp("compile_cache"))


@pytest.fixture(scope="session")
def tiny_hf_dirs(tmp_path_factory) -> dict[str, str]:
  """kind -> dir of a tiny random HF checkpoint, one per TINY_KINDS, built once."""
  root = tmp_path_factory.mktemp("tiny_hf")
  return {kind: make_tiny_hf_checkpoint(kind, str(root / kind)) for kind in TINY_KINDS}


@pytest.fixture(scope="session")
def tiny_hf_sharded_dir(tmp_path_factory) -> str:
  """A tiny Llama checkpoint split over several safetensors files with an index."""
  return make_tiny_hf_checkpoint("llama", str(tmp_path_factory.mktemp("tiny_hf") / "sharded"),
                                 shard=True)

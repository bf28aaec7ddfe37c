"""The CPU packed-matmul kernel's AVX-512 path against its AVX2 path on SmolLM2's weight
matmuls: every layer's q/k/v, o, gate/up and down plus the LM head, weights streamed from
memory as in a rollout step, at each row count (decode at batch B multiplies B rows; a
depth-4 chain's verify, 5B).

  python benchmarks/research/packed_matmul_paths.py [--rows=1,4,8,16,20,32,80] [--rounds=3]
      [--output=FILE]

The kernel picks its path once, when it loads (TLT_JAX_CPU_AVX512=0 keeps AVX2), so each
side is a fresh process of this script (--side), alternated A B B A A B ...; per row count,
both sides' median milliseconds and the median over rounds of AVX2 time / AVX-512 time.
Prints JSON. Needs a CPU with AVX-512 (else both sides run the AVX2 path: an error).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from absl import flags  # noqa: E402

from benchmarks.report import emit  # noqa: E402
from experiments import cli  # noqa: E402
from tlt_jax.errors import UserInputError  # noqa: E402

_ROWS = flags.DEFINE_list("rows", ["1", "4", "8", "16", "20", "32", "80"], "Row counts.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Alternated rounds (a process per side each).",
                               lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 40, "Timed calls per row count in a process.",
                                lower_bound=1)
_SIDE = flags.DEFINE_enum("side", None, ["avx2", "avx512"], "Internal: time one side here.")
_OUTPUT = flags.DEFINE_string("output", None, "Also write the JSON here.")

SIDES = {"avx2": "0", "avx512": "1"}   # TLT_JAX_CPU_AVX512


def time_side(rows: list[int]) -> dict[str, float]:
  """Milliseconds of one pass over every weight matmul, by row count, in this process."""
  import jax
  import numpy as np

  from benchmarks.matmul_rate import layer_shapes
  from tlt_jax.cpu import packed_matmul as pm
  from tlt_jax.models.loading import load_model

  config = load_model("smollm2").config
  shapes = layer_shapes(config, 1)
  rng = np.random.default_rng(0)
  pack = lambda k, n: pm.pack(rng.standard_normal((k, n), dtype=np.float32) * 0.02)
  weights = [pack(k, n) for name, ((_, k, n), count) in shapes.items()
             for _ in range(count)]
  step = jax.jit(lambda xs, weights: [pm.packed_matmul(xs[w.panels.shape[1]], w)
                                      for w in weights])
  out = {}
  for m in rows:
    xs = {k: rng.standard_normal((m, k), dtype=np.float32)
          for k in {w.panels.shape[1] for w in weights}}
    jax.block_until_ready(step(xs, weights))
    times = []
    for _ in range(_REPEATS.value):
      start = time.perf_counter()
      jax.block_until_ready(step(xs, weights))
      times.append(time.perf_counter() - start)
    out[str(m)] = 1e3 * statistics.median(times)
  return out


def main(argv):
  del argv
  if not all(r.isdigit() and int(r) >= 1 for r in _ROWS.value):
    raise UserInputError(f"--rows={','.join(_ROWS.value)}: each must be an integer >= 1")
  rows = [int(r) for r in _ROWS.value]
  if _SIDE.value is not None:
    print(json.dumps(time_side(rows)))
    return
  from tlt_jax.cpu import kernels
  if kernels.build_problem() is not None or not {"avx512f", "avx512vl"} <= (
      kernels.cpu_flags()):
    raise UserInputError("packed_matmul_paths: needs the CPU kernels and AVX-512 here "
                         f"({kernels.build_problem() or 'no avx512f/avx512vl'})")
  runs = {side: [] for side in SIDES}
  for r in range(_ROUNDS.value):
    for side in (SIDES if r % 2 == 0 else reversed(SIDES)):
      env = dict(os.environ, TLT_JAX_CPU_AVX512=SIDES[side], TLT_JAX_CPU_KERNELS="kernel")
      proc = subprocess.run([sys.executable, os.path.abspath(__file__), f"--side={side}",
                             f"--rows={','.join(map(str, rows))}",
                             f"--repeats={_REPEATS.value}"], env=env, capture_output=True,
                            text=True, check=True)
      runs[side].append(json.loads(proc.stdout.strip().splitlines()[-1]))
      print(f"round {r + 1}/{_ROUNDS.value} {side}: {runs[side][-1]}", file=sys.stderr,
            flush=True)
  report = {"what": "SmolLM2's weight matmuls (30 layers + LM head), one pass, ms",
            "rounds": _ROUNDS.value, "by_rows": {}}
  for m in map(str, rows):
    avx2, avx512 = ([run[m] for run in runs[side]] for side in SIDES)
    report["by_rows"][m] = {"avx2_ms": statistics.median(avx2),
                            "avx512_ms": statistics.median(avx512),
                            "speedup_paired_median": statistics.median(
                                a / b for a, b in zip(avx2, avx512))}
  emit(report, _OUTPUT.value)


if __name__ == "__main__":
  cli.run(main)

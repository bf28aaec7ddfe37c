"""One training micro-batch of SmolLM2 against the CPU's matmul rate: the train phase's roofline.

  python benchmarks/research/train_microbatch.py [--rows=4] [--seq_len=256] [--repeats=5]
      [--output_json=FILE]

A packed micro-batch of ~128-token samples (50 prompt + 40-75 response tokens, as the RL
step's) goes through the policy's `accumulate_grads` (forward, loss, backward, KL on) and
`score_rows` (forward only, the reference's pass), alternated with the CPU's jitted fp32
matmul rate at the micro-batch's layer and head shapes (`benchmarks/matmul_rate.py`, the
rate benchmarks/rl_step.py holds its train phase against): A B C A B C ...
FLOPs count the matmuls the pass really does (every slot through the layers, the LM head
on the scored slots only; attention left out), x3 for forward + backward. Beside them, the floor: the same weight matmuls
(forward, dx, dw) timed as lone calls (`training_matmul_seconds`), so `train_frac_of_floor`
says how much of the micro-batch is anything else, and `ceiling_train_frac_of_matmul` is
the best rl_step.py's train_frac_of_matmul could read on fully packed rows. Medians after a
warm-up call each; compile time excluded. One JSON object on stdout.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from absl import flags  # noqa: E402

from benchmarks.matmul_rate import matmul_throughput, training_matmul_seconds  # noqa: E402
from benchmarks.report import emit  # noqa: E402
from experiments import cli  # noqa: E402

_ROWS = flags.DEFINE_integer("rows", 4, "Packed rows per micro-batch.", lower_bound=1)
_SEQ_LEN = flags.DEFINE_integer("seq_len", 256, "Slots per row (a multiple of 128).",
                                lower_bound=128)
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed rounds.", lower_bound=1)
_OUTPUT = flags.DEFINE_string("output_json", None, "Also write the JSON here.")
MATMUL_REPS = 5   # timed calls per matmul shape and round


def main(argv):
  del argv
  if _OUTPUT.value:
    cli.check_output_file(_OUTPUT.value, "--output_json")
  import jax
  import jax.numpy as jnp
  import numpy as np

  from tlt_jax.errors import UserInputError
  from tlt_jax.models.loading import load_model
  from tlt_jax.rl.batching import Sequences, micro_batches, pack
  from tlt_jax.rl.config import LossConfig
  from tlt_jax.rl.logprobs import score_rows
  from tlt_jax.rl.update import accumulate_grads, zero_grads
  from tlt_jax.rollout.sampling import SamplingParams

  if _SEQ_LEN.value % 128:
    raise UserInputError(f"--seq_len={_SEQ_LEN.value}: must be a multiple of 128")
  model = load_model("smollm2", dtype=jnp.float32)
  config, params = model.config, model.params
  rng = np.random.default_rng(0)
  samples = _ROWS.value * (_SEQ_LEN.value // 128)
  prompts = [rng.integers(0, 1000, 50).tolist() for _ in range(samples)]
  responses = [rng.integers(0, 1000, int(rng.integers(40, 76))).tolist()
               for _ in range(samples)]
  sequences = Sequences(prompts, responses)
  layout = pack(sequences, range(samples), _SEQ_LEN.value)
  per_token = {k: [np.full(len(r), -1.0, np.float32) for r in responses]
               for k in ("old_logp", "rollout_logp", "ref_logp")}
  weights = np.full(samples, 1.0 / sum(map(len, responses)), np.float32)
  rows = next(micro_batches(layout, sequences, _ROWS.value, per_token,
                            {"advantages": np.ones(samples, np.float32),
                             "loss_weights": weights, "metric_weights": weights}))
  sampling, loss = SamplingParams(1.0), LossConfig(kl_coef=0.04)
  grads = zero_grads(params)

  def train():
    nonlocal grads
    grads, _ = accumulate_grads(params, grads, rows, config=config, sampling=sampling,
                                loss=loss)
    jax.block_until_ready(grads)

  def forward():
    jax.block_until_ready(score_rows(params, rows, config=config, sampling=sampling))

  slots = _ROWS.value * _SEQ_LEN.value
  for fn in (train, forward):
    fn()                                   # compile and warm up
  scored = len(rows.scored_slots)
  times = {"train": [], "forward": []}
  matmul_rounds, floor_rounds = [], []
  for _ in range(_REPEATS.value):
    for name, fn in (("train", train), ("forward", forward)):
      start = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - start)
    matmul_rounds.append(matmul_throughput(config, slots, reps=MATMUL_REPS)["gflops"])
    floor_rounds.append(training_matmul_seconds(config, slots, scored, reps=MATMUL_REPS))
  median = {name: statistics.median(t) for name, t in times.items()}
  floor = {key: statistics.median(r[key] for r in floor_rounds)
           for key in ("seconds", "forward_s", "backward_s")}

  embed = config.vocab_size * config.hidden_size
  layer_params = config.num_params - embed - (0 if config.tie_word_embeddings else embed)
  forward_flops = 2 * layer_params * slots + 2 * embed * scored
  matmul_gflops = statistics.median(matmul_rounds)
  train_gflops = 3 * forward_flops / median["train"] / 1e9
  forward_gflops = forward_flops / median["forward"] / 1e9
  emit({
      "workload": {"model": "SmolLM2-135M-Instruct fp32", "rows": _ROWS.value,
                   "seq_len": _SEQ_LEN.value, "samples": samples,
                   "real_tokens": int((np.asarray(rows.segment_ids) > 0).sum()),
                   "scored_slots": scored, "kl_coef": 0.04},
      "median_s": median, "per_round_s": times, "matmul_gflops_per_round": matmul_rounds,
      "gflops": {"train": train_gflops, "forward": forward_gflops, "matmul": matmul_gflops},
      "frac_of_matmul": {"train": train_gflops / matmul_gflops,
                         "forward": forward_gflops / matmul_gflops},
      "flops_counted": "matmuls over every slot in the layers, the LM head on scored slots, "
                       "x3 for forward+backward; attention not counted",
      # The floor: the same weight matmuls timed alone, forward and both backward ones.
      "matmul_floor_s": floor, "matmul_floor_per_shape": floor_rounds[-1]["gflops_per_shape"],
      "train_frac_of_floor": floor["seconds"] / median["train"],
      # What rl_step.py's train_frac_of_matmul (6 x params x tokens at the forward-shape
      # rate) would read for fully packed rows if the program did only its matmuls.
      "ceiling_train_frac_of_matmul": (6 * config.num_params * slots / (matmul_gflops * 1e9)
                                       / floor["seconds"]),
  }, _OUTPUT.value)


if __name__ == "__main__":
  cli.run(main)

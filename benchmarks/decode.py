"""Greedy decode throughput on CPU: tlt_jax vs transformers `generate` vs Tunix's sampler,
SmolLM2-135M fp32.

The sides run strictly one after the other (they share the cores), alternating tlt, hf,
tunix, tlt, hf, tunix ... so machine noise hits all alike; speedups are taken per repeat,
then the median. tlt and transformers run in this process; Tunix (google-tunix, its vanilla
`Sampler`) in its own venv under --bench_dir (installed on first use, as for
benchmarks/rl_step.py), a server process (benchmarks/peers/tunix_decode.py) that decodes a
batch each time it is asked, from the same prompt ids and the same weights (the HF copy of
the bundled GGUF). transformers runs at 2 torch threads and at 1: on this shared
2-core box torch's OpenMP threads stall whenever other processes hold a core (2 threads
measured ~6x slower per step than 1 under load; idle, equal at batch 1 and ~1.3x faster
at batch 8), so each speedup is taken against the faster of the two in that repeat. The
batch-1 figure is also set against the memory-bandwidth roofline measured here: decode at
batch 1 must stream every weight once per token. Only an idle machine gives figures worth
keeping (and a ~3 minute run); the load average is recorded with them.

  python -m benchmarks.decode [--repeats 3] [--no-tunix] [--output results.json]  # repo root
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import ab  # noqa: E402
from benchmarks.peer_envs import PEER_PACKAGES, ensure_hf_model, ensure_venv  # noqa: E402
from benchmarks.report import emit  # noqa: E402
import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from experiments import cli
from tlt_jax.cpu import kernels as cpu_kernels
from tlt_jax.errors import UserInputError
from tlt_jax.models.bundled import smollm2_gguf_path
from tlt_jax.models.loading import load_model
from tlt_jax.rollout.weights import rollout_layout
from tlt_jax.rollout.buckets import BucketSpec
from tlt_jax.rollout.engine import generate
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.runtime import host

PROMPT_TOKENS = 32
NEW_TOKENS = 128
BATCH_SIZES = (1, 8)
GOALS = {1: 2.0, 8: 1.8}      # wanted tlt/hf speedups
TUNIX_GOALS = {8: 1.5}        # wanted tlt/tunix speedups
THREADS = 2                   # the machine's cores: the bandwidth probe and tlt use both
HF_THREADS = (2, 1)


def log(msg: str) -> None:
  print(f"[decode] {msg}", file=sys.stderr, flush=True)


def median(xs):
  return statistics.median(xs)


class BandwidthProbe:
  """Read bandwidth: a ~1 GiB fp32 array reduced by two threads, one half each.

  Sampled just before and after every tlt run, since other load on the machine moves it.
  Under load numpy's float32 sum ran up to ~1.5x slower than max; any full read is a lower
  bound on the bandwidth, so each sample keeps the faster kernel's median.
  """

  KERNELS = {"sum": np.sum, "max": np.max}

  def __init__(self, gib: float = 1.0):
    self.data = np.ones(int(gib * 2**30) // 4, np.float32)
    self.halves = np.array_split(self.data, THREADS)
    self.pool = concurrent.futures.ThreadPoolExecutor(THREADS)
    self.samples = []
    self.sample()                                 # warm-up, kept out of the figures
    self.samples.clear()

  def sample(self, runs: int = 5) -> float:
    """GB/s now (numpy releases the GIL inside reductions, so the threads run in parallel)."""
    medians = {}
    for name, kernel in self.KERNELS.items():
      rates = []
      for _ in range(runs):
        start = time.perf_counter()
        list(self.pool.map(kernel, self.halves))
        rates.append(self.data.nbytes / (time.perf_counter() - start) / 1e9)
      medians[name] = median(rates)
    self.samples.append(medians)
    return max(medians.values())

  def report(self) -> dict:
    best = [max(m.values()) for m in self.samples]
    return {"array_gib": self.data.nbytes / 2**30, "threads": THREADS, "gb_per_s": median(best),
            "samples_gb_per_s": best,
            "kernel_median_gb_per_s": {k: median([m[k] for m in self.samples])
                                       for k in self.KERNELS}}


def bytes_per_step(params, config, cache_len: int) -> dict:
  """Bytes a batch-1 decode step reads: every param once, plus the K/V cache it attends over.

  The tied embedding is one array: the LM head reads all of it, the lookup one row more.
  In the packed CPU layout the head is its own copy (`packed_lm_head`): the embedding and
  an untied `lm_head` are then only looked up. tlt attends over the whole (bucketed)
  cache each step, masked, so all of it is read.
  """
  unread = ("embed", "lm_head") if "packed_lm_head" in params else ()
  weights = sum(x.nbytes for name, tree in params.items() if name not in unread
                for x in jax.tree.leaves(tree))
  itemsize = params["embed"].dtype.itemsize
  kv = 2 * config.num_layers * cache_len * config.num_kv_heads * config.head_dim * itemsize
  return {"weights": weights, "kv_cache": kv}


def load_hf(path: str) -> torch.nn.Module:
  """transformers' own GGUF reading (dequantized), without `accelerate`.

  from_pretrained(gguf_file=...) insists on accelerate; this is the function it calls.
  """
  from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
  folder, name = os.path.split(path)
  config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
  missing, unexpected = model.load_state_dict(tensors, strict=False)
  assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
  model.tie_weights()
  assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
  model.generation_config.eos_token_id = None   # like eos_ids=(): never stop early
  model.generation_config.pad_token_id = config.pad_token_id or 0
  return model.eval()


def run_tlt(model, params, prompts) -> dict:
  start = time.perf_counter()
  result = generate(params, model.config, prompts, max_new_tokens=NEW_TOKENS,
                    sampling=SamplingParams(temperature=0.0), eos_ids=())
  wall = time.perf_counter() - start
  tokens = [o.token_ids for o in result.outputs]
  assert all(len(t) == NEW_TOKENS for t in tokens), [len(t) for t in tokens]
  n = len(prompts) * NEW_TOKENS
  stats = result.stats
  # The live-rows trace starts once prefill is done; prefill emits each row's first token.
  prefill_s = stats["rollout/live_rows"][0][0]
  return {"tokens": tokens, "wall_s": wall, "tokens_per_s": n / wall, "prefill_s": prefill_s,
          "decode_tokens_per_s": (n - len(prompts)) / (stats["total_s"] - prefill_s),
          "new_programs": stats["compile/new_programs"]}


def run_hf(model, prompts, threads: int, new_tokens: int = NEW_TOKENS) -> dict:
  torch.set_num_threads(threads)
  ids = torch.tensor(prompts)
  start = time.perf_counter()
  with torch.inference_mode():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=new_tokens)
  wall = time.perf_counter() - start
  assert out.shape == (len(prompts), PROMPT_TOKENS + new_tokens), out.shape
  n = len(prompts) * new_tokens
  return {"tokens": out[:, PROMPT_TOKENS:].tolist(), "wall_s": wall, "tokens_per_s": n / wall}


class TunixSide:
  """The Tunix sampler in its own venv (benchmarks/peers/tunix_decode.py), one batch per ask."""

  def __init__(self, bench_dir: str, batches: dict[int, list[list[int]]]):
    python = ensure_venv(bench_dir, "tunix")
    model_dir = ensure_hf_model(bench_dir)
    prompts = os.path.join(bench_dir, "decode_prompts.json")
    with open(prompts, "w") as f:
      json.dump({str(b): rows for b, rows in batches.items()}, f)
    driver = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", "tunix_decode.py")
    self.log_path = os.path.join(bench_dir, "tunix_decode.log")
    with open(self.log_path, "w") as log_file:   # the child keeps its own handle
      self.proc = subprocess.Popen(
          [python, driver, f"--model_dir={model_dir}", f"--prompts={prompts}",
           f"--new_tokens={NEW_TOKENS}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
          stderr=log_file, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    self._expect("READY")

  def _expect(self, what: str) -> str:
    line = self.proc.stdout.readline()
    if not line or (what and line.strip() != what):
      raise UserInputError(f"tunix decode driver failed (see {self.log_path}): {line.strip()!r}")
    return line

  def run(self, batch: int) -> dict:
    self.proc.stdin.write(f"{batch}\n")
    self.proc.stdin.flush()
    out = json.loads(self._expect(""))
    assert out["lengths"] == [NEW_TOKENS] * batch, out["lengths"]
    return out

  def close(self) -> None:
    self.proc.stdin.close()
    self.proc.wait(timeout=60)


def agreement(ours: list[int], theirs: list[int]) -> dict:
  same = [a == b for a, b in zip(ours, theirs)]
  return {"identical_fraction": sum(same) / len(same),
          "first_mismatch": same.index(False) if not all(same) else None}


def bench_batch(tlt_model, tlt_params, hf_model, tunix: TunixSide | None, prompts,
                repeats: int, probe: BandwidthProbe) -> dict:
  """Warm-up of each side (tlt's and Tunix's first calls compile), then `repeats` of
  probe, tlt, probe, hf..., tunix: the bandwidth paired with a tlt run is the mean of the
  probes just before and just after it (the host's load moves both within seconds)."""
  b = len(prompts)
  first = run_tlt(tlt_model, tlt_params, prompts)
  log(f"batch {b}: tlt first call {first['wall_s']:.2f}s")
  for threads in HF_THREADS:                      # a short run: only code paths need warming
    run_hf(hf_model, prompts, threads, new_tokens=8)
  tunix_first = tunix.run(b) if tunix else None
  tlt, hf, tunix_runs, bandwidth = [], {n: [] for n in HF_THREADS}, [], []
  for r in range(repeats):
    before = probe.sample()
    tlt.append(run_tlt(tlt_model, tlt_params, prompts))
    bandwidth.append((before + probe.sample()) / 2)
    assert tlt[-1]["new_programs"] == 0, "a steady-state call compiled"
    for threads in HF_THREADS:
      hf[threads].append(run_hf(hf_model, prompts, threads))
    if tunix:
      tunix_runs.append(tunix.run(b))
    log(f"batch {b} repeat {r + 1}/{repeats}: tlt {tlt[-1]['tokens_per_s']:.1f} tok/s, " +
        ", ".join(f"hf@{n} {hf[n][-1]['tokens_per_s']:.1f}" for n in HF_THREADS) +
        (f", tunix {tunix_runs[-1]['tokens_per_s']:.1f}" if tunix else "") +
        f", read {bandwidth[-1]:.1f} GB/s, load {os.getloadavg()[0]:.1f}")
  steady_wall = median([t["wall_s"] for t in tlt])
  report = {
      "tlt": {
          "tokens_per_s": median([t["tokens_per_s"] for t in tlt]),
          "decode_tokens_per_s": median([t["decode_tokens_per_s"] for t in tlt]),
          "prefill_s": median([t["prefill_s"] for t in tlt]),
          "wall_s": steady_wall,
          "first_call_s": first["wall_s"],
          "compile_s": first["wall_s"] - steady_wall,
          "compiled_programs": first["new_programs"],
          "runs_tokens_per_s": [t["tokens_per_s"] for t in tlt],
          "runs_decode_tokens_per_s": [t["decode_tokens_per_s"] for t in tlt],
      },
      "read_gb_per_s": bandwidth,
      # Greedy, fp32 on both sides: the tokens should match.
      "agreement_row0": {f"hf_threads_{n}": agreement(tlt[-1]["tokens"][0], hf[n][-1]["tokens"][0])
                         for n in HF_THREADS},
  }
  ratio = lambda other_tps: ab.paired_ratios([t["tokens_per_s"] for t in tlt], other_tps)
  for n, runs in hf.items():
    tps = [h["tokens_per_s"] for h in runs]
    report[f"hf_threads_{n}"] = {"tokens_per_s": median(tps), "runs_tokens_per_s": tps,
                                 "wall_s": median([h["wall_s"] for h in runs]),
                                 "speedup_tlt_over_this": median(ratio(tps))}
  best = ratio([max(h["tokens_per_s"] for h in pair) for pair in zip(*hf.values())])
  report["speedup_tlt_over_hf"] = {"median": median(best), "runs": best, "goal": GOALS[b],
                                   "meets_goal": median(best) >= GOALS[b],
                                   "against": "the faster torch thread count in each repeat"}
  if tunix:
    tps = [t["tokens_per_s"] for t in tunix_runs]
    speedups = ratio(tps)
    report["tunix"] = {"tokens_per_s": median(tps), "runs_tokens_per_s": tps,
                       "wall_s": median([t["wall_s"] for t in tunix_runs]),
                       "first_call_s": tunix_first["wall_s"],
                       "agreement_row0": agreement(tlt[-1]["tokens"][0],
                                                   tunix_runs[-1]["tokens"][0])}
    report["speedup_tlt_over_tunix"] = {"median": median(speedups), "runs": speedups,
                                        "goal": TUNIX_GOALS.get(b),
                                        "meets_goal": (median(speedups) >= TUNIX_GOALS[b]
                                                       if b in TUNIX_GOALS else None)}
  return report


def roofline(batch: dict, weight_bytes: int) -> dict:
  """Batch-1 tokens/s against bandwidth / weight bytes, paired with each repeat's probe."""
  limits = [gbs * 1e9 / weight_bytes for gbs in batch["read_gb_per_s"]]
  frac = lambda runs: ab.paired_median(runs, limits)
  return {"tokens_per_s": median(limits), "runs_tokens_per_s": limits,
          "tlt_fraction": frac(batch["tlt"]["runs_tokens_per_s"]),
          "tlt_decode_fraction": frac(batch["tlt"]["runs_decode_tokens_per_s"]),
          **{f"hf_threads_{n}_fraction": frac(batch[f"hf_threads_{n}"]["runs_tokens_per_s"])
             for n in HF_THREADS}}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=3, help="alternating tlt/hf pairs")
  parser.add_argument("--output", help="also write the JSON here")
  parser.add_argument("--tunix", action=argparse.BooleanOptionalAction, default=True,
                      help="also run Tunix's sampler (its venv is installed on first use)")
  parser.add_argument("--bench_dir", default=".bench_venvs",
                      help="peer venvs and the HF copy of SmolLM2 (as benchmarks/rl_step.py)")
  args = parser.parse_args()
  host.reexec_with_huge_pages()   # as every entry point runs (all sides inherit it)
  if args.output:
    try:
      cli.check_output_file(args.output, "--output")
    except UserInputError as e:
      parser.error(str(e))
  load_before = os.getloadavg()

  probe = BandwidthProbe()
  path = smollm2_gguf_path()
  start = time.perf_counter()
  tlt_model = load_model("smollm2", dtype=jnp.float32)
  tlt_params = rollout_layout(tlt_model.params)   # the rollout's layout, made once
  log(f"tlt_jax load {time.perf_counter() - start:.1f}s")
  start = time.perf_counter()
  hf_model = load_hf(path)
  log(f"transformers load {time.perf_counter() - start:.1f}s")

  config = tlt_model.config
  rng = np.random.default_rng(0)
  prompts = {b: rng.integers(0, config.vocab_size, (b, PROMPT_TOKENS)).tolist()
             for b in BATCH_SIZES}
  tunix = TunixSide(args.bench_dir, prompts) if args.tunix else None
  batches = {b: bench_batch(tlt_model, tlt_params, hf_model, tunix, prompts[b], args.repeats,
                            probe) for b in BATCH_SIZES}
  if tunix:
    tunix.close()

  cache_len = BucketSpec().cache_length(PROMPT_TOKENS + NEW_TOKENS)  # what generate allocates
  read = bytes_per_step(tlt_params, config, cache_len)
  result = {
      "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to fp32)",
      "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS, "repeats": args.repeats,
      "greedy": True, "eos": "disabled: every row generates new_tokens",
      "versions": {"jax": jax.__version__, "torch": torch.__version__,
                   "transformers": transformers.__version__,
                   "tunix": PEER_PACKAGES["tunix"][0] if args.tunix else None},
      "cpus": os.cpu_count(), "hf_torch_threads": list(HF_THREADS),
      "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
      "cpu_kernels": os.environ.get(cpu_kernels.ENV, "auto"),
      "loadavg_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
      "bandwidth": probe.report(),
      "batches": {str(b): r for b, r in batches.items()},
      "roofline_batch1": {"weight_bytes_per_step": read["weights"],
                          "kv_cache_bytes_per_step": read["kv_cache"],
                          **roofline(batches[1], read["weights"])},
  }
  emit(result, args.output)


if __name__ == "__main__":
  main()

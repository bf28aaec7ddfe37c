"""One RL step side by side: tlt_jax vs TRL's GRPOTrainer vs Tunix's GRPO learner.

  python benchmarks/rl_step.py [--steps=4] [--repeats=3] [--sides=project,trl,tunix]
      [--output_json=FILE]

Same workload on every side (DESIGN 4c): reasoning-gym basic_arithmetic (2 terms of 1-2
digits, seed 42), --prompts x --group responses per step, prompts <= 128 tokens, up to
--max_new_tokens new tokens at T=1, KL 0.04 to a reference model, one AdamW update (lr 1e-6,
weight decay 0.01, grad clip 1) per step over all responses, accumulated over micro-batches
of ~8 responses, full fine-tune of SmolLM2-135M-Instruct in fp32. Every side sees the same
prompts in the same order: the project's own prompt stream, written to a file the peers read.

Each side is its own process (the project: `python -m experiments.run`; the peers: drivers in
benchmarks/peers/, each in its own venv under --bench_dir, installed on first use), so the
sides alternate at the granularity of whole runs: A B C A B C ..., --repeats rounds of
--steps steps each. The first --warmup_steps (1) of every run (compilation, warm-up) are
dropped; the report has medians of the per-step phase times (rollout / reference / train /
total) over the rest, peak RSS, paired per-round ratios of the project against the faster
peer (the project runs with --precompile: its rollout programs compile before step 1, set-up
time as the peers' model loads are), the CPU's jitted fp32 matmul throughput at
training-like shapes (measured here, before and after the runs) and the project's
train-phase FLOP rate (6 x params x trained tokens per second; the reference forward,
2 x params x tokens, beside it), so "train phase at >= 70% of the matmul throughput" can be
read off. One JSON object on stdout (and in --output_json).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks import ab  # noqa: E402
from benchmarks.matmul_rate import matmul_throughput  # noqa: E402
from benchmarks.peer_envs import ensure_hf_model, ensure_venv  # noqa: E402
from benchmarks.report import emit  # noqa: E402
from absl import flags  # noqa: E402
from experiments import cli  # noqa: E402
from tlt_jax.errors import UserInputError  # noqa: E402
from tlt_jax.runtime import host  # noqa: E402

SIDES = ("project", "project_sd", "trl", "tunix")
PEERS = ("trl", "tunix")
PROJECT_SIDES = ("project", "project_sd")
PEER_DRIVERS = {"trl": "benchmarks/peers/trl_grpo.py", "tunix": "benchmarks/peers/tunix_grpo.py"}
STEP_PREFIX = "BENCH_STEP "   # the drivers' per-step JSON lines
PHASES = ("rollout_s", "reference_s", "reward_s", "train_s", "step_s")
# At T=1 each side samples its own responses, so a side that happened to draw longer ones
# does more work: phase times are also compared per token of the work they scale with.
PER_TOKEN = {"rollout_s": "response_tokens", "reference_s": "train_tokens",
             "train_s": "train_tokens", "step_s": "train_tokens"}

_STEPS = flags.DEFINE_integer("steps", 4, "RL steps per run, --warmup_steps of them untimed.",
                              lower_bound=2)
_WARMUP = flags.DEFINE_integer("warmup_steps", 1, "Untimed steps at the start of every run "
                               "(compilation, caches).", lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 3, "Rounds of alternated runs (one run per side "
                                "per round).", lower_bound=1)
_SIDES = flags.DEFINE_list("sides", ["project", "trl", "tunix"],
                           f"Sides to run, in round order: {', '.join(SIDES)}.")
_PROMPTS = flags.DEFINE_integer("prompts", 8, "Prompts per step.", lower_bound=1)
_GROUP = flags.DEFINE_integer("group", 4, "Responses per prompt.", lower_bound=2)
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Response length cap.", lower_bound=1)
_MAX_PROMPT = flags.DEFINE_integer("max_prompt_len", 128, "Longer prompts are dropped.")
_MICRO = flags.DEFINE_integer("micro_batch_responses", 8, "Peers: responses per micro-batch "
                              "(TRL per_device_train_batch_size; Tunix train and log-prob "
                              "micro-batches are this / --group prompts).", lower_bound=1)
_PROJECT_MICRO_ROWS = flags.DEFINE_integer(
    "project_micro_rows", 2, "Project --micro_batch_rows: 2 rows of --project_train_seq_len "
    "512 hold ~7 of these ~50-token prompts with their responses, about the peers' 8 "
    "responses per micro-batch.", lower_bound=1)
_PROJECT_SEQ_LEN = flags.DEFINE_integer(
    "project_train_seq_len", 512, "Project --train_seq_len. The CPU self-attention kernel's "
    "cost follows each sample's length, not the row's, so longer rows only cut padding: "
    "2 x 512 ran the train phase 1.09x faster than 4 x 256 (the packing of 128 + 128) in a "
    "paired A/B, at the same slots per micro-batch.", lower_bound=128)
_TRL_CHECKPOINTING = flags.DEFINE_bool(
    "trl_gradient_checkpointing", False, "TRL with activation recomputation (its GRPOConfig "
    "default); off by default, like the project's --remat, so both train phases do the "
    "same FLOPs.")
_TUNIX_PAD = flags.DEFINE_integer("tunix_prompt_pad", 64, "Tunix max_prompt_length: every "
                                  "prompt is left-padded to it (these prompts are ~50 tokens).",
                                  lower_bound=1)
_TASKS = flags.DEFINE_string("tasks", "basic_arithmetic:min_terms=2,max_terms=2,min_digits=1,"
                             "max_digits=2", "reasoning-gym task spec (experiments.run --tasks).")
_SEED = flags.DEFINE_integer("seed", 42, "Data seed (task generation and prompt order) and "
                             "every side's sampling seed; the same in every round.")
_NUM_TRAIN = flags.DEFINE_integer("num_train", 256, "Prompt pool the stream draws from.")
_KL = flags.DEFINE_float("kl_coef", 0.04, "KL-to-reference coefficient.")
_LR = flags.DEFINE_float("lr", 1e-6, "AdamW learning rate.")
_OUTPUT = flags.DEFINE_string("output_json", None, "Also write the JSON here.")
_BENCH_DIR = flags.DEFINE_string("bench_dir", ".bench_venvs", "Peer venvs, the HF copy of "
                                 "SmolLM2, the prompt file, run dirs and logs.")
_RUN_TIMEOUT = flags.DEFINE_integer("run_timeout_s", 7200, "Kill a side's run after this.")
_DRAFTER = flags.DEFINE_string("drafter", "assets/drafter_smollm2", "project_sd's drafter.")
_SD_FLAGS = flags.DEFINE_list("sd_flags", ["--strategy=4_1_5", "--sd_threshold=16",
                                           "--sd_patience=4"], "project_sd's SD flags.")
_PEER_HUGE_PAGES = flags.DEFINE_bool(
    "peer_huge_pages", False, "Run the peers with huge-page malloc too (the project's entry "
    "points turn it on for themselves: tlt_jax/runtime/host.py); off: as they ship.")
_MATMUL_REPS = flags.DEFINE_integer("matmul_reps", 5, "Timed calls per matmul shape.",
                                    lower_bound=1)


def log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


# ---- one-time preparation ---------------------------------------------------------------

def write_prompts(bench_dir: str, total_steps: int) -> tuple[str, int, str]:
  """The prompts the project's run draws, batch by batch (its own data builder and stream,
  same flags), as JSONL for the peers; returns (path, prompt tokens max, sha1)."""
  from tlt_jax.data.rl_data import PromptStream, build_rl_data
  from tlt_jax.models.bundled import smollm2_gguf_path
  from tlt_jax.models.tokenizer import Tokenizer
  tokenizer = Tokenizer.from_gguf(smollm2_gguf_path())
  data = build_rl_data(tokenizer=tokenizer, max_prompt_len=_MAX_PROMPT.value, seed=_SEED.value,
                       tasks=_TASKS.value, num_train=_NUM_TRAIN.value, num_val=0)
  stream = PromptStream(data.train, _PROMPTS.value, _SEED.value)
  path = os.path.join(bench_dir, "prompts.jsonl")
  longest = 0
  with open(path + ".tmp", "w") as f:
    for _ in range(total_steps):
      for item in stream.next_batch():
        record = item.record
        longest = max(longest, len(item.prompt_ids))
        f.write(json.dumps({"messages": record.messages(),
                            "text": tokenizer.render_chat(record.messages()),
                            "prompt_ids": list(item.prompt_ids),
                            "ground_truth": record.ground_truth,
                            "data_source": record.data_source,
                            "extra_info": record.extra_info}) + "\n")
  os.replace(path + ".tmp", path)
  with open(path, "rb") as f:
    digest = hashlib.sha1(f.read()).hexdigest()
  return path, longest, digest


# ---- running one side -------------------------------------------------------------------

def project_command(side: str, run_dir: str) -> list[str]:
  cmd = [sys.executable, "-m", "experiments.run", f"--tasks={_TASKS.value}",
         f"--seed={_SEED.value}", f"--num_train={_NUM_TRAIN.value}", "--num_val=0",
         f"--prompts_per_step={_PROMPTS.value}", f"--group_size={_GROUP.value}",
         f"--max_prompt_len={_MAX_PROMPT.value}", f"--max_new_tokens={_MAX_NEW.value}",
         "--temperature=1", f"--kl_coef={_KL.value}", f"--lr={_LR.value}", "--adam_b2=0.999",
         f"--micro_batch_rows={_PROJECT_MICRO_ROWS.value}",
         f"--train_seq_len={_PROJECT_SEQ_LEN.value}", f"--steps={_STEPS.value}",
         "--eval_every=0", "--reward=reasoning_gym", f"--run_dir={run_dir}", "--precompile",
         f"--checkpoint_every={_STEPS.value}", "--keep_checkpoints=1",
         f"--export_hf={os.path.join(run_dir, 'hf_export')}"]
  if side == "project_sd":
    cmd += [f"--drafter={_DRAFTER.value}", *_SD_FLAGS.value]
  return cmd


def micro_responses() -> int:
  """The peers' micro-batch, at most one step's responses (tiny test runs)."""
  return min(_MICRO.value, _PROMPTS.value * _GROUP.value)


def peer_command(side: str, python: str, hf_dir: str, prompts: str, work_dir: str) -> list[str]:
  cmd = [python, os.path.join(REPO, PEER_DRIVERS[side]), f"--model_dir={hf_dir}",
         f"--prompts={prompts}", f"--steps={_STEPS.value}", f"--prompts_per_step={_PROMPTS.value}",
         f"--group={_GROUP.value}", f"--max_new_tokens={_MAX_NEW.value}",
         f"--micro_batch_responses={micro_responses()}", f"--kl_coef={_KL.value}",
         f"--lr={_LR.value}", f"--seed={_SEED.value}", f"--work_dir={work_dir}"]
  if side == "tunix":
    cmd.append(f"--prompt_pad={_TUNIX_PAD.value}")
  if side == "trl" and _TRL_CHECKPOINTING.value:
    cmd.append("--gradient_checkpointing")
  return cmd


def project_records(run_dir: str, seq_len: int) -> list[dict]:
  """metrics.jsonl rows in the drivers' schema; padded tokens are the packed slots the
  micro-batches ran (row counts as batching.row_counts pads them)."""
  from tlt_jax.rl.batching import row_counts
  records = []
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    for line in f:
      m = json.loads(line)
      if m.get("step", 0) < 1:
        continue
      rows = int(m.get("train/rows", 0))
      records.append({
          "step": m["step"], "rollout_s": m["timing/rollout_s"],
          "reference_s": m["timing/reference_s"], "reward_s": m["timing/reward_s"],
          "train_s": m["timing/train_s"], "step_s": m["timing/step_s"],
          "peak_rss_gib": m["mem/peak_rss_gib"], "train_tokens": m["perf/train_tokens"],
          "padded_train_tokens": sum(row_counts(rows, _PROJECT_MICRO_ROWS.value)) * seq_len,
          "response_tokens": m["response_len/mean"] * _PROMPTS.value * _GROUP.value,
          "reward_mean": m["reward/mean"], "new_programs": m.get("compile/new_programs"),
          **({"sd_accept_len": m["spec/accept_len"]} if "spec/accept_len" in m else {})})
  return records


def run_side(side: str, round_index: int, ctx: dict) -> list[dict]:
  """One run of `side` (a fresh process); its per-step records, step 1 included."""
  work_dir = os.path.join(ctx["bench_dir"], "runs", f"{side}_r{round_index}")
  shutil.rmtree(work_dir, ignore_errors=True)
  os.makedirs(work_dir)
  env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
             TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", JAX_PLATFORMS="cpu",
             PYTHONUNBUFFERED="1")
  if side in PROJECT_SIDES:
    cmd = project_command(side, work_dir)
  else:
    if not _PEER_HUGE_PAGES.value:
      env["GLIBC_TUNABLES"] = host.tunables_without_huge_pages(
          env.get("GLIBC_TUNABLES", ""))
    cmd = peer_command(side, ctx["python"][side], ctx["hf_dir"], ctx["prompts"], work_dir)
  ctx["commands"].setdefault(side, " ".join(cmd))
  log_path = os.path.join(ctx["bench_dir"], "logs", f"{side}_r{round_index}.log")
  log(f"round {round_index + 1}: {side} ({_STEPS.value} steps) -> {log_path}")
  start = time.perf_counter()
  with open(log_path, "w") as log_file:
    try:
      proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log_file,
                            text=True, timeout=_RUN_TIMEOUT.value)
    except subprocess.TimeoutExpired:
      raise UserInputError(f"{side}: run over --run_timeout_s={_RUN_TIMEOUT.value}; see "
                           f"{log_path}") from None
  if proc.returncode != 0:
    with open(log_path) as f:
      tail = f.read()[-3000:]
    raise UserInputError(f"{side}: exit code {proc.returncode}; {log_path} ends:\n{tail}")
  if side in PROJECT_SIDES:
    records = project_records(work_dir, ctx["seq_len"])
  else:
    records = [json.loads(line[len(STEP_PREFIX):]) for line in proc.stdout.splitlines()
               if line.startswith(STEP_PREFIX)]
  if len(records) != _STEPS.value:
    raise UserInputError(f"{side}: {len(records)} step records, expected {_STEPS.value}; see "
                         f"{log_path}")
  shutil.rmtree(work_dir, ignore_errors=True)  # checkpoints: GBs per project run
  log(f"  {side}: {time.perf_counter() - start:.0f} s, timed steps: "
      + ", ".join(f"{r['step_s']:.1f}s" for r in records[_WARMUP.value:]))
  return records


# ---- summary ------------------------------------------------------------------------------

def median_of(records: list[dict], key: str) -> float | None:
  values = [r[key] for r in records if r.get(key) is not None]
  return statistics.median(values) if values else None


def side_summary(rounds: list[list[dict]], num_params: int, matmul_gflops: float) -> dict:
  """Medians over the timed steps; FLOP rates count 6 x params per trained (unpadded prompt
  + response) token for the train phase, 2 x params for the reference forward, and
  `train_gflops_padded` the tokens as padded into the micro-batches."""
  warmup = _WARMUP.value
  timed = [r for run in rounds for r in run[warmup:]]
  medians = {k: median_of(timed, k) for k in PHASES}
  tokens = {k: median_of(timed, k) for k in ("train_tokens", "padded_train_tokens",
                                             "response_tokens", "reward_mean", "sd_accept_len")}

  def rate(step_keys, flops_per_token, token_key):
    values = [flops_per_token * num_params * r[token_key] / sum(r[k] for k in step_keys) / 1e9
              for r in timed if r.get(token_key)]
    return statistics.median(values) if values else None

  flop_rates = {
      "train_gflops": rate(["train_s"], 6, "train_tokens"),
      "reference_gflops": rate(["reference_s"], 2, "train_tokens"),
      "train_plus_reference_gflops": rate(["train_s", "reference_s"], 8, "train_tokens"),
      "train_gflops_padded": rate(["train_s"], 6, "padded_train_tokens"),
  }
  for key in ("train", "reference", "train_plus_reference"):
    gflops = flop_rates[f"{key}_gflops"]
    flop_rates[f"{key}_frac_of_matmul"] = gflops / matmul_gflops if gflops else None
  return {"median": medians, "median_tokens": {k: v for k, v in tokens.items() if v is not None},
          "per_round_median": [{k: median_of(run[warmup:], k) for k in PHASES}
                               for run in rounds],
          "per_round_median_per_token": [per_token_medians(run[warmup:]) for run in rounds],
          "peak_rss_gib": max(r["peak_rss_gib"] for run in rounds for r in run),
          **flop_rates, "timed_steps": len(timed),
          # Project only: timed steps that compiled new programs (their times include it).
          "timed_steps_compiling": sum(1 for r in timed if r.get("new_programs")),
          "steps": rounds}


def per_token_medians(records: list[dict]) -> dict:
  """Median seconds per token (`PER_TOKEN`) of each phase over `records`."""
  out = {}
  for key, tokens in PER_TOKEN.items():
    values = [r[key] / r[tokens] for r in records if r.get(key) and r.get(tokens)]
    out[key] = statistics.median(values) if values else None
  return out


def paired(project_rounds: dict, peer_rounds: dict) -> dict:
  """Per round: peer median / project median (> 1: the project is faster), and their median."""
  out = {}
  for key in ("rollout_s", "reference_s", "train_s", "step_s"):
    both = [(peer[key], mine[key]) for mine, peer in zip(project_rounds, peer_rounds)
            if mine.get(key) and peer.get(key)]
    ratios = ab.paired_ratios([p for p, _ in both], [m for _, m in both])
    out[key] = {"per_round": ratios, "median": statistics.median(ratios) if ratios else None}
  return out


def main(argv):
  del argv
  if _OUTPUT.value:
    cli.check_output_file(_OUTPUT.value, "--output_json")
  sides = list(dict.fromkeys(_SIDES.value))
  unknown = [s for s in sides if s not in SIDES]
  if unknown or not sides:
    raise UserInputError(f"--sides: unknown {unknown} (choose from {', '.join(SIDES)})")
  if "project_sd" in sides and not os.path.isdir(os.path.join(REPO, _DRAFTER.value)):
    raise UserInputError(f"--drafter={_DRAFTER.value}: no such directory")
  if _STEPS.value <= _WARMUP.value:
    raise UserInputError(f"--steps={_STEPS.value}: must exceed --warmup_steps={_WARMUP.value}")
  if _PROJECT_SEQ_LEN.value < _MAX_PROMPT.value + _MAX_NEW.value:
    raise UserInputError(f"--project_train_seq_len={_PROJECT_SEQ_LEN.value}: shorter than "
                         f"--max_prompt_len + --max_new_tokens")
  if (_PROMPTS.value * _GROUP.value) % micro_responses() or micro_responses() % _GROUP.value:
    raise UserInputError(f"--micro_batch_responses={_MICRO.value}: must be a multiple of "
                         f"--group and divide --prompts x --group (or exceed it)")
  from tlt_jax.models.config import ModelConfig

  bench_dir = os.path.abspath(_BENCH_DIR.value)
  for sub in ("runs", "logs"):
    os.makedirs(os.path.join(bench_dir, sub), exist_ok=True)
  python = {peer: ensure_venv(bench_dir, peer) for peer in PEERS if peer in sides}
  hf_dir = ensure_hf_model(bench_dir)
  config = ModelConfig.from_hf_dir(hf_dir)
  prompts, longest_prompt, prompts_sha1 = write_prompts(bench_dir, _STEPS.value)
  if "tunix" in sides and longest_prompt > _TUNIX_PAD.value:
    log(f"note: the longest prompt has {longest_prompt} tokens, over --tunix_prompt_pad="
        f"{_TUNIX_PAD.value}: Tunix pads to the next power of two instead")
  seq_len = _PROJECT_SEQ_LEN.value
  ctx = {"bench_dir": bench_dir, "python": python, "hf_dir": hf_dir, "prompts": prompts,
         "seq_len": seq_len, "commands": {}}

  log("matmul throughput (start)")
  matmul_start = matmul_throughput(config, _PROJECT_MICRO_ROWS.value * seq_len,
                                   _MATMUL_REPS.value)
  # A B C A B C ...: each run is a fresh process with warm-up steps of its own.
  alternated = ab.alternate({side: functools.partial(run_side, side, ctx=ctx)
                             for side in sides}, _REPEATS.value, warmup=0)
  rounds = {side: ab.side(alternated, side) for side in sides}
  log("matmul throughput (end)")
  matmul_end = matmul_throughput(config, _PROJECT_MICRO_ROWS.value * seq_len,
                                   _MATMUL_REPS.value)
  matmul_gflops = max(matmul_start["gflops"], matmul_end["gflops"])

  summaries = {side: side_summary(rounds[side], config.num_params, matmul_gflops)
               for side in sides}
  for side in sides:
    summaries[side]["command"] = ctx["commands"][side]
  peers = [s for s in sides if s in PEERS]
  faster_peer = min(peers, key=lambda s: summaries[s]["median"]["step_s"]) if peers else None
  comparisons = {}
  for mine in (s for s in sides if s in PROJECT_SIDES):
    for peer in peers:
      comparisons[f"{peer}_over_{mine}"] = paired(summaries[mine]["per_round_median"],
                                                  summaries[peer]["per_round_median"])
      comparisons[f"{peer}_over_{mine}_per_token"] = paired(
          summaries[mine]["per_round_median_per_token"],
          summaries[peer]["per_round_median_per_token"])
  report = {
      "workload": {"model": f"SmolLM2-135M-Instruct (fp32, {config.num_params / 1e6:.1f}M "
                            "params, full fine-tune)",
                   "tasks": _TASKS.value, "seed": _SEED.value, "prompts": _PROMPTS.value,
                   "group": _GROUP.value, "max_prompt_len": _MAX_PROMPT.value,
                   "max_new_tokens": _MAX_NEW.value, "temperature": 1.0, "kl_coef": _KL.value,
                   "lr": _LR.value, "peer_micro_batch_responses": micro_responses(),
                   "trl_gradient_checkpointing": _TRL_CHECKPOINTING.value,
                   "malloc": "project: glibc.malloc.hugetlb=1 (its entry points set it); "
                             "peers: " + ("the same" if _PEER_HUGE_PAGES.value else
                                          "glibc's default"),
                   "project_micro_batch_rows": _PROJECT_MICRO_ROWS.value,
                   "project_train_seq_len": seq_len, "tunix_prompt_pad": _TUNIX_PAD.value,
                   "longest_prompt_tokens": longest_prompt,
                   "prompts_sha1": prompts_sha1},
      "protocol": {"steps_per_run": _STEPS.value, "rounds": _REPEATS.value,
                   "order": sides,
                   "timed": f"steps {_WARMUP.value + 1}..{_STEPS.value} of every run",
                   "ratios": "peer time / project time per round (> 1: project faster); "
                             "_per_token: the same over seconds per token (rollout per "
                             "response token, the rest per trained token)",
                   "note": "same prompts and seeds every round; each side samples its own "
                           "tokens, so response lengths differ (see median_tokens)"},
      "cpu": {"matmul_gflops": matmul_gflops, "matmul_start": matmul_start,
              "matmul_end": matmul_end, "cpu_count": os.cpu_count(),
              **{f"{side}_train_frac_of_matmul": summaries[side]["train_frac_of_matmul"]
                 for side in sides if side in PROJECT_SIDES}},
      "faster_peer": faster_peer,
      "vs_faster_peer": {mine: comparisons[f"{faster_peer}_over_{mine}"]
                         for mine in sides if mine in PROJECT_SIDES and faster_peer},
      "vs_faster_peer_per_token": {
          mine: comparisons[f"{faster_peer}_over_{mine}_per_token"]
          for mine in sides if mine in PROJECT_SIDES and faster_peer},
      "paired": comparisons,
      "sides": summaries,
  }
  emit(report, _OUTPUT.value)


if __name__ == "__main__":
  cli.run(main)

"""How many tokens per verify step any model-free drafter could accept at T > 0: an upper
bound from the target's own probabilities, for issue 17's accept-length goal.

  python benchmarks/model_free_ceiling.py [--temperature=1] [--output=FILE]

Samples G (--group_size) responses to each held-out reasoning-gym math prompt by plain
sampling (as benchmarks/model_free.py's batch-1 rollouts: sample i drafts from its prompt,
its own text and samples 0..i-1, finished before it). A model-free drafter proposes, at
each tree level, tokens that followed an occurrence of the row's last token somewhere in
that text (any suffix match ends there), at most `nodes` of them. At position t the
chance that level's draft is accepted is at most m_t: the target's probability of the
`nodes` likeliest such tokens, an oracle choice no drafter can beat. Emitted tokens follow
plain sampling whatever the drafts, so walking the sampled responses with level j
accepted with probability m_{t+j}, up to --depth levels, draws from a process that
accepts at least as much as any such drafter; its tokens per step bound the accept length.
Prints JSON: the bound per tree size, the mean of m_t, and the fraction of positions
whose last token occurs earlier at all.
"""
from __future__ import annotations

import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from benchmarks.report import emit  # noqa: E402
from experiments import cli  # noqa: E402
from tlt_jax.errors import UserInputError  # noqa: E402

_PROMPTS = flags.DEFINE_integer("prompts", 2, "Held-out prompts.", lower_bound=1)
_GROUP = flags.DEFINE_integer("group_size", 8, "Samples per prompt (G).", lower_bound=2)
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature (> 0).")
_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 128, "Tokens per response.",
                                   lower_bound=1)
_DEPTH = flags.DEFINE_integer("depth", 4, "Tree levels a verify step may accept.",
                              lower_bound=1)
_NODES = flags.DEFINE_list("nodes", ["1", "4", "15"], "Tree sizes (drafts per level, at most).")
_WALKS = flags.DEFINE_integer("walks", 200, "Simulated walks per response.", lower_bound=1)
_OUTPUT = flags.DEFINE_string("output", None, "Also write the JSON here.")
_SEED = flags.DEFINE_integer("seed", 12345, "Prompt seed (as model_free.py's).")

_TASKS = ["gsm_symbolic", "basic_arithmetic", "chain_sum"]


def successor_mass(probs, text, start: int, earlier: list[list[int]], nodes: int):
  """m_t for each position t >= start of `text` (prompt + response): the mass `probs[t]`
  puts on its `nodes` likeliest tokens among those that followed text[t - 1] in the
  earlier texts or in text[:t]. Also whether any did."""
  import numpy as np
  followers = collections.defaultdict(set)
  for other in earlier:
    for a, b in zip(other, other[1:]):
      followers[a].add(b)
  for a, b in zip(text[:start], text[1:start]):
    followers[a].add(b)
  mass, seen = [], []
  for t in range(start, len(text)):
    candidates = np.fromiter(followers[text[t - 1]], np.int64)
    top = np.sort(probs[t - start][candidates])[::-1][:nodes]
    mass.append(float(top.sum()))
    seen.append(len(candidates) > 0)
    followers[text[t - 1]].add(text[t])
  return np.array(mass), np.array(seen)


def bounded_accept(mass, depth: int, walks: int, rng) -> float:
  """Tokens per verify step of walks along one response, level j accepted w.p. m_{t+j}."""
  steps = 0
  for _ in range(walks):
    t = 0
    while t < len(mass):
      accepted = 0
      while accepted < depth and t + accepted < len(mass) - 1 and (
          rng.random() < mass[t + accepted]):
        accepted += 1
      t += accepted + 1
      steps += 1
  return walks * len(mass) / steps


def main(argv):
  del argv
  if _TEMPERATURE.value <= 0:
    raise UserInputError(f"--temperature={_TEMPERATURE.value}: must be > 0 (greedy "
                             "needs no bound: its drafts are checked against one token)")
  nodes = [int(n) for n in _NODES.value]
  if _OUTPUT.value:
    cli.check_output_file(_OUTPUT.value, "--output")
  import jax
  import jax.numpy as jnp
  import numpy as np

  from tlt_jax.data.tasks import build_questions
  from tlt_jax.models import transformer
  from tlt_jax.models.loading import load_model
  from tlt_jax.rollout.engine import generate
  from tlt_jax.rollout.sampling import SamplingParams

  model = load_model("smollm2", dtype=jnp.float32)
  params, config = model.params, model.config
  eos = tuple(model.tokenizer.eos_token_ids)
  prompts = [model.tokenizer.chat_prompt(q)
             for _, q in build_questions(_TASKS, _PROMPTS.value, _SEED.value)]
  sampling = SamplingParams(temperature=_TEMPERATURE.value)
  score = jax.jit(lambda p, tokens, positions: jax.nn.softmax(transformer.lm_logits(
      p, config, transformer.forward_packed(p, config, tokens, positions,
                                            jnp.zeros_like(tokens))) / _TEMPERATURE.value))
  rng = np.random.default_rng(0)
  masses = {n: [] for n in nodes}
  seen_all, bounds = [], {n: [] for n in nodes}
  for k, prompt in enumerate(prompts):
    print(f"prompt {k + 1}/{len(prompts)}: sampling {_GROUP.value} responses",
          file=sys.stderr, flush=True)
    result = generate(params, config, [prompt] * _GROUP.value,
                      max_new_tokens=_NEW_TOKENS.value, sampling=sampling, eos_ids=eos,
                      seed=k)
    texts = [list(prompt) + o.token_ids for o in result.outputs]
    for i, text in enumerate(texts):
      if len(text) == len(prompt):
        continue
      # Padded to one length per prompt (one program): causal, so the pad changes nothing.
      padded = text + [0] * (len(prompt) + _NEW_TOKENS.value - len(text))
      probs = np.asarray(score(params, jnp.asarray([padded]),
                               jnp.arange(len(padded))[None]))[0]
      probs = probs[len(prompt) - 1:len(text) - 1]       # p at each response position
      for n in nodes:
        mass, seen = successor_mass(probs, text, len(prompt), texts[:i], n)
        masses[n].append(mass)
        bounds[n].append((len(mass), bounded_accept(mass, _DEPTH.value, _WALKS.value, rng)))
      seen_all.append(seen)
  per_token = lambda pairs: sum(n for n, _ in pairs) / sum(n / b for n, b in pairs)
  emit({"model": "smollm2 (fp32)", "temperature": _TEMPERATURE.value,
        "group_size": _GROUP.value, "prompts": _PROMPTS.value, "depth": _DEPTH.value,
        "positions": int(sum(len(s) for s in seen_all)),
        "last_token_seen_before_frac": float(np.mean(np.concatenate(seen_all))),
        "by_nodes": {str(n): {"level_accept_bound_mean": float(np.mean(np.concatenate(
                                  masses[n]))),
                              "accept_len_bound": per_token(bounds[n])} for n in nodes}},
       _OUTPUT.value)


if __name__ == "__main__":
  cli.run(main)

"""How many tokens per verify step any model-free drafter could accept at T > 0: an upper
bound from the target's own probabilities, for issue 17's accept-length goal.

  python benchmarks/research/model_free_ceiling.py [--temperature=1] [--output=FILE]

Samples G (--group_size) responses to each held-out reasoning-gym math prompt by plain
sampling (as benchmarks/model_free.py's batch-1 rollouts: sample i drafts from its prompt,
its own text and samples 0..i-1, finished before it). A model-free drafter proposes, at
each tree level, tokens that followed an occurrence of the row's last token somewhere in
that text (any suffix match ends there), at most `nodes` of them. At position t the chance
that level's draft is accepted is at most m_t: the target's probability of the `nodes`
likeliest such tokens, an oracle choice no drafter can beat. Emitted tokens follow plain
sampling whatever the drafts, so walking the sampled responses with level j accepted with
probability m_{t+j}, up to --depth levels, draws from a process that accepts at least as
much as any such drafter; its tokens per step bound the accept length. With --live_batch=B,
the samples are generated B at a time instead (model_free.py's batch B): sample i reads the
finished samples of the batches before its own, and the others of its batch as they stood
when the step began, their first t tokens (in a rollout, rows that accept more run a few
tokens ahead, so there it is an estimate, not a strict bound); with --engine_strategy
(B >= G), the group's responses are the engine's own model-free rollout (one live batch,
siblings in step) and its accept length is reported beside the bound on those very texts,
a paired ratio. Prints JSON: the bound per tree size, the mean of m_t, and the fraction
of positions whose last token occurs earlier at all. And how often a first draft is
accepted (the mean of p at it) for our chain and for rules that choose among the text's
continuations by counting them (`count_rule_drafts`, one sample at a time): how much a
better model-free choice could add, next to the oracle's m_t, which needs the target's p.

With --drafter, also the most a hybrid (tlt_jax/rollout/hybrid.py: per row and verify
step, the learned chain or the model-free chain) could gain over the learned drafter
alone, for issue 17's hybrid speed goal. Along the same responses, a learned chain's level
j at position t is accepted with probability a_j(t) = sum_v min(p, q_j): q_j from the
drafter unrolled along the sampled text (as its training-time test does), p from the
target. Three model-free chains: the oracle one, level j accepted with m_{t+j} as above
(one node a level); and ours, tlt_jax/rollout/ngram.py's chain proposed at each position
of the same text, whose point-mass level is accepted exactly when the sampled token equals
its draft (the coupling that makes the emitted text plain sampling's), and ours in
expectation (`ngram_chain_expected`): level j accepted with p(d_j | text[:t],
d_1..d_{j-1}), from a verify pass of the chain (`chain_level_probs`), what a pick could at
most know before the step. A model-free step costs one verify pass, a learned one 1 + d
(d, the drafter's time: benchmarks/model_free.py's `draft_cost_measured` at each batch
size). Per row, dynamic programming from the response's end gives the least expected time
to emit it for learned alone, model-free alone, and an oracle choosing the kind at every
step start; the oracle's tokens per unit time over learned's bounds what any per-row pick
can reach at that cost ratio (with our chain's 0/1, it even sees whether this step's draws
match the draft: a looser bound; in expectation, it knows p but not the draws: the most a
pick that reads no draw can reach, an estimate since each kind's steps walk on along the
sampled text, not the drafts they accepted). And, with our chain, the best rule that picks
the kind by the length of the match the chain follows (every rule tried): what a pick can
reach from what ours sees before a step.
"""
from __future__ import annotations

import collections
import functools
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from absl import flags  # noqa: E402

from benchmarks import questions  # noqa: E402
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
_EPOCH = flags.DEFINE_bool("epoch", False, "Model-free drafts also read an earlier epoch: "
                           "G more responses to each prompt, at another seed.")
_LIVE_BATCH = flags.DEFINE_integer(
    "live_batch", 1, "The samples of a group are generated this many at a time (as "
    "model_free.py's --batches; it must divide --group_size or be a multiple of it): sample "
    "i reads the finished samples of the batches before its own and the others of its batch "
    "as they are written. 1: one at a time (sample i reads samples 0..i-1); >= "
    "--group_size: the whole group in one live batch.", lower_bound=1)
_ENGINE = flags.DEFINE_string(
    "engine_strategy", None, "With --live_batch >= --group_size: each group's responses come "
    "from the engine's own model-free rollout at this strategy (e.g. 4_16_65; lossless, so "
    "they are plain samples too), whose accept length is reported beside the bound on those "
    "very texts.")
_DRAFTER = flags.DEFINE_string("drafter", None, "Also bound the hybrid's gain over this "
                               "learned drafter (e.g. assets/drafter_smollm2).")
_MAX_NGRAM = flags.DEFINE_integer("max_ngram", 4, "Our chain's longest suffix matched "
                                  "(as benchmarks/model_free.py's).", lower_bound=1)
_DRAFT_COSTS = flags.DEFINE_list("draft_costs", ["0.2"], "The learned drafter's time per "
                                 "verify step, in verify steps (d): one bound each (measure "
                                 "d at each live batch size; 0 bounds a batch whose drafter "
                                 "runs anyway, where a row's pick changes only its accepts).")


def arrangement(texts: list[list[int]], i: int, live_batch: int
                ) -> tuple[list[list[int]], list[list[int]]]:
  """What sample i of a group generated `live_batch` samples at a time reads besides its own
  text: the finished samples of the batches before its own, and the others of its batch
  (read as they are written)."""
  first = i - i % live_batch
  return texts[:first], [t for j, t in enumerate(texts[first:first + live_batch], first)
                         if j != i]


def successor_mass(probs, text, start: int, earlier: list[list[int]], nodes: int, depth: int,
                   in_step: list[list[int]] = ()):
  """[n, depth]: for each step start t >= start of `text` (prompt + response) and level j,
  the mass `probs[t + j]` puts on its `nodes` likeliest tokens among those that followed
  text[t + j - 1] in the earlier texts, in text[:t + j] (the step's own path included) or
  in each of the `in_step` texts' first t tokens (siblings generated beside it, as they
  stood when the step began); 0 past the text's end. Also [n] whether level 0 had any."""
  import numpy as np
  followers = collections.defaultdict(set)   # of text[:t], and as the loop reaches t
  for other in earlier:
    for a, b in zip(other, other[1:]):
      followers[a].add(b)
  for a, b in zip(text[:start], text[1:start]):
    followers[a].add(b)
  mass, seen = np.zeros((len(text) - start, depth)), np.zeros(len(text) - start, bool)
  for t in range(start, len(text)):
    for other in in_step:
      if len(other) >= t:   # its pair (t - 2, t - 1) has just been written
        followers[other[t - 2]].add(other[t - 1])
    for j in range(min(depth, len(text) - t)):
      last = text[t + j - 1]
      candidates = followers[last] | {text[i] for i in range(t, t + j) if text[i - 1] == last}
      top = np.sort(probs[t + j - start][np.fromiter(candidates, np.int64)])[::-1][:nodes]
      mass[t - start, j] = top.sum()
    seen[t - start] = len(followers[text[t - 1]]) > 0
    followers[text[t - 1]].add(text[t])
  return mass, seen


_COUNT_RULES = ("longest_mode", "bigram_mode", "backoff_votes")


def count_rule_drafts(text, start: int, earlier: list[list[int]], max_ngram: int
                      ) -> dict[str, list[int]]:
  """For each position t >= start of `text`, the first draft three rules that count the
  text alone (the earlier texts and text[:t]) would propose: the token that most often
  followed the longest suffix of text[:t] seen before ("longest_mode"), the one that most
  often followed its last token ("bigram_mode"), and the one with the most votes when
  every earlier occurrence of a suffix of length l (1..max_ngram) votes 10^l for what
  followed it ("backoff_votes"). Ties go to the latest occurrence; -1: nothing seen.
  What a model-free drafter could choose from the counts it sees, next to ours (the
  latest of the longest matches) and the oracle (the target's likeliest successor)."""
  counts = collections.defaultdict(collections.Counter)   # suffix -> next token -> count
  latest = {}                                              # (suffix, next token) -> order
  order = itertools.count()

  def add(seq, j):   # seq[j] follows each suffix of seq[:j]
    for length in range(1, min(max_ngram, j) + 1):
      suffix = tuple(seq[j - length:j])
      counts[suffix][seq[j]] += 1
      latest[suffix, seq[j]] = next(order)

  for other in earlier:
    for j in range(1, len(other)):
      add(other, j)
  for j in range(1, start):
    add(text, j)
  drafts = {rule: [] for rule in _COUNT_RULES}
  for t in range(start, len(text)):
    seen = [tuple(text[t - length:t]) for length in range(1, min(max_ngram, t) + 1)]
    seen = [s for s in seen if s in counts]
    best = lambda score, suffixes: max(
        ((score(s, c), latest[s, c], c) for s in suffixes for c in counts[s]),
        default=(0, 0, -1))[2]
    by_count = lambda s, c: counts[s][c]
    drafts["longest_mode"].append(best(by_count, seen[-1:]))
    drafts["bigram_mode"].append(best(by_count, seen[:1]))
    votes = collections.Counter()
    for s in seen:
      for c, n in counts[s].items():
        votes[c] += n * 10.0 ** len(s)
    drafts["backoff_votes"].append(best(lambda s, c: votes[c], seen))
    add(text, t)
  return drafts


def chain_accepts(text, start: int, earlier: list[list[int]], max_ngram: int, depth: int,
                  in_step: list[list[int]] = ()):
  """[n, depth] 0/1: for each position t >= start of `text`, whether level j of the chain
  `ngram.propose_chain` drafts for a step starting there (from text[:t], the earlier texts
  and the `in_step` texts' first t tokens) is accepted: its draft and the ones before it
  equal the text; [n] the length of the match it follows (0: none), which the hybrid's
  pick sees before the step; and [n, depth] its drafts (-1: no match)."""
  import numpy as np

  import jax

  from tlt_jax.rollout import ngram
  config = ngram.NgramConfig(max_ngram=max_ngram)
  # One pool length for every position of a response: one compiled program, not an eager
  # dispatch of every op at every position.
  length = max(len(t) for t in [text, *earlier, *in_step])
  # The text is sampled (temperature > 0): the engine's sampling ranking.
  propose = jax.jit(lambda context: ngram.propose_chain(context, depth, config,
                                                        own_first=True))
  out = np.zeros((len(text) - start, depth))
  match_lengths = np.zeros(len(text) - start, int)
  drafted = np.full((len(text) - start, depth), -1)
  for t in range(start, len(text)):
    rows = [text[:t], *earlier, *(other[:t] for other in in_step)]
    context = ngram.build_context(rows, [0] * len(rows), np.array([0]), length)
    drafts, matched = propose(context)
    match_lengths[t - start] = int(matched[0])
    if not int(matched[0]):
      continue
    drafts = np.asarray(drafts)[0]
    drafted[t - start] = drafts
    for j in range(min(depth, len(text) - t)):
      if drafts[j] != text[t + j]:
        break
      out[t - start, j] = 1.0
  return out, match_lengths, drafted


@functools.cache
def _chain_verifier(config, temperature: float):
  """`chain_level_probs`' two jitted passes, made once per model and temperature (jax is
  imported in functions here, so that flag errors come before it loads): the text's cache,
  and the chains verified against it."""
  import jax
  import jax.numpy as jnp

  from tlt_jax.models import transformer
  from tlt_jax.models.kv_cache import init_cache

  @jax.jit
  def text_cache(params, tokens):
    length = tokens.shape[1]
    return transformer.forward(params, config, tokens, jnp.arange(length)[None],
                               init_cache(config, 1, length, params["embed"].dtype))[1]

  @jax.jit
  def verify(params, tokens, cache, starts, drafts):
    rows, depth = drafts.shape
    fed = jnp.concatenate([tokens[0, starts - 1][:, None], drafts[:, :-1]], axis=1)
    positions = starts[:, None] - 1 + jnp.arange(depth)[None, :]
    cut = cache.map(lambda buf: jnp.broadcast_to(buf, (buf.shape[0], rows) + buf.shape[2:]))
    hidden, _, _ = transformer.forward_new_kv(params, config, fed, positions,
                                              cut.replace(lengths=starts - 1))
    p = jax.nn.softmax(transformer.lm_logits(params, config, hidden) / temperature)
    return jnp.take_along_axis(p, drafts[..., None], axis=-1)[..., 0]
  return text_cache, verify


def chain_level_probs(params, config, temperature: float, tokens, starts, drafts,
                      block: int = 32):
  """[n, depth]: the chance that level j of a point-mass chain drafted for a step at
  position starts[i] of `tokens` [1, L] is accepted given the levels before it,
  p(drafts[i, j] | tokens[:starts[i]], drafts[i, :j]) (0 where drafts[i, 0] < 0: no draft).
  What the pick can know before a step, where `chain_accepts`' 0/1 is how it came out.
  One verify pass per step (the text's last token and the drafts) against the text's own
  cache cut to starts[i] - 1 slots, `block` steps a pass."""
  import numpy as np

  starts, drafts = np.asarray(starts), np.asarray(drafts)
  text_cache, verify = _chain_verifier(config, temperature)
  cache = text_cache(params, tokens)
  out = []
  for i in range(0, len(starts), block):
    at, drawn = (np.resize(x[i:i + block], (block,) + x.shape[1:]) for x in (starts, drafts))
    out.append(np.asarray(verify(params, tokens, cache, at, np.maximum(drawn, 0)))
               [:min(block, len(starts) - i)])
  probs = np.concatenate(out) if out else np.zeros(drafts.shape)
  return np.where(drafts[:, :1] >= 0, probs, 0.0)


def bounded_accept(mass, walks: int, rng) -> float:
  """Tokens per verify step of walks along one response, level j of a step at t accepted
  w.p. mass[t, j] (`successor_mass`)."""
  steps = 0
  n, depth = mass.shape
  for _ in range(walks):
    t = 0
    while t < n:
      accepted = 0
      while accepted < depth and t + accepted < n - 1 and rng.random() < mass[t, accepted]:
        accepted += 1
      t += accepted + 1
      steps += 1
  return walks * n / steps


def step_outcomes(levels):
  """P(a verify step emits exactly j + 1 tokens), j = 0..len(levels), for a chain whose
  level i is accepted with probability levels[i] given the levels before it."""
  import numpy as np
  reach = np.concatenate([[1.0], np.cumprod(levels)])       # P(at least j accepted)
  return reach - np.concatenate([reach[1:], [0.0]])


def _expected_time(learned, free, draft_cost: float, kinds=None) -> float:
  """One row's expected time to emit its n tokens (learned, free: each kind's level
  acceptance by step start, [n, depth]), by dynamic programming from its end. kinds [n]:
  the kind a step starting at t drafts with ("learned" / "ngram"); None: the better one at
  every step start (the oracle)."""
  import numpy as np
  n = len(free)
  finish = np.zeros(n + 1)                                  # expected time from t to n
  for t in range(n - 1, -1, -1):
    top = min(n - 1 - t, learned.shape[1])
    after = t + 1 + np.arange(top + 1)                      # where each outcome lands
    step = {"learned": (1.0 + draft_cost, step_outcomes(learned[t, :top])),
            "ngram": (1.0, step_outcomes(free[t, :top]))}
    finish[t] = min(cost + outcome @ finish[after] for kind, (cost, outcome) in step.items()
                    if kinds is None or kinds[t] == kind)
  return float(finish[0])


_Q_SHARES = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7)


def rates(rows, draft_cost: float, match_lengths=None, first_q=None) -> dict:
  """Tokens per unit time over `rows` (each the learned and the model-free chain's level
  acceptance probabilities by step start, [n, depth] each) of learned drafting alone,
  model-free alone, and the best per-row, per-step pick between them (a model-free step
  costs 1, a learned one 1 + draft_cost: the drafter's time charged to the rows that use
  it, less than a batch pays when one row's pick runs it for all).

  With match_lengths (each row's [n], `chain_accepts`'): also the best rule that picks by
  the match length alone (the kind for each length, the same at every step and row;
  every rule tried): what a pick can reach from what it sees before a step, where the
  oracle also knows p (and, over the chain's 0/1, how the step comes out). With first_q
  too (each row's [n]: the drafter's q at the chain's first draft over its top q, known
  before the step's draws): the best rule that drafts the chain where its match has at
  least m tokens and that share is at least s (every m, s in `_Q_SHARES`)."""
  import itertools

  import numpy as np
  tokens = sum(len(free) for _, free in rows)
  per_unit = lambda kinds_of: tokens / sum(
      _expected_time(learned, free, draft_cost, kinds_of(r))
      for r, (learned, free) in enumerate(rows))
  out = {f"{kind}_tokens_per_unit": per_unit(lambda r: None if kind == "oracle" else
                                             [kind] * len(rows[r][1]))
         for kind in ("learned", "ngram", "oracle")}
  learned = out["learned_tokens_per_unit"]
  out = {"draft_cost": draft_cost, **out, "oracle_over_learned": out["oracle_tokens_per_unit"]
         / learned}
  if match_lengths is not None:
    lengths = np.unique(np.concatenate(match_lengths))
    best = max((per_unit(lambda r: [dict(zip(lengths, rule))[m] for m in match_lengths[r]]),
                rule) for rule in itertools.product(("learned", "ngram"), repeat=len(lengths)))
    out.update({"match_rule_tokens_per_unit": best[0],
                "match_rule_over_learned": best[0] / learned,
                "match_rule_ngram_at": [int(m) for m, kind in zip(lengths, best[1])
                                        if kind == "ngram"]})
  if first_q is not None:
    best = max((per_unit(lambda r: np.where((match_lengths[r] >= m) & (first_q[r] >= share),
                                            "ngram", "learned")), m, share)
               for m in lengths[lengths > 0] for share in _Q_SHARES)
    out.update({"q_rule_over_learned": best[0] / learned,
                "q_rule": {"min_match": int(best[1]), "min_q_share": best[2]}})
  return out


def main(argv):
  del argv
  if _TEMPERATURE.value <= 0:
    raise UserInputError(f"--temperature={_TEMPERATURE.value}: must be > 0 (greedy "
                             "needs no bound: its drafts are checked against one token)")
  nodes = [int(n) for n in _NODES.value]
  draft_costs = [float(d) for d in _DRAFT_COSTS.value]
  if not all(d >= 0 for d in draft_costs):
    raise UserInputError(f"--draft_costs={','.join(_DRAFT_COSTS.value)}: must be >= 0")
  live_batch, group = _LIVE_BATCH.value, _GROUP.value
  if group % live_batch if live_batch < group else live_batch % group:
    raise UserInputError(f"--live_batch={live_batch}: must divide --group_size={group} or be "
                         "a multiple of it (as model_free.py's --batches)")
  if _ENGINE.value and live_batch < group:
    raise UserInputError(f"--engine_strategy: needs --live_batch >= --group_size={group} "
                         "(the engine generates a group in one live batch)")
  from tlt_jax.rollout.strategy import SpecStrategy
  engine_strategy = (SpecStrategy.parse(_ENGINE.value, "--engine_strategy") if _ENGINE.value
                     else None)
  if engine_strategy is not None and engine_strategy.depth > _DEPTH.value:
    raise UserInputError(f"--engine_strategy={_ENGINE.value}: deeper than --depth="
                         f"{_DEPTH.value}, the bound it is compared with")
  if _DRAFTER.value and 1 not in nodes:
    raise UserInputError("--drafter: needs 1 in --nodes (the hybrid's model-free chain)")
  if _OUTPUT.value:
    cli.check_output_file(_OUTPUT.value, "--output")
  import jax
  import jax.numpy as jnp
  import numpy as np

  from tlt_jax.drafter.trainer import load_drafter, unrolled_forward
  from tlt_jax.models import transformer
  from tlt_jax.models.drafter import draft_head, draft_logits
  from tlt_jax.models.loading import load_model
  from tlt_jax.rollout.engine import generate
  from tlt_jax.rollout.ngram import NgramConfig
  from tlt_jax.rollout.sampling import SamplingParams
  from tlt_jax.rollout.spec_config import SpecConfig

  asked = questions.load({"main": (questions.MAIN_TASKS, _PROMPTS.value, _SEED.value)})["main"]
  model = load_model("smollm2", dtype=jnp.float32)
  params, config = model.params, model.config
  eos = tuple(model.tokenizer.eos_token_ids)
  prompts = [model.tokenizer.chat_prompt(q) for q in asked]
  sampling = SamplingParams(temperature=_TEMPERATURE.value)
  engine_spec = None if engine_strategy is None else SpecConfig(
      kind="ngram", ngram_config=NgramConfig(max_ngram=_MAX_NGRAM.value),
      strategy=engine_strategy,
      threshold=_GROUP.value, patience=0)
  temperature = _TEMPERATURE.value
  depth = _DEPTH.value

  @jax.jit
  def score(params, tokens, positions):
    """The target's p at every position of a padded text [1, L], and its hidden states."""
    hidden = transformer.forward_packed(params, config, tokens, positions,
                                        jnp.zeros_like(tokens))
    return jax.nn.softmax(transformer.lm_logits(params, config, hidden) / temperature), hidden

  if _DRAFTER.value:
    drafter, vocab_ids = load_drafter(_DRAFTER.value, config)
    vocab_ids = None if vocab_ids is None else jnp.asarray(vocab_ids)
    head = draft_head(params, config, vocab_ids)
    # Each target token's column in the drafter's vocabulary (-1: not in it).
    ids = np.arange(config.vocab_size) if vocab_ids is None else np.asarray(vocab_ids)
    draft_column = np.full(config.vocab_size, -1)
    draft_column[ids] = np.arange(len(ids))

  @jax.jit
  def learned_levels(drafter, params, head, vocab_ids, probs, tokens, hidden, positions):
    """[L, depth]: at j, the chance that level m of a learned chain drafted after the
    drafter read (h_j, x_{j+1}) is accepted, sum_v min(p, q_m) over the draft of x_{j+m+1}
    (q_m from the drafter unrolled m passes along the text); and q_1 at each j [L, Vd]."""
    length = tokens.shape[1]
    following = jnp.pad(tokens[:, 1:], [(0, 0), (0, 1)])
    causal = jnp.tril(jnp.ones((1, length, length), bool))
    preds = unrolled_forward(drafter, params, config, following, hidden, positions, causal,
                             depth)
    levels, qs = [], []
    for m, pred in enumerate(preds, 1):
      q = jax.nn.softmax(draft_logits(head, pred[0]) / temperature)
      qs.append(q)
      p = jnp.pad(probs[0, m:], [(0, m), (0, 0)])
      p = p if vocab_ids is None else jnp.take(p, vocab_ids, axis=1)
      levels.append(jnp.sum(jnp.minimum(p, q), axis=-1))
    return jnp.stack(levels, axis=-1), qs[0]

  rng = np.random.default_rng(0)
  masses = {n: [] for n in nodes}
  seen_all, bounds = [], {n: [] for n in nodes}
  rows = {"oracle_chain": [], "ngram_chain": [], "ngram_chain_expected": []}
  match_lengths, first_qs = [], []
  first_accepts = {rule: [] for rule in ("ngram_chain",) + _COUNT_RULES}
  one_at_a_time = live_batch == 1
  engine = collections.Counter()       # the engine's verify steps and the tokens they emitted

  def sample(prompt, seed, spec=None, context=None):
    """G responses (prompt included) by plain sampling, or by the engine's model-free SD
    (`spec`) reading the group's text (equal prompts: one group) and `context` (one extra
    text a row)."""
    result = generate(params, config, [prompt] * _GROUP.value,
                      max_new_tokens=_NEW_TOKENS.value, sampling=sampling, eos_ids=eos,
                      seed=seed, spec=spec, draft_context=context if spec else None)
    if spec is not None:
      # (Its accept length leaves out each response's first token, which the prefill
      # draws: 1/n of the walk the bound counts.)
      engine.update({"steps": result.stats["spec/verify_steps"],
                     "tokens": result.stats["spec/accept_len"]
                     * result.stats["spec/verify_steps"]})
    return [list(prompt) + o.token_ids for o in result.outputs]

  for k, prompt in enumerate(prompts):
    print(f"prompt {k + 1}/{len(prompts)}: sampling {_GROUP.value} responses",
          file=sys.stderr, flush=True)
    epoch = sample(prompt, 1000 + k) if _EPOCH.value else []
    # The engine's rows read the epoch as the bound does: one text (prompt included) each.
    texts = sample(prompt, k, engine_spec, epoch or None)
    for i, text in enumerate(texts):
      if len(text) == len(prompt):
        continue
      # Padded to one length per prompt (one program): causal, so the pad changes nothing.
      padded = jnp.asarray([text + [0] * (len(prompt) + _NEW_TOKENS.value - len(text))])
      positions = jnp.arange(padded.shape[1])[None]
      probs, hidden = score(params, padded, positions)
      response_probs = np.asarray(probs[0, len(prompt) - 1:len(text) - 1])  # p at each token
      # Finished texts, and siblings read as they are written.
      earlier, in_step = arrangement(texts, i, live_batch)
      earlier = epoch + earlier
      for n in nodes:
        mass, seen = successor_mass(response_probs, text, len(prompt), earlier, n, depth,
                                    in_step)
        masses[n].append(mass)
        bounds[n].append((len(mass), bounded_accept(mass, _WALKS.value, rng)))
      seen_all.append(seen)
      if not one_at_a_time and not _DRAFTER.value:   # the bound alone (our chain: slow)
        continue
      accepts, matched, drafts = chain_accepts(text, len(prompt), earlier, _MAX_NGRAM.value,
                                               depth, in_step)
      first = drafts[:, 0]
      # The counting rules read finished texts alone: one sample at a time.
      drafted = {"ngram_chain": first, **(count_rule_drafts(
          text, len(prompt), earlier, _MAX_NGRAM.value) if one_at_a_time else {})}
      for rule, tokens in drafted.items():   # a first draft is accepted with p(draft)
        tokens = np.asarray(tokens)
        first_accepts[rule].append(np.where(tokens >= 0, response_probs[
            np.arange(len(tokens)), np.maximum(tokens, 0)], 0.0))
      if _DRAFTER.value:
        # A step drafting response token t starts from the drafter reading h and x at text
        # positions P + t - 2 and P + t - 1; its chain is the one-node bound's.
        levels, q = learned_levels(drafter, params, head, vocab_ids, probs, padded, hidden,
                                   positions)
        levels = np.asarray(levels)[len(prompt) - 2:len(text) - 2]
        q = np.asarray(q)[len(prompt) - 2:len(text) - 2]            # level 1's, [n, Vd]
        column = draft_column[np.maximum(first, 0)]
        at_first = q[np.arange(len(q)), np.maximum(column, 0)]
        first_qs.append(np.where((first >= 0) & (column >= 0), at_first / q.max(-1), 0.0))
        rows["oracle_chain"].append((levels, masses[1][-1]))
        rows["ngram_chain"].append((levels, accepts))
        rows["ngram_chain_expected"].append((levels, chain_level_probs(
            params, config, temperature, padded, np.arange(len(prompt), len(text)), drafts)))
        match_lengths.append(matched)
  per_token = lambda pairs: sum(n for n, _ in pairs) / sum(n / b for n, b in pairs)
  report = {"model": "smollm2 (fp32)", "temperature": temperature,
            "group_size": _GROUP.value, "prompts": _PROMPTS.value, "depth": depth,
            "earlier_epoch": _EPOCH.value,
            "live_batch": _LIVE_BATCH.value,
            "positions": int(sum(len(s) for s in seen_all)),
            "last_token_seen_before_frac": float(np.mean(np.concatenate(seen_all))),
            "by_nodes": {str(n): {"level_accept_bound_mean": float(np.mean(np.concatenate(
                                      [m[:, 0] for m in masses[n]]))),
                                  "accept_len_bound": per_token(bounds[n])} for n in nodes}}
  if engine_spec is not None:
    accept = engine["tokens"] / engine["steps"]
    # Only the bounds of trees at least as wide as the engine's bound it.
    report["engine"] = {"strategy": engine_strategy.name, "accept_len": accept,
                        "over_bound_by_nodes": {str(n): accept / report["by_nodes"][str(n)][
                            "accept_len_bound"] for n in nodes if n >= engine_strategy.topk}}
  if first_accepts["ngram_chain"]:
    # The mean p of each rule's first draft (the oracle's: by_nodes 1's level mean).
    report["first_draft_accept"] = {rule: float(np.mean(np.concatenate(a)))
                                    for rule, a in first_accepts.items() if a}
  if _DRAFTER.value:
    # The pick against the oracle chain bounds any model-free drafter's hybrid; against
    # ours (as it came out, and in expectation), the hybrid we ship.
    report["hybrid"] = {"drafter": _DRAFTER.value, "max_ngram": _MAX_NGRAM.value, **{
        chain: {"by_draft_cost": [rates(kind_rows, d, *((match_lengths, first_qs)
                                                        if chain != "oracle_chain" else ()))
                                  for d in draft_costs]}
        for chain, kind_rows in rows.items()}}
  emit(report, _OUTPUT.value)


if __name__ == "__main__":
  cli.run(main)

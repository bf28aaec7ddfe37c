"""Model-free (n-gram) speculative decoding is lossless: greedy token identity with plain
decoding for batches of GRPO-style groups, the point-mass acceptance rule emits p, and
sampling with sibling drafts keeps plain sampling's joint distribution."""
import collections
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.test_speculative import GREEDY, _model, _prompts, homogeneity_p_value
from tlt_jax.errors import UserInputError
from tlt_jax.models import transformer
from tlt_jax.rollout.acceptance import recursive_rejection
from tlt_jax.rollout.buckets import BucketSpec
from tlt_jax.rollout.engine import generate
from tlt_jax.rollout.ngram import NgramConfig
from tlt_jax.rollout.sampling import SamplingParams, processed_logprobs
from tlt_jax.rollout.spec_config import SpecConfig
from tlt_jax.rollout.strategy import SpecStrategy
from tlt_jax.rollout.weights import DraftWeights

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_FREE = SpecConfig(kind="ngram", ngram_config=NgramConfig(max_ngram=3),
                        strategy=SpecStrategy(4, 1, 5), threshold=8, patience=2)


def _forward_logprobs(params, config, prompts, outputs, temperature=1.0):
  """Log-probs (of the logits over `temperature`) of each output after its prompt, from one
  full forward pass over the right-padded sequences (padding comes after every scored
  token)."""
  sequences = [p + o for p, o in zip(prompts, outputs)]
  tokens = np.zeros((len(sequences), max(map(len, sequences))), np.int32)
  for row, sequence in enumerate(sequences):
    tokens[row, :len(sequence)] = sequence
  positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
  hidden = transformer.forward_packed(params, config, jnp.asarray(tokens), positions,
                                      jnp.zeros_like(tokens))
  logits = transformer.lm_logits(params, config, hidden) / temperature
  logprobs = np.asarray(jax.nn.log_softmax(logits, -1))
  return [logprobs[row, np.arange(len(p) - 1, len(p) + len(o) - 1), o]
          for row, (p, o) in enumerate(zip(prompts, outputs))]


def test_chain_follows_the_longest_latest_match_and_appends():
  """Drafts are the tokens after the longest suffix match (then the latest position) among
  the row's group, whose entries stay after their rows leave the batch (entry 1 here); a
  cycle continues past the text it was matched in; a padding row (-1) writes nothing."""
  from tlt_jax.rollout import ngram
  prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
  texts = [prompt + [3], prompt + [3, 4, 1, 5, 6], [7, 7, 7], [9, 8]]
  context = ngram.build_context(texts, [0, 0, 1, 2], np.array([0, 2, 3, -1]), 32)
  assert context.sizes == {"entries": 4, "length": 32, "members": 2}
  drafts, matched = ngram.propose_chain(context, 3, NgramConfig(max_ngram=4))
  drafts = np.asarray(drafts)
  # Row 0's last 4 tokens "4 1 2 3" end at 6 of its own text and at 6 and 10 of its
  # sibling's, which is ahead: the latest match gives its next tokens. Row 1: "7 7" cycles.
  # Row 2's "8" never occurred before: no match.
  assert drafts[0].tolist() == [4, 1, 5] and drafts[1].tolist() == [7, 7, 7]
  assert np.asarray(matched)[:3].tolist() == [4, 2, 0]
  grown = ngram.append(context, jnp.array([[4, 1, 5]] * 4), jnp.array([2, 0, 1, 3]))
  assert np.asarray(grown.lengths).tolist() == [13, 15, 3, 3]
  assert np.asarray(grown.tokens)[0, 11:13].tolist() == [4, 1]
  assert np.asarray(grown.tokens)[3, :3].tolist() == [9, 8, 4]
  # Matched at the sibling's 12th token, two tokens follow, then the chain repeats them.
  assert np.asarray(ngram.propose_chain(grown, 3, NgramConfig())[0])[0].tolist() == [5, 6, 5]


def test_sampled_chain_prefers_the_rows_own_text_at_equal_length():
  """own_first (sampling): of equally long matches, the row's own text before a later
  position in a sibling's; a longer match anywhere still wins."""
  from tlt_jax.rollout import ngram
  texts = [[5, 1, 2, 6, 0, 1, 2], [0, 0, 0, 1, 2, 7, 7]]
  context = ngram.build_context(texts, [0, 0], np.array([0]), 16)
  chain = lambda own_first: np.asarray(ngram.propose_chain(
      context, 2, NgramConfig(max_ngram=2), own_first=own_first)[0])[0].tolist()
  # "1 2" ends at 2 of the row's own text and at 4 of its sibling's.
  assert chain(False) == [7, 7] and chain(True) == [6, 0]
  longer = ngram.build_context([[5, 1, 2, 6, 0, 1, 2], [0, 0, 0, 0, 1, 2, 7]], [0, 0],
                               np.array([0]), 16)
  assert np.asarray(ngram.propose_chain(longer, 1, NgramConfig(max_ngram=3),
                                        own_first=True)[0])[0].tolist() == [7]


def test_tree_rematches_every_node_and_keeps_the_likeliest_paths():
  """The row's last 2 tokens "1 2" end 4 times (3 in its own text, once in its sibling's):
  3 follows three, 7 one, so 3 gets 3/4 and 7 1/4. Each node matches again with its path:
  "2 3" is followed by 4 (3/3); "3 4" by 5 twice and 6 once (2/3, 1/3); "2 7" by 8 once,
  and its last token "7" alone by 5 once in the sibling, weighing 1/8 of the 2-token
  match. Two children a node, six nodes: likeliest first, a parent before its child at
  equal probability, the rest dropped (7 8 9 and 7 5); in verify order, by depth."""
  from tlt_jax.rollout import ngram
  own = [1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 6, 0, 1, 2, 7, 8, 9, 0, 1, 2]
  context = ngram.build_context([own, [1, 2, 3, 4, 5, 0, 7, 5]], [0, 0], np.array([0]), 32)
  tokens, depths, parents, ancestors, matched = (np.asarray(x)[0] for x in ngram.propose_tree(
      context, 3, 2, 6, NgramConfig(max_ngram=2)))
  assert matched == 2
  # 3 (.75), 3 4 (.75), 3 4 5 (.5), then at .25 7, 7 8 and 3 4 6 (7 8 9 ties, after them).
  assert tokens.tolist() == [3, 7, 4, 8, 5, 6]
  assert depths.tolist() == [1, 1, 2, 2, 3, 3] and parents.tolist() == [0, 0, 1, 2, 3, 3]
  assert np.array_equal(ancestors, [[1, 0, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0],
                                    [1, 0, 1, 0, 0, 0], [0, 1, 0, 1, 0, 0],
                                    [1, 0, 1, 0, 1, 0], [1, 0, 1, 0, 0, 1]])
  # A budget past the tree repeats the root's first child, attending to itself alone.
  tokens, depths, parents, ancestors, _ = (np.asarray(x)[0] for x in ngram.propose_tree(
      context, 2, 1, 4, NgramConfig(max_ngram=2)))
  assert tokens.tolist() == [3, 4, 3, 3] and parents.tolist() == [0, 1, 0, 0]
  assert depths.tolist() == [1, 2, 1, 1]
  assert np.array_equal(ancestors[2:], np.eye(4, dtype=bool)[2:])
  # At equal share the child seen latest comes first (6 after the last "1 2", 5 before);
  # a node may have more children than the occurrences it counts.
  cycles = ngram.build_context([[1, 2, 5, 0, 1, 2, 6, 0, 1, 2]], [0], np.array([0]), 16)
  for topk, nodes in ((1, 1), (2, 2), (100, 120)):
    tokens = np.asarray(ngram.propose_tree(cycles, 1, topk, nodes, NgramConfig(2))[0])[0]
    assert tokens.tolist()[:2] == [6, 5][:nodes]


def _children_of(texts, path, max_ngram):
  """A node's children, written apart from ngram.py: the latest 64 positions (by position,
  then text) of the last token of the row's text (texts[0]) plus the node's path that are
  followed by a token, each counting 8^(the length of the suffix it ends); a child's share
  is its weight's. Returns [(token, share)], likeliest first, at equal share the one seen
  latest first; and the longest suffix among those positions (0: none)."""
  suffix = (texts[0] + list(path))[-max_ngram:][::-1]
  found = sorted((j, m) for m, text in enumerate(texts) for j in range(len(text) - 1)
                 if text[j] == suffix[0])[-64:]
  weight, latest, longest = collections.Counter(), {}, 0
  for rank, (j, m) in enumerate(found):
    k = 1
    while k < len(suffix) and j - k >= 0 and texts[m][j - k] == suffix[k]:
      k += 1
    weight[texts[m][j + 1]] += 8.0 ** k
    latest[texts[m][j + 1]] = rank
    longest = max(longest, k)
  total = sum(weight.values())
  return sorted(((token, w / total) for token, w in weight.items()),
                key=lambda child: (-child[1], -latest[child[0]])), longest


def _best_first_tree(texts, depth, topk, nodes, max_ngram):
  """{path: estimated probability} of the likeliest `nodes` paths, each node's best `topk`
  children, expanded one node at a time from a heap."""
  import heapq
  heap, kept = [(-1.0, ())], {}
  while heap and len(kept) < nodes + 1:
    prob, path = heapq.heappop(heap)
    kept[path] = -prob
    if len(path) < depth:
      for token, share in _children_of(texts, path, max_ngram)[0][:topk]:
        heapq.heappush(heap, (prob * share, path + (token,)))
  del kept[()]
  return kept


@pytest.mark.parametrize("seed", range(8))
def test_tree_holds_the_likeliest_paths_of_a_best_first_search(seed):
  """Random group texts (many ties; from seed 4 on, tokens that occur more than the 64
  times a node counts), random `topk` and `max_ngram`, and a padding row: the tree's
  paths are distinct, each below its parent, its ancestors exactly the paths it extends,
  and their estimated probabilities are those of the `nodes` likeliest (a heap search
  grown one node at a time, written apart from the level-by-level jnp tree; equal
  probabilities may swap); the padding row drafts padding alone."""
  from tlt_jax.rollout import ngram
  rng = np.random.default_rng(seed)
  vocab, longest = (5, 30) if seed < 4 else (3, 120)
  texts = [rng.integers(0, vocab, size=int(rng.integers(8, longest))).tolist()
           for _ in range(3)]
  depth, topk, nodes, max_ngram = 3, int(rng.integers(1, 4)), 12, int(rng.integers(1, 5))
  context = ngram.build_context(texts, [0, 0, 0], np.array([0, -1]), 128)
  drafted = [np.asarray(x) for x in ngram.propose_tree(
      context, depth, topk, nodes, NgramConfig(max_ngram=max_ngram))]
  tokens, depths, parents, ancestors, matched = (x[0] for x in drafted)
  want = _best_first_tree(texts, depth, topk, nodes, max_ngram)
  assert matched == _children_of(texts, (), max_ngram)[1]
  assert drafted[4][1] == 0 and drafted[2][1].tolist() == [0] * nodes   # the padding row
  paths = []
  for i in range(nodes):
    parent = () if parents[i] == 0 else paths[parents[i] - 1]
    paths.append(parent + (int(tokens[i]),))
    assert len(paths[i]) == depths[i]
  real = len(want)
  assert len(set(paths[:real])) == real
  assert all(paths[i][:1] == paths[0][:1] and depths[i] == 1 for i in range(real, nodes))
  for i in range(real):
    assert set(np.flatnonzero(ancestors[i])) == {
        j for j in range(real) if paths[i][:len(paths[j])] == paths[j]}
  share = lambda path: dict(_children_of(texts, path[:-1], max_ngram)[0])[path[-1]]
  got = sorted(np.prod([share(path[:d + 1]) for d in range(len(path))])
               for path in paths[:real])
  np.testing.assert_allclose(got, sorted(want.values()), rtol=1e-5)


@pytest.mark.parametrize("group_size,strategy", [(4, "4_1_5"), (8, "4_1_5"), (4, "4_2_7")])
def test_model_free_greedy_is_token_identical(group_size, strategy):
  """Groups of equal prompts of different lengths; rows stop at different caps, so the batch
  of 16 compacts to 8 before SD switches on and to smaller buckets while it runs. With
  G = 8 each row also gets an earlier epoch's response (the plain output of its group's
  last row, the longest) as draft context. 4_2_7: a tree of the matches' continuations."""
  config, params, _ = _model(97, seed=2)
  lengths = (5, 9, 3, 12) if group_size == 4 else (7, 11)
  prompts = [p for p in _prompts(97, lengths, seed=4) for _ in range(group_size)]
  caps = [6 + 4 * i for i in range(len(prompts))]
  plain = generate(params, config, prompts, max_new_tokens=caps, sampling=GREEDY,
                   eos_ids=(96,))
  earlier = None
  if group_size == 8:
    last = lambda i: i - i % group_size + group_size - 1
    earlier = [plain.outputs[last(i)].token_ids for i in range(len(prompts))]
  spec = dataclasses.replace(MODEL_FREE, strategy=SpecStrategy.parse(strategy))
  sd = generate(params, config, prompts, max_new_tokens=caps, sampling=GREEDY, eos_ids=(96,),
                spec=spec, chunk_steps=4, draft_context=earlier)
  for a, b in zip(plain.outputs, sd.outputs):
    assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
  scored = _forward_logprobs(params, config, prompts, [o.token_ids for o in sd.outputs])
  for output, want in zip(sd.outputs, scored):
    np.testing.assert_allclose(output.logprobs, want, atol=1e-4)
  stats = sd.stats
  assert stats["spec/on_at_s"] is not None and stats["spec/verify_steps"] > 0
  buckets = stats["rollout/batch_buckets"]
  assert buckets[:2] == [16, 8] and len(buckets) >= 3   # compacted again during SD
  assert stats["spec/drafter"] == "ngram"
  assert stats["spec/accept_len_by_drafter"]["ngram"] == stats["spec/accept_len"]
  # The repeated greedy text of a group (and the earlier responses) is drafted correctly.
  assert stats["spec/accept_len"] > (3.0 if earlier else 1.5), stats["spec/accept_len"]
  entries = 16 if earlier is None else 32    # the rows' own texts, then the extras
  assert stats["spec/context_sizes"] == {"entries": entries, "length": 128,
                                         "members": 2 * group_size if earlier else group_size}


@pytest.mark.parametrize("proposals", [1, 2, 3, 4])
def test_point_mass_acceptance_emits_p(proposals):
  """A root with `proposals` distinct point-mass children (tried in order), each with one
  point-mass child: the first emitted token follows p, and the second, where the first was
  an accepted draft, follows that child's p. 60000 walks: chi-square at p >= 0.001 then
  catches a 2% total-variation shift (its statistic would be ~100 on 5 degrees of freedom)."""
  from scipy.stats import chisquare
  vocab, n = 6, 60_000
  sampling = SamplingParams(temperature=1.0, top_k=5)   # 5 tokens: some never proposed
  k_p, k_child, k_walk = jax.random.split(jax.random.key(proposals), 3)
  p = jnp.exp(processed_logprobs(1.5 * jax.random.normal(k_p, (vocab,)), sampling))
  p_child = jnp.exp(processed_logprobs(1.5 * jax.random.normal(k_child, (vocab,)), sampling))
  # Distinct proposals, the second most likely token first: some of each pass and fail.
  first = jnp.argsort(-p)[jnp.array([1, 0, 2, 3])[:proposals]].astype(jnp.int32)
  second = (first + 1) % vocab
  tokens = jnp.broadcast_to(jnp.concatenate([jnp.zeros(1, jnp.int32), first, second]),
                            (n, 1 + 2 * proposals))
  parents = jnp.array([0] + [0] * proposals + list(range(1, proposals + 1)))
  target = jnp.stack([p] + [p_child] * proposals + [p] * proposals)
  num_accepted, _, emitted, tries, accepts = recursive_rejection(
      k_walk, jnp.broadcast_to(jnp.log(target), (n,) + target.shape), None, tokens,
      jnp.broadcast_to(parents, tokens.shape), 2, proposals)
  num_accepted, emitted = np.asarray(num_accepted), np.asarray(emitted)
  # Drafts were both accepted and rejected, each tried in order until one passed.
  assert 0.02 < np.mean(num_accepted >= 1) < 0.98
  assert np.all(np.diff(np.asarray(tries)[:, 0], axis=1) <= 0)
  assert np.all(np.asarray(accepts).sum(axis=2) <= 1)
  for position, dist, rows in ((0, p, slice(None)), (1, p_child, num_accepted >= 1)):
    observed = np.bincount(emitted[rows, position], minlength=vocab)
    expected = np.asarray(dist, np.float64) * observed.sum()
    inside = expected > 0
    assert observed[~inside].sum() == 0            # never outside p's support
    _, p_value = chisquare(observed[inside], expected[inside] / expected[inside].sum()
                           * observed.sum())
    assert p_value >= 1e-3, (position, p_value)


def _first_tokens(params, config, spec, seed, sampling, rows, group_size=8):
  """The first 3 of 6 tokens of `rows` samples of a repetitive prompt, in groups. Rows go
  on past the third token so that, in the verify steps that emit it, a row that fell behind
  its siblings can draft what they wrote."""
  result = generate(params, config, [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2]] * rows, max_new_tokens=6,
                    sampling=sampling, seed=seed, spec=spec,
                    buckets=BucketSpec(batch_buckets=(rows,), cache_page=32),
                    group_ids=[i // group_size for i in range(rows)])
  return [tuple(o.token_ids[:3]) for o in result.outputs], result.stats


@pytest.mark.parametrize("strategy", ["2_1_3", "2_2_5"])
def test_model_free_sampling_matches_plain_joint_distribution(monkeypatch, strategy):
  """Chi-square homogeneity of the first 3 tokens' joint distribution, model-free SD vs
  plain sampling, 32768 samples each. ~108 cells are populated, one holds ~0.47 of the
  mass: a 2% total-variation shift is detected at the 0.001 level with power ~1.0 when it
  moves mass between the two largest cells and ~0.98 when spread over the ten largest
  (noncentral chi-square, from the plain distribution; half the samples gave 0.84 and
  0.44). Drafts come from the repetitive prompt and the siblings' text, and are often
  accepted and often rejected. 2_2_5: two distinct continuations per node."""
  from tlt_jax.rollout import spec_config
  monkeypatch.setattr(spec_config, "MAX_SD_THRESHOLD", 4096)   # SD on for the whole batch
  config, params, _ = _model(6, seed=11)
  sampling = SamplingParams(temperature=0.5)
  spec = SpecConfig(kind="ngram", ngram_config=NgramConfig(),
                    strategy=SpecStrategy.parse(strategy), threshold=4096, patience=0)
  plain, sd = collections.Counter(), collections.Counter()
  accept_lens = []
  for seed in range(8):
    plain.update(_first_tokens(params, config, None, seed, sampling, 4096)[0])
    tokens, stats = _first_tokens(params, config, spec, 1000 + seed, sampling, 4096)
    sd.update(tokens)
    accept_lens.append(stats["spec/accept_len"])
  p_value = homogeneity_p_value(plain, sd)
  assert p_value >= 1e-3, p_value
  # Each verify step emits 1 (first draft rejected) to 3 tokens; siblings' text helps.
  assert 1.3 < np.mean(accept_lens) < 2.0, accept_lens
  alone = _first_tokens(params, config, spec, 1000, sampling, 4096, group_size=1)[1]
  assert alone["spec/accept_len"] + 0.01 < accept_lens[0], (alone["spec/accept_len"],
                                                            accept_lens)


def test_model_free_bad_input_is_one_line():
  config, params, drafter = _model(8)
  run = lambda **kwargs: generate(params, config, [[1, 2], [3, 4, 5]], max_new_tokens=2,
                                  sampling=GREEDY, **kwargs)
  with pytest.raises(UserInputError, match="group_ids: expected 2 integers"):
    run(spec=MODEL_FREE, group_ids=[0])
  with pytest.raises(UserInputError, match="draft_context: expected 2 lists"):
    run(spec=MODEL_FREE, draft_context=[[1, 2]])
  with pytest.raises(UserInputError, match=r"draft_context: expected 2 lists .* \[0, 8\)"):
    run(spec=MODEL_FREE, draft_context=[[1, 2], [9]])
  with pytest.raises(UserInputError, match="draft_context: needs model-free"):
    run(draft_context=[[1], [2]])
  with pytest.raises(UserInputError, match="hybrid drafting verifies chains"):
    SpecConfig(kind="hybrid", ngram_config=NgramConfig(), strategy=SpecStrategy(3, 2, 5))
  # Weights given where every strategy drafts model-free.
  with pytest.raises(UserInputError, match="drafter weights given, but every strategy "
                     "drafts model-free"):
    run(spec=dataclasses.replace(MODEL_FREE, strategy=SpecStrategy(3, 1, 4)),
        drafter=DraftWeights(drafter))
  with pytest.raises(UserInputError, match="--max_ngram=0"):
    NgramConfig(max_ngram=0)


def test_generate_cli_drafter_ngram(tiny_hf_dirs, tmp_path):
  """`--drafter=ngram`: the greedy output of plain decoding (groups of equal prompts draft
  from each other) and model-free stats; a tree too large for its shape is one line, exit 2."""
  import json
  import subprocess
  import sys

  from tlt_jax.models.loading import load_model
  prompts = [[5, 6, 7, 5, 6], [5, 6, 7, 5, 6], [9, 10, 11, 12], [9, 10, 11, 12]]
  (tmp_path / "prompts.json").write_text(json.dumps(prompts))
  run = lambda *flags: subprocess.run(
      [sys.executable, "-m", "experiments.generate", f"--model={tiny_hf_dirs['llama']}",
       f"--prompts_json={tmp_path / 'prompts.json'}", f"--output_json={tmp_path / 'out.json'}",
       "--max_new_tokens=16", "--temperature=0", "--drafter=ngram", *flags],
      cwd=REPO, capture_output=True, text=True, timeout=600)
  proc = run("--strategy=3_1_4", "--sd_threshold=4", "--sd_patience=0", "--max_ngram=2")
  assert proc.returncode == 0, proc.stderr
  result = json.loads((tmp_path / "out.json").read_text())
  model = load_model(tiny_hf_dirs["llama"])
  plain = generate(model.params, model.config, prompts, max_new_tokens=16, sampling=GREEDY,
                   eos_ids=tuple(model.config.eos_token_ids))
  assert [o["token_ids"] for o in result["outputs"]] == [o.token_ids for o in plain.outputs]
  stats = result["stats"]
  assert stats["spec/drafter"] == "ngram" and stats["spec/verify_steps"] > 0
  assert stats["spec/context_sizes"]["members"] == 2
  (tmp_path / "out.json").unlink()
  bad = run("--strategy=3_2_8")
  errors = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
  assert bad.returncode == 2 and len(errors) == 1 and "exceeds" in errors[0], bad.stderr
  assert not (tmp_path / "out.json").exists()

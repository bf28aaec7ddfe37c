"""The GRPO loss, its gradient and the trainer's log-probs against a torch oracle.

The oracle is written here from the loss's definition over the HF model itself
(transformers + autograd): a right-padded [B, T] batch with an attention mask, the
temperature-scaled log_softmax of its logits, the PPO-clipped surrogate (+ dual clip,
+ truncated IS), k3 KL to a second HF model, the entropy of the full distribution, and
each loss_agg_mode's formula on the padded response mask. The project side goes through
what `update_policy` runs, `minibatch_grads`: `pack` -> `micro_batches` (several, so accumulation is
exercised) -> `accumulate_grads`, with `sequence_weights` and the reference log-probs
from `score_sequences`. Everything is fp32. Each loss setting runs all four
loss_agg_modes through one compiled accumulate_grads (`_program_loss`).

Tolerances: per-token log-probs 1e-4 abs; the loss 1e-5 relative; the gradients of named
matrices 1e-4 abs (and the global grad norm over every parameter 1e-5 relative); the
loss's metric sums (clip fractions, token-mean KL and entropy) against the oracle's.

llama_tied is in the log-prob test only: its N(0, 1) tied embeddings make the policy so
peaked that log(ref / policy) to the seed-1 reference passes losses.LOG_RATIO_LIMIT on
some tokens, where the project's clamp (by design) departs from the unclamped k3.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.hf_fixtures import make_tiny_hf_checkpoint
from tlt_jax.models.hf import load_hf_dir
from tlt_jax.rl.advantages import group_advantages
from tlt_jax.rl.batching import Sequences, micro_batches, pack, row_counts
from tlt_jax.rl.config import LOSS_AGG_MODES, AdvantageConfig, LossConfig
from tlt_jax.rl.update import (UpdateConfig, UpdateContext, accumulate_grads, minibatch_grads,
                               moving_sequences, score_sequences)
from tlt_jax.rollout.sampling import SamplingParams

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

TEMPERATURE = 0.7
MAX_RESPONSE_LEN = 12      # the configured cap (seq_mean_token_sum_norm's divisor)
TRAIN_SEQ_LEN = 32
MICRO_ROWS = 2
PROMPT_LENGTHS = (5, 9, 3)               # one prompt per group
RESPONSE_LENGTHS = ((7, 2, 12), (4, 11, 6), (9, 3, 8))
REWARDS = np.array([[1.0, 0.0, 0.5], [0.0, 1.0, 1.0], [0.2, 0.9, 0.4]])
ADV_EPS = 1e-6
OLD_NOISE = 0.4            # old = current + N(0, OLD_NOISE): ratios clip, some dual-clip

LOGP_TOL = 1e-4
LOSS_RTOL = 1e-5
GRAD_ATOL = 1e-4


# ---- the batch -------------------------------------------------------------------------

def _batch(vocab_size: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  prompts, responses = [], []
  for p_len, r_lens in zip(PROMPT_LENGTHS, RESPONSE_LENGTHS):
    prompt = rng.integers(3, vocab_size, p_len).tolist()
    for r_len in r_lens:
      prompts.append(prompt)
      responses.append(rng.integers(3, vocab_size, r_len).tolist())
  return Sequences(prompts, responses)


def _oracle_advantages(rewards: np.ndarray) -> np.ndarray:
  """GRPO written out: (r - mean) / (unbiased std + eps), per group, flattened."""
  r = torch.tensor(rewards, dtype=torch.float64)
  adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, unbiased=True, keepdim=True) + ADV_EPS)
  return adv.reshape(-1).numpy()


# ---- the torch oracle ------------------------------------------------------------------

def _padded(sequences: Sequences):
  """Right-padded input ids and attention mask [B, T]."""
  b, t = len(sequences), max(sequences.length(i) for i in range(len(sequences)))
  ids, mask = torch.zeros((b, t), dtype=torch.long), torch.zeros((b, t), dtype=torch.long)
  for i in range(b):
    row = list(sequences.prompts[i]) + list(sequences.responses[i])
    ids[i, :len(row)] = torch.tensor(row)
    mask[i, :len(row)] = 1
  return ids, mask


def _hf_response_scores(model, sequences: Sequences):
  """(logp, entropy, mask) [B, MAX_RESPONSE_LEN]: the temperature-scaled policy's log-prob
  of each response token and its distribution's entropy, zero-padded; with autograd."""
  ids, attn = _padded(sequences)
  logits = model(input_ids=ids, attention_mask=attn).logits.float()
  logp_all = torch.log_softmax(logits / TEMPERATURE, dim=-1)
  logps, entropies = [], []
  mask = torch.zeros((len(sequences), MAX_RESPONSE_LEN))
  for i in range(len(sequences)):
    p, r = len(sequences.prompts[i]), len(sequences.responses[i])
    # Position t's distribution scores token t + 1.
    dist = logp_all[i, p - 1:p - 1 + r]
    target = torch.tensor(sequences.responses[i]).unsqueeze(-1)
    pad = (0, MAX_RESPONSE_LEN - r)
    logps.append(torch.nn.functional.pad(dist.gather(-1, target).squeeze(-1), pad))
    entropies.append(torch.nn.functional.pad(-(dist.exp() * dist).sum(-1), pad))
    mask[i, :r] = 1.0
  return torch.stack(logps), torch.stack(entropies), mask


def _aggregate(values, mask, mode: str):
  """loss_agg_mode on a padded [B, T] mask; fully masked rows do not count as sequences."""
  live = mask.sum(-1) > 0
  seq_sums = (values * mask).sum(-1)
  if mode == "token_mean":
    return seq_sums.sum() / mask.sum()
  if mode == "seq_mean_token_mean":
    return (seq_sums[live] / mask.sum(-1)[live]).mean()
  if mode == "seq_mean_token_sum":
    return seq_sums[live].mean()
  if mode == "seq_mean_token_sum_norm":
    return seq_sums[live].mean() / mask.shape[-1]
  raise ValueError(mode)


def _oracle_loss(model, sequences, advantages, old_logp, rollout_logp, ref_logp, in_loss,
                 loss: LossConfig):
  """The GRPO loss from its definition, and the clip masks it used."""
  logp, entropy, mask = _hf_response_scores(model, sequences)
  mask = mask * torch.tensor(in_loss, dtype=torch.float32)[:, None]
  adv = torch.tensor(advantages, dtype=torch.float32)[:, None]
  old, rollout, ref = (torch.tensor(_pad_rows(x)) for x in (old_logp, rollout_logp, ref_logp))
  ratio = torch.exp(logp - old)
  pg_unclipped = -adv * ratio
  pg_clipped = -adv * torch.clamp(ratio, 1 - loss.clip_ratio_low, 1 + loss.clip_ratio_high)
  pg = torch.maximum(pg_unclipped, pg_clipped)
  dual = torch.zeros_like(pg, dtype=torch.bool)
  if loss.clip_ratio_c is not None:
    dual = (adv < 0) & (pg > -adv * loss.clip_ratio_c)
    pg = torch.where(adv < 0, torch.minimum(pg, -adv * loss.clip_ratio_c), pg)
  if loss.tis_cap is not None:
    pg = pg * torch.clamp(torch.exp(old - rollout), max=loss.tis_cap)
  kl = torch.exp(ref - logp) - (ref - logp) - 1
  total = (_aggregate(pg, mask, loss.loss_agg_mode)
           + loss.kl_coef * _aggregate(kl, mask, loss.loss_agg_mode)
           - loss.entropy_coef * _aggregate(entropy, mask, loss.loss_agg_mode))
  live = mask > 0
  stats = {"clip": int(((pg_clipped > pg_unclipped) & live).sum()),
           "dual": int((dual & live).sum()),
           "kl": float((kl * mask).sum().detach() / mask.sum()),
           "entropy": float((entropy * mask).sum().detach() / mask.sum())}
  return total, stats


def _pad_rows(values) -> np.ndarray:
  out = np.zeros((len(values), MAX_RESPONSE_LEN), np.float32)
  for i, v in enumerate(values):
    out[i, :len(v)] = v
  return out


def _unpad(padded: torch.Tensor, sequences: Sequences) -> list[np.ndarray]:
  return [padded[i, :len(r)].detach().numpy() for i, r in enumerate(sequences.responses)]


# ---- the project side, as update_policy builds one mini-batch --------------------------

def _context(config, loss: LossConfig) -> UpdateContext:
  return UpdateContext(
      config=config, sampling=SamplingParams(temperature=TEMPERATURE), loss=loss,
      update=UpdateConfig(micro_batch_rows=MICRO_ROWS, train_seq_len=TRAIN_SEQ_LEN),
      optimizer=optax.sgd(0.0), learning_rate=optax.constant_schedule(0.0),
      max_response_len=MAX_RESPONSE_LEN)


def _project_grads(setup, sequences, advantages, old_logp, rollout_logp, ref_logp, in_loss,
                   ctx: UpdateContext):
  """(grads, summed metrics) of one mini-batch holding every sequence, as update_policy
  computes it before its optimizer step (the program compiled with the mode-canonical
  LossConfig, see `_program_loss`)."""
  layout = pack(sequences, range(len(sequences)), ctx.update.train_seq_len)
  first_rows = next(micro_batches(layout, sequences, ctx.update.micro_batch_rows, {}, {}))
  grads, merged = minibatch_grads(
      setup.params, sequences, np.arange(len(sequences)), advantages,
      {"old_logp": old_logp, "rollout_logp": rollout_logp, "ref_logp": ref_logp}, in_loss, ctx,
      loss=_program_loss(setup, ctx.loss, first_rows))
  return jax.device_get(grads), merged


# ---- fixtures --------------------------------------------------------------------------

class _Setup:
  """One architecture: policy and reference, as HF torch models and project params."""

  def __init__(self, kind, policy_dir, ref_dir):
    import transformers
    load = lambda d: transformers.AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32).eval()
    self.kind = kind
    self.hf, self.hf_ref = load(policy_dir), load(ref_dir)
    self.config, self.params = load_hf_dir(policy_dir, jnp.float32)
    ref_config, self.ref_params = load_hf_dir(ref_dir, jnp.float32)
    assert ref_config == self.config
    self.sequences = _batch(self.config.vocab_size)
    with torch.no_grad():
      logp, _, _ = _hf_response_scores(self.hf, self.sequences)
      ref, _, _ = _hf_response_scores(self.hf_ref, self.sequences)
    self.hf_logp = _unpad(logp, self.sequences)
    self.hf_ref_logp = _unpad(ref, self.sequences)
    rng = np.random.default_rng(1)
    self.old_logp = [(v + rng.normal(0.0, OLD_NOISE, v.shape)).astype(np.float32)
                     for v in self.hf_logp]
    self.rollout_noise = [rng.normal(0.0, 0.3, v.shape).astype(np.float32)
                          for v in self.hf_logp]


@pytest.fixture(scope="module")
def setups(tiny_hf_dirs, tmp_path_factory):
  cache = {}
  root = tmp_path_factory.mktemp("rl_oracle_ref")

  def get(kind):
    if kind not in cache:
      ref_dir = make_tiny_hf_checkpoint(kind, str(root / kind), seed=1)
      cache[kind] = _Setup(kind, tiny_hf_dirs[kind], ref_dir)
    return cache[kind]
  return get


# ---- the tests -------------------------------------------------------------------------

def _named_grads(setup, grads):
  """(name, project grad, HF grad) for a few matrices, in the project's [in, out] layout."""
  hf = setup.hf.model
  layers = grads["layers"]
  last = setup.config.num_layers - 1
  pairs = [("layer0.q_proj", layers["wq"][0], hf.layers[0].self_attn.q_proj.weight.grad.T),
           ("layer0.k_proj", layers["wk"][0], hf.layers[0].self_attn.k_proj.weight.grad.T),
           (f"layer{last}.o_proj", layers["wo"][last],
            hf.layers[last].self_attn.o_proj.weight.grad.T),
           ("layer1.down_proj", layers["w_down"][1], hf.layers[1].mlp.down_proj.weight.grad.T),
           ("layer0.gate_proj", layers["w_gate"][0], hf.layers[0].mlp.gate_proj.weight.grad.T),
           ("layer0.input_layernorm", layers["attn_norm"][0],
            hf.layers[0].input_layernorm.weight.grad),
           ("final_norm", grads["final_norm"], hf.norm.weight.grad),
           ("embed", grads["embed"], hf.embed_tokens.weight.grad)]
  if not setup.config.tie_word_embeddings:
    pairs.append(("lm_head", grads["lm_head"], setup.hf.lm_head.weight.grad.T))
  if setup.config.qkv_bias:
    pairs.append(("layer0.q_proj.bias", layers["bq"][0], hf.layers[0].self_attn.q_proj.bias.grad))
  if setup.config.qk_norm:
    pairs.append(("layer0.q_norm", layers["q_norm"][0], hf.layers[0].self_attn.q_norm.weight.grad))
  return [(name, np.asarray(ours), theirs.detach().numpy()) for name, ours, theirs in pairs]


@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3", "llama_tied"])
def test_trainer_logprobs_match_hf(setups, kind):
  """What the learner scores (`score_sequences`: old and reference log-probs) equals HF's
  temperature-scaled log-probs on the same tokens."""
  setup = setups(kind)
  ctx = _context(setup.config, LossConfig())
  for params, hf_logp in ((setup.params, setup.hf_logp), (setup.ref_params, setup.hf_ref_logp)):
    ours = score_sequences(params, setup.sequences, ctx)
    for i, (a, b) in enumerate(zip(ours, hf_logp)):
      assert a.shape == b.shape == (len(setup.sequences.responses[i]),)
      np.testing.assert_allclose(a, b, rtol=0, atol=LOGP_TOL, err_msg=f"sequence {i}")


_CLIP = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, kl_coef=0.1, kl_estimator="k3")
_DUAL_ENTROPY = dict(clip_ratio_c=1.5, entropy_coef=0.05, **_CLIP)
# (id, architecture, LossConfig fields besides the mode, one response out of the loss).
_SETTINGS = [
    ("clip_kl", "qwen2", _CLIP, False),
    ("dual_clip_entropy", "llama", _DUAL_ENTROPY, False),
    # Also a response out of the loss (as overlong masking does: not counted in the
    # seq-mean modes' N) and truncated IS against a rollout that differs from `old`.
    ("dual_clip_entropy_masked_tis", "qwen3", dict(tis_cap=1.5, **_DUAL_ENTROPY), True),
]
CASES = [pytest.param(kind, LossConfig(loss_agg_mode=mode, **fields), mask_one,
                      id=f"{kind}-{name}-{mode}")
         for name, kind, fields, mask_one in _SETTINGS for mode in LOSS_AGG_MODES]


_LOWERED: dict = {}


def _program_loss(setup, loss: LossConfig, rows) -> LossConfig:
  """The LossConfig to compile accumulate_grads with: `loss` with the first mode.

  The mode only reaches the loss through the host-side sequence weights, so the program
  does not depend on it; checked here on the lowered text. That lets the four modes share
  one compile (~7 s on two CPU cores) while running exactly update_policy's computation."""
  canonical = dataclasses.replace(loss, loss_agg_mode=LOSS_AGG_MODES[0])
  lower = lambda l: accumulate_grads.lower(
      setup.params, setup.params, rows, config=setup.config,
      sampling=SamplingParams(temperature=TEMPERATURE), loss=l).as_text()
  if canonical != loss:
    if (setup.kind, canonical) not in _LOWERED:
      _LOWERED[setup.kind, canonical] = lower(canonical)
    assert lower(loss) == _LOWERED[setup.kind, canonical], (
        "accumulate_grads depends on loss_agg_mode")
  return canonical


@pytest.mark.parametrize("kind,loss,mask_one", CASES)
def test_grpo_loss_and_grads_match_torch(setups, kind, loss, mask_one):
  setup = setups(kind)
  seqs = setup.sequences
  in_loss = np.ones(len(seqs), bool)
  if mask_one:
    in_loss[4] = False
  rollout_logp = ([o + d for o, d in zip(setup.old_logp, setup.rollout_noise)]
                  if loss.tis_cap is not None else setup.old_logp)
  ctx = _context(setup.config, loss)

  advantages = group_advantages(REWARDS, AdvantageConfig(mode="grpo", eps=ADV_EPS)).reshape(-1)
  oracle_adv = _oracle_advantages(REWARDS)
  np.testing.assert_allclose(advantages, oracle_adv, rtol=1e-6)
  ref_logp = score_sequences(setup.ref_params, seqs, ctx)
  grads, metrics = _project_grads(
      setup, seqs, advantages, setup.old_logp, rollout_logp, ref_logp, in_loss, ctx)
  assert metrics["train/micro_batches"] >= 2 and metrics["train/rows"] > MICRO_ROWS
  # Some rows hold several samples (segment ids matter).
  assert metrics["train/rows"] < len(seqs)
  # Computed slots: the padded micro-batches'; those holding a token: every sample's in
  # the loss (one out of it has no gradient and is not computed).
  padded_rows = sum(row_counts(int(metrics["train/rows"]), MICRO_ROWS))
  assert metrics["train/slots"] == padded_rows * TRAIN_SEQ_LEN
  assert metrics["train/token_slots"] == sum(seqs.length(i) for i in np.flatnonzero(in_loss))
  assert metrics["train/token_slots"] < metrics["train/slots"]

  setup.hf.zero_grad(set_to_none=True)
  oracle, stats = _oracle_loss(setup.hf, seqs, oracle_adv, setup.old_logp, rollout_logp,
                               setup.hf_ref_logp, in_loss, loss)
  oracle.backward()
  # The batch exercises what it claims to: clipped ratios, dual clip, non-zero KL.
  assert stats["clip"] > 0 and stats["kl"] > 1e-3
  if loss.clip_ratio_c is not None:
    assert stats["dual"] > 0

  np.testing.assert_allclose(float(metrics["actor/loss"]), oracle.item(), rtol=LOSS_RTOL)
  tokens = int(sum(len(r) for r, keep in zip(seqs.responses, in_loss) if keep))
  np.testing.assert_allclose(metrics["actor/clip_frac"], stats["clip"] / tokens, atol=1e-6)
  np.testing.assert_allclose(metrics["actor/kl"], stats["kl"], rtol=1e-4)
  np.testing.assert_allclose(metrics["actor/entropy"], stats["entropy"], rtol=1e-5)
  if loss.clip_ratio_c is not None:
    np.testing.assert_allclose(metrics["actor/clip_frac_dual"], stats["dual"] / tokens,
                               atol=1e-6)

  for name, ours, theirs in _named_grads(setup, grads):
    assert ours.shape == theirs.shape, name
    assert np.abs(theirs).max() > 1e-3, f"{name}: the oracle's gradient is ~0"
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=GRAD_ATOL, err_msg=name)
  # Every parameter at once, independent of the layout mapping: the global norm.
  ours_norm = float(optax.tree.norm(grads))
  hf_norm = float(torch.sqrt(sum((p.grad ** 2).sum() for p in setup.hf.parameters())))
  np.testing.assert_allclose(ours_norm, hf_norm, rtol=1e-5)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_zero_advantage_sequences_left_out_keep_the_oracles_gradient(setups, mode):
  """A group whose rewards tie has zero advantages: with no KL or entropy term the update
  leaves it out of the forward and backward (`moving_sequences`), and the loss and
  gradient are still the oracle's over every sequence (its tokens count in the
  normalizer of each loss_agg_mode)."""
  setup = setups("qwen2")
  seqs = setup.sequences
  loss = LossConfig(loss_agg_mode=mode)
  rewards = REWARDS.copy()
  rewards[1] = 1.0
  advantages = group_advantages(rewards, AdvantageConfig(mode="grpo", eps=ADV_EPS)).reshape(-1)
  in_loss = np.ones(len(seqs), bool)
  trained = moving_sequences(advantages, in_loss, loss)
  # Group 1 ties; group 0's 0.5 is its mean.
  np.testing.assert_array_equal(trained, [True, True, False] + [False] * 3 + [True] * 3)
  ctx = _context(setup.config, loss)
  zeros = [np.zeros(len(r), np.float32) for r in seqs.responses]
  grads, metrics = minibatch_grads(
      setup.params, seqs, np.arange(len(seqs)), advantages,
      {"old_logp": setup.old_logp, "rollout_logp": setup.old_logp, "ref_logp": zeros},
      in_loss, ctx, loss=dataclasses.replace(loss, loss_agg_mode=LOSS_AGG_MODES[0]),
      trained=trained)
  assert metrics["train/token_slots"] == sum(seqs.length(i) for i in np.flatnonzero(trained))

  setup.hf.zero_grad(set_to_none=True)
  oracle, stats = _oracle_loss(setup.hf, seqs, _oracle_advantages(rewards), setup.old_logp,
                               setup.old_logp, setup.hf_ref_logp, in_loss, loss)
  oracle.backward()
  np.testing.assert_allclose(float(metrics["actor/loss"]), oracle.item(), rtol=LOSS_RTOL)
  for name, ours, theirs in _named_grads(setup, jax.device_get(grads)):
    assert np.abs(theirs).max() > 1e-3, f"{name}: the oracle's gradient is ~0"
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=GRAD_ATOL, err_msg=name)

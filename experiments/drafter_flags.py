"""Online drafter flags of `experiments.run`: the drafter trained during RL on the replicas
the long tail leaves idle (tlt_jax/rl/spot_trainer.py), its buffer and its deploy gate."""
from __future__ import annotations

from absl import flags

from tlt_jax.errors import UserInputError

TRAIN = flags.DEFINE_enum(
    "drafter_train", "off", ["off", "always", "on_decay"],
    "Online drafter training (needs a learned --drafter and --replicas >= 2): 'always' "
    "trains on every replica whose rows are done until the last replica finishes; "
    "'on_decay' only once the deployed drafter's accept length fell --drafter_decay_tolerance "
    "below its best.")
LR = flags.DEFINE_float("drafter_lr", 1e-4, "Online drafter: peak learning rate "
                        "(benchmarks/results/online_drafter_lr_*.json).")
WARMUP = flags.DEFINE_integer("drafter_warmup_steps", 20, "Online drafter: drafter steps "
                              "over which the learning rate ramps up to --drafter_lr (a "
                              "full-rate first step knocks a warm drafter off).",
                              lower_bound=0)
MAX_STEPS = flags.DEFINE_integer("drafter_max_steps", 10_000, "Online drafter: steps per RL "
                                 "step, at most.", lower_bound=1)
MAX_EPOCHS = flags.DEFINE_float("drafter_max_epochs", 2.0, "Online drafter: passes over an "
                                "RL step's fresh training windows (and the previous step's "
                                "long ones), at most, per RL step: more only overfit a "
                                "replica's few responses.")
UNROLL = flags.DEFINE_integer("drafter_unroll", 2, "Online drafter: loss passes (training-time "
                              "test), and the chain depth the deploy gate scores.",
                              lower_bound=1)
BUFFER_MIB = flags.DEFINE_integer("drafter_buffer_mib", 1024, "Online drafter: buffer bound "
                                  "(tokens + hidden states), MiB per replica.", lower_bound=1)
SEQ_LEN = flags.DEFINE_integer("drafter_seq_len", 512, "Online drafter: tokens per training "
                               "window and packed row.", lower_bound=8)
BATCH_ROWS = flags.DEFINE_integer("drafter_batch_rows", 8, "Online drafter: packed rows per "
                                  "step.", lower_bound=1)
PREVIOUS_RATIO = flags.DEFINE_float(
    "drafter_previous_ratio", 0.5, "Online drafter: share of each batch's trained slots drawn "
    "from the previous RL step's long responses (the one-step offset).")
REPLAY_STEPS = flags.DEFINE_integer(
    "drafter_replay_steps", 1, "Online drafter: earlier RL steps whose long responses batches "
    "draw from beside the current step's (1: the previous step only, the one-step offset).",
    lower_bound=1)
SHARE_MIB = flags.DEFINE_integer(
    "drafter_share_mib", 64, "Online drafter: each replica's long responses of a step (tokens "
    "and hidden states), up to this many MiB, go to every other replica's buffer at the step "
    "end, so the replica the tail leaves idle also trains on the tail's responses (what a "
    "replica receives counts toward --drafter_buffer_mib); 0: each replica trains on its "
    "own only.", lower_bound=0)
HELDOUT = flags.DEFINE_float("drafter_heldout_fraction", 0.05, "Online drafter: share of each "
                             "step's responses the deploy gate scores on and training never "
                             "sees.")
GATE_MARGIN = flags.DEFINE_float("drafter_gate_margin", 0.0, "Deploy gate: a trained drafter "
                                 "is deployed when its held-out accept length beats the "
                                 "deployed one's by more than this fraction.")
DECAY_TOLERANCE = flags.DEFINE_float("drafter_decay_tolerance", 0.1, "--drafter_train=on_decay: "
                                     "the relative drop in accept length that restarts "
                                     "training.")

_NEEDS_TRAINING = ("drafter_lr", "drafter_warmup_steps", "drafter_max_steps",
                   "drafter_max_epochs", "drafter_unroll", "drafter_buffer_mib",
                   "drafter_seq_len", "drafter_batch_rows", "drafter_previous_ratio",
                   "drafter_replay_steps", "drafter_share_mib",
                   "drafter_heldout_fraction", "drafter_gate_margin", "drafter_decay_tolerance")


def spot_from_flags(*, learned: bool, greedy: bool, seed: int):
  """The online drafter's config (`SpotConfig`), or None with --drafter_train=off; every
  flag checked before any model loads. learned: the SD config drafts with a learned
  drafter (a --drafter dir)."""
  from tlt_jax.drafter.buffer import BufferConfig
  from tlt_jax.rl.spot_trainer import SpotConfig

  if TRAIN.value == "off":
    given = [f for f in _NEEDS_TRAINING if flags.FLAGS[f].present]
    if given:
      raise UserInputError(f"--{given[0]} needs --drafter_train=always or on_decay")
    return None
  if not learned:
    raise UserInputError(f"--drafter_train={TRAIN.value} needs a learned drafter: "
                         "--drafter=DIR (with or without --hybrid)")
  for flag, ok, rule in (("drafter_lr", LR.value > 0, "> 0"),
                         ("drafter_max_epochs", MAX_EPOCHS.value > 0, "> 0"),
                         ("drafter_previous_ratio", 0 <= PREVIOUS_RATIO.value <= 1, "in [0, 1]"),
                         ("drafter_heldout_fraction", 0 <= HELDOUT.value < 1, "in [0, 1)"),
                         ("drafter_gate_margin", GATE_MARGIN.value >= 0, ">= 0"),
                         ("drafter_decay_tolerance", 0 <= DECAY_TOLERANCE.value < 1,
                          "in [0, 1)")):
    if not ok:
      raise UserInputError(f"--{flag}={flags.FLAGS[flag].value}: must be {rule}")
  buffer = BufferConfig(max_bytes=BUFFER_MIB.value << 20, seq_len=SEQ_LEN.value,
                        batch_rows=BATCH_ROWS.value, context=min(64, SEQ_LEN.value // 4),
                        previous_ratio=PREVIOUS_RATIO.value, replay_steps=REPLAY_STEPS.value,
                        heldout_fraction=HELDOUT.value, seed=seed)
  return SpotConfig(train=TRAIN.value, buffer=buffer, lr=LR.value,
                    warmup_steps=WARMUP.value, max_steps=MAX_STEPS.value,
                    max_epochs=MAX_EPOCHS.value, share_bytes=SHARE_MIB.value << 20,
                    unroll=UNROLL.value, greedy=greedy, gate_margin=GATE_MARGIN.value,
                    decay_tolerance=DECAY_TOLERANCE.value)

"""RL prompt data: task specs, gym and file sources, length filter, resumable grain stream."""
from __future__ import annotations

import json
import pickle

import pytest

from tlt_jax.data.rl_data import (ANSWER_INSTRUCTION, PromptRecord, PromptStream, build_rl_data,
                                  gym_records, load_prompt_file, parse_task_spec,
                                  tokenize_records)
from tlt_jax.errors import UserInputError

ARITH = "basic_arithmetic:min_terms=2,max_terms=2,min_digits=1,max_digits=2"


class FakeTokenizer:
  """One id per character of the concatenated contents, plus 2 for the generation prompt."""

  def apply_chat_template(self, messages, add_generation_prompt=True):
    assert add_generation_prompt
    text = "".join(m["content"] for m in messages)
    return [ord(c) % 100 for c in text] + [1, 2]


def _row(prompt="What is 2+2?", truth="4", source="toy", **extra):
  row = {"prompt": [{"role": "user", "content": prompt}],
         "reward_model": {"ground_truth": truth}, "data_source": source}
  row.update(extra)
  return row


def _write_jsonl(path, rows):
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
  return str(path)


def _write_parquet(path, rows):
  import pyarrow
  import pyarrow.parquet
  pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), str(path))
  return str(path)


def _pairs(n):
  records = [PromptRecord(({"role": "user", "content": f"q{i}"},), str(i), "toy") for i in range(n)]
  return [(r, [i, i + 1]) for i, r in enumerate(records)]


def _indices(batch):
  return [item.index for item in batch]


# ---- task specs ----------------------------------------------------------------------


def test_task_spec_parses_typed_settings():
  specs = parse_task_spec(f" {ARITH},operators=+|-,allow_parentheses=false ; gsm_symbolic ")
  assert [s.name for s in specs] == ["basic_arithmetic", "gsm_symbolic"]
  assert specs[0].overrides == {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2,
                                "operators": ["+", "-"], "allow_parentheses": False}
  assert specs[1].overrides == {}


@pytest.mark.parametrize("spec, fragment", [
    ("not_a_task", "unknown reasoning-gym task 'not_a_task'"),
    ("basic_arithmetic:bogus=1", "has no setting 'bogus'"),
    ("basic_arithmetic:seed=3", "has no setting 'seed'"),
    ("basic_arithmetic:min_terms=two", "expected int"),
    ("basic_arithmetic:min_terms", "expected key=value"),
    ("basic_arithmetic:min_terms=5,max_terms=2", "invalid settings"),
    (" ; ", "no tasks"),
])
def test_task_spec_errors_name_the_flag(spec, fragment):
  with pytest.raises(UserInputError) as e:
    parse_task_spec(spec)
  assert str(e.value).startswith("--tasks: ") and fragment in str(e.value)
  assert "\n" not in str(e.value)


# ---- reasoning-gym records -----------------------------------------------------------


def test_gym_records_deterministic_mixed_and_scorable():
  import reasoning_gym
  specs = parse_task_spec(f"{ARITH};gsm_symbolic")
  records = gym_records(specs, 6, seed=3)
  assert records == gym_records(specs, 6, seed=3)
  assert records != gym_records(specs, 6, seed=4)
  assert [r.data_source for r in records] == ["basic_arithmetic", "gsm_symbolic"] * 3
  for r in records:
    (message,) = r.prompt
    assert message["role"] == "user" and message["content"].endswith(ANSWER_INSTRUCTION)
    entry = r.extra_info["entry"]
    assert message["content"] == entry["question"] + ANSWER_INSTRUCTION
    assert r.ground_truth == entry["answer"]
    # What a reward worker gets after JSON / pickle transport still scores.
    shipped = json.loads(json.dumps(pickle.loads(pickle.dumps(r)).extra_info))["entry"]
    assert shipped == entry
    scorer = reasoning_gym.get_score_answer_fn(r.data_source)
    assert scorer(r.ground_truth, shipped) == 1.0


def test_drafter_warm_up_words_gym_questions_as_rl_does():
  """One builder: the drafter is trained on the prompts RL sends it."""
  import reasoning_gym
  from tlt_jax.data.tasks import build_questions
  questions = build_questions(["basic_arithmetic", "chat"], 4, seed=0)
  assert [task for task, _ in questions] == ["basic_arithmetic", "chat"] * 2
  dataset = reasoning_gym.create_dataset("basic_arithmetic", size=2, seed=0)
  assert [q for task, q in questions if task != "chat"] == [
      dataset[k]["question"] + ANSWER_INSTRUCTION for k in range(2)]


def test_gym_train_and_val_are_disjoint():
  # A question space small enough that the two seeds collide: the exclusion must remove them.
  tasks = ("basic_arithmetic:min_terms=2,max_terms=2,min_digits=1,max_digits=1,operators=+,"
           "format_style=simple,whitespace=single")
  specs = parse_task_spec(tasks)
  data = build_rl_data(tokenizer=FakeTokenizer(), max_prompt_len=1000, seed=0, tasks=tasks,
                       num_train=100, num_val=20)
  val_keys = {item.record.key() for item in data.val}
  train_keys = {record.key() for record, _ in data.train}
  assert len(data.val) == 20 and len(data.train) == 100
  assert val_keys and not val_keys & train_keys
  assert val_keys & {r.key() for r in gym_records(specs, 100, seed=0)}  # without exclusion
  assert data.val[0].record.extra_info["split"] == "val"
  assert gym_records(specs, 20, seed=0, split="val") == [item.record for item in data.val]


# ---- files ---------------------------------------------------------------------------


@pytest.mark.parametrize("writer", [_write_jsonl, _write_parquet])
def test_file_round_trip(tmp_path, writer):
  rows = [_row("a?", "1", "s1", extra_info={"index": 0, "tags": ["x"]}),
          _row("b?", "2", "s2"),
          {"prompt": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "c?"}],
           "reward_model": {"ground_truth": "3", "style": "rule"}, "data_source": "s3"}]
  ext = "jsonl" if writer is _write_jsonl else "parquet"
  records, skipped = load_prompt_file(writer(tmp_path / f"data.{ext}", rows))
  assert skipped == 0 and len(records) == 3
  assert records[0] == PromptRecord(({"role": "user", "content": "a?"},), "1", "s1",
                                    {"index": 0, "tags": ["x"]})
  assert records[1].extra_info == {}  # a null struct in parquet
  assert [m["role"] for m in records[2].prompt] == ["system", "user"]
  assert records[2].ground_truth == "3" and records[2].data_source == "s3"


BAD_ROWS = [
    ({"reward_model": {"ground_truth": "1"}, "data_source": "s"}, "'prompt' missing"),
    (_row(truth=None), "'reward_model.ground_truth' missing"),
    ({"prompt": [{"role": "user", "content": "q"}], "data_source": "s"}, "'reward_model'"),
    (_row(truth=["1", "2"]), "'reward_model.ground_truth' must be a string, got list"),
    ({**_row(), "prompt": "just text"}, "'prompt' must be a non-empty list"),
    ({**_row(), "prompt": [{"role": "user"}]}, "'prompt[0].content'"),
    ({**_row(), "data_source": 7}, "'data_source'"),
]


@pytest.mark.parametrize("bad, fragment", BAD_ROWS)
def test_jsonl_bad_row_fail_names_line_and_field(tmp_path, bad, fragment):
  path = _write_jsonl(tmp_path / "d.jsonl", [_row(), "", bad, _row()])
  with pytest.raises(UserInputError) as e:
    load_prompt_file(path, on_bad_row="fail")
  assert str(e.value).startswith(f"{path}: line 3: field ") and fragment in str(e.value)


def test_bad_rows_skipped_and_counted(tmp_path):
  rows = [_row("ok1")] + [bad for bad, _ in BAD_ROWS] + [_row("ok2")]
  records, skipped = load_prompt_file(_write_jsonl(tmp_path / "d.jsonl", rows), on_bad_row="skip")
  assert [r.prompt[0]["content"] for r in records] == ["ok1", "ok2"]
  assert skipped == len(BAD_ROWS)


def test_parquet_bad_row_names_zero_based_row(tmp_path):
  path = _write_parquet(tmp_path / "d.parquet", [_row(), _row(truth=None)])
  with pytest.raises(UserInputError, match=r"row 1 \(0-based\): field 'reward_model.ground_truth'"):
    load_prompt_file(path)
  assert load_prompt_file(path, on_bad_row="skip")[1] == 1


def test_file_errors(tmp_path):
  with pytest.raises(UserInputError, match="no such file"):
    load_prompt_file(str(tmp_path / "missing.jsonl"))
  with pytest.raises(UserInputError, match=r"line 2: malformed JSON"):
    load_prompt_file(_write_jsonl(tmp_path / "m.jsonl", [_row(), "{not json"]))
  with pytest.raises(UserInputError, match="cannot read parquet"):
    (tmp_path / "x.parquet").write_text("not parquet")
    load_prompt_file(str(tmp_path / "x.parquet"))
  with pytest.raises(UserInputError, match="unknown extension"):
    (tmp_path / "x.csv").write_text("a,b")
    load_prompt_file(str(tmp_path / "x.csv"))
  with pytest.raises(UserInputError, match="no usable rows"):
    load_prompt_file(_write_jsonl(tmp_path / "b.jsonl", [{"x": 1}]), on_bad_row="skip")
  with pytest.raises(UserInputError, match="--on_bad_row"):
    load_prompt_file(_write_jsonl(tmp_path / "g.jsonl", [_row()]), on_bad_row="ignore")


def test_file_held_out_validation(tmp_path):
  path = _write_jsonl(tmp_path / "d.jsonl", [_row(f"q{i}", str(i)) for i in range(10)])
  data = build_rl_data(tokenizer=FakeTokenizer(), max_prompt_len=100, seed=1, train_file=path,
                       num_val=3)
  assert len(data.val) == 3 and len(data.train) == 7
  assert not {i.record.key() for i in data.val} & {r.key() for r, _ in data.train}
  val_file = _write_jsonl(tmp_path / "v.jsonl", [_row("q0", "0"), _row("new", "9")])
  data = build_rl_data(tokenizer=FakeTokenizer(), max_prompt_len=100, seed=1, train_file=path,
                       val_file=val_file)
  assert len(data.val) == 2 and len(data.train) == 9  # q0 kept out of training
  with pytest.raises(UserInputError, match="exactly one"):
    build_rl_data(tokenizer=FakeTokenizer(), max_prompt_len=100, seed=1)


# ---- tokenization --------------------------------------------------------------------


def test_tokenize_filters_long_prompts():
  records = [PromptRecord(({"role": "user", "content": "x" * n},), "1", "t") for n in (3, 10, 5)]
  kept, filtered = tokenize_records(records, FakeTokenizer(), max_prompt_len=7)
  assert filtered == 1 and [len(ids) for _, ids in kept] == [5, 7]
  with pytest.raises(UserInputError) as e:
    tokenize_records(records, FakeTokenizer(), max_prompt_len=4)
  assert "--max_prompt_len=4" in str(e.value) and "none of the 3" in str(e.value)


def test_tokenize_with_real_tiny_tokenizer(tmp_path):
  from tests.hf_fixtures import make_tiny_hf_checkpoint
  from tlt_jax.models.tokenizer import Tokenizer
  model_dir = str(tmp_path / "tiny")
  make_tiny_hf_checkpoint("llama", model_dir)
  tokenizer = Tokenizer.from_dir(model_dir)
  record = PromptRecord(({"role": "user", "content": "1+1?"},), "2", "t")
  [(_, ids)], filtered = tokenize_records([record], tokenizer, max_prompt_len=64)
  assert filtered == 0 and tokenizer.decode(ids) == "<|user|>1+1?\n<|assistant|>"


# ---- grain stream --------------------------------------------------------------------


def test_stream_deterministic_and_epochs_reshuffle():
  pairs = _pairs(10)
  stream = PromptStream(pairs, batch_size=3, seed=5)
  batches = [_indices(stream.next_batch()) for _ in range(9)]  # 3 batches per epoch
  again = PromptStream(pairs, batch_size=3, seed=5)
  assert batches == [_indices(again.next_batch()) for _ in range(9)]
  other = PromptStream(pairs, batch_size=3, seed=6)
  assert batches != [_indices(other.next_batch()) for _ in range(9)]
  epochs = [sum(batches[e * 3:(e + 1) * 3], []) for e in range(3)]
  for epoch in epochs:  # distinct prompts within an epoch, one left out (10 % 3)
    assert len(set(epoch)) == 9
  assert len({tuple(e) for e in epochs}) == 3  # each epoch its own order
  assert stream.epoch == 3 and stream.batches_drawn == 9
  item = PromptStream(pairs, batch_size=3, seed=5).next_batch()[0]
  assert item.record is pairs[item.index][0] and list(item.prompt_ids) == pairs[item.index][1]


@pytest.mark.parametrize("k", [0, 2, 3, 7])
def test_stream_state_restore_continues_exactly(k):
  pairs = _pairs(10)
  uninterrupted = PromptStream(pairs, batch_size=4, seed=11)
  expected = [_indices(uninterrupted.next_batch()) for _ in range(k + 6)]
  first = PromptStream(pairs, batch_size=4, seed=11)
  assert [_indices(first.next_batch()) for _ in range(k)] == expected[:k]
  state = json.loads(json.dumps(first.state()))  # as written to a checkpoint
  resumed = PromptStream(pairs, batch_size=4, seed=11)
  resumed.restore(state)
  assert [_indices(resumed.next_batch()) for _ in range(6)] == expected[k:]


def test_stream_errors():
  pairs = _pairs(5)
  with pytest.raises(UserInputError, match="exceeds the 5 training prompts"):
    PromptStream(pairs, batch_size=6, seed=0)
  state = PromptStream(pairs, batch_size=2, seed=0).state()
  with pytest.raises(UserInputError, match="batch_size=2 but this run has 3"):
    PromptStream(pairs, batch_size=3, seed=0).restore(state)

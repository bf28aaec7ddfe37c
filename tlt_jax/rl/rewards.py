"""Verifiable rewards for GRPO, scored in worker processes off the accelerator.

A reward function is `fn(response, ground_truth, data_source, extra_info) -> float`. The run
picks one with `--reward=NAME`, where NAME is either

  * a registered name: a built-in (`math_verify`, `reasoning_gym`, `format`) or one a user
    module registers with `@register_reward("my_reward")` (that module must be imported
    before the run starts, e.g. by the launcher script), or
  * `module.path:function`: the module is imported and the function used (if the module
    registers rewards, importing it also makes their names usable).

Both are checked when the `RewardSpec` is built, at start-up, before the model loads: the
function must take the four arguments above positionally (`inspect.signature`). Reward
functions run in worker processes, so they must be module-level functions (pickled by
reference); lambdas and nested functions are refused. `RewardPool` scores a batch in those
workers with a per-item timeout; a worker that overruns is killed and replaced, so a stuck
scorer costs one item's reward, never the run. A batch where no item scored and some raised
is the function's fault, not the responses': the learner stops the run
(`require_some_scored`).

Model output is untrusted text: nothing here evals or execs it. Extraction is regexes and a
linear brace scan; math_verify parses LaTeX with an ANTLR grammar and plain expressions with
sympy's parse_expr only after a regex admits digits, whitespace and + - * / ^ ( ) (so no
names reach it); pathological inputs (huge powers) are bounded by the timeouts.
"""
from __future__ import annotations

import collections
import dataclasses
import importlib
import inspect
import json
import math
import multiprocessing
import multiprocessing.connection
import pickle
import re
import signal
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from tlt_jax.errors import UserInputError

RewardFn = Callable[[str, str, str, dict], float]
REWARD_ARGUMENTS = ("response", "ground_truth", "data_source", "extra_info")
START_METHODS = ("spawn", "forkserver")  # not fork: the parent runs JAX threads
# math_verify's own (SIGALRM) limits, per parse/verify call; below the pool's default item
# timeout so a slow comparison usually ends as a plain 0 without a worker restart.
MATH_VERIFY_TIMEOUT_S = 3
_MAX_ERROR_CHARS = 300


# ---- registry --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Registered:
  fn: RewardFn
  warmup: Callable[[], None] | None = None  # run once per worker before it takes items


_REGISTRY: dict[str, _Registered] = {}


def register_reward(name: str, *, warmup: Callable[[], None] | None = None):
  """Decorator making `fn` selectable as `--reward=name`.

  `warmup` (a module-level function, or None) runs once in each worker before it reports
  ready, so slow imports are not charged to the first item's timeout.
  """
  if not name or ":" in name:
    raise ValueError(f"reward name {name!r}: must be non-empty and without ':'")

  def decorator(fn: RewardFn) -> RewardFn:
    old = _REGISTRY.get(name)
    # Re-importing a module (e.g. as __main__ and by name) re-registers the same function.
    if old is not None and _qualified_name(old.fn) != _qualified_name(fn):
      raise ValueError(f"reward {name!r} is already registered to {_qualified_name(old.fn)}")
    _REGISTRY[name] = _Registered(fn, warmup)
    return fn

  return decorator


def _qualified_name(fn: Callable) -> str:
  return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def reward_names() -> list[str]:
  return sorted(_REGISTRY)


def _resolve(name: str) -> _Registered:
  """The registered entry for a name or `module:function`; UserInputError naming --reward."""
  if ":" in name:
    module_name, _, attr = name.partition(":")
    try:
      module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's to fix
      raise UserInputError(f"--reward={name}: cannot import {module_name!r}: "
                           f"{_one_line(e)}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
      raise UserInputError(f"--reward={name}: {module_name!r} has no function {attr!r}")
    entry = next((e for e in _REGISTRY.values() if e.fn is fn), _Registered(fn))
  elif name in _REGISTRY:
    entry = _REGISTRY[name]
  else:
    raise UserInputError(f"--reward={name}: unknown reward (known: {', '.join(reward_names())}; "
                         "or module.path:function)")
  _check_signature(name, entry.fn)
  try:
    pickle.dumps((entry.fn, entry.warmup))
  except Exception as e:  # noqa: BLE001 - lambdas, nested functions, bound objects...
    raise UserInputError(f"--reward={name}: must be a module-level function (it is sent to "
                         f"worker processes): {_one_line(e)}") from None
  return entry


def _check_signature(name: str, fn: Callable) -> None:
  """UserInputError naming --reward unless `fn` can be called as a reward is: with the four
  REWARD_ARGUMENTS positionally, and no other required argument."""
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):
    # A C function without a readable signature: a wrong one fails every item, and a batch
    # where every item fails stops the run (`require_some_scored`).
    return
  try:
    signature.bind(*REWARD_ARGUMENTS)
  except TypeError as e:
    raise UserInputError(
        f"--reward={name}: {getattr(fn, '__name__', 'the function')}{signature} must accept "
        f"the arguments ({', '.join(REWARD_ARGUMENTS)}) positionally: {e}") from None


def get_reward(name: str) -> RewardFn:
  """The reward function for a registered name or `module.path:function`."""
  return _resolve(name).fn


@dataclasses.dataclass(frozen=True)
class RewardSpec:
  """What a step scores: total = reward + format_weight * format (both usually 0 or 1)."""
  name: str
  format_weight: float = 0.0

  def __post_init__(self):
    if not (math.isfinite(self.format_weight) and self.format_weight >= 0):
      raise UserInputError(f"--format_weight={self.format_weight}: must be a finite number >= 0")
    _resolve(self.name)


# ---- answer extraction -----------------------------------------------------------------

_BRACE_TOKEN_RE = re.compile(r"\\(?:boxed|fbox)\s*\{|\\[{}]|[{}]")
_ANSWER_OPEN_RE = re.compile(r"<answer\s*>", re.IGNORECASE)
_ANSWER_CLOSE_RE = re.compile(r"</answer\s*>", re.IGNORECASE)
_MARKER_RE = re.compile(r"final\s+answer|answer\s+is|answer\s*:", re.IGNORECASE)
_MARKER_LEAD_RE = re.compile(r"^[\s*:=]*(?:is\b)?[\s*:=]*", re.IGNORECASE)
_SENTENCE_END_RE = re.compile(r"\.(?:\s|$)")
_NUMBER_RE = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")
_MATH_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
# What may follow a final boxed answer / answer tag for the response to "end with" it.
_TRAILER_RE = re.compile(r"(?:\s|[.,;!*$)\]]|\\\]|\\\)|</answer\s*>)*", re.IGNORECASE)


def _last_boxed(text: str) -> tuple[int, int, str] | None:
  """(start, end, content) of the last complete `\\boxed{...}` (or `\\fbox`), nested braces
  handled; for nested boxes the outer one (it closes last).

  One pass with a brace stack (escaped braces skipped), so a response full of unclosed
  boxes costs linear time.
  """
  stack: list[tuple[int, int] | None] = []  # (start, content start) of box openers
  best: tuple[int, int, str] | None = None
  for m in _BRACE_TOKEN_RE.finditer(text):
    token = m.group()
    if token in ("\\{", "\\}"):
      continue
    if token == "}":
      if stack:
        opener = stack.pop()
        if opener is not None:
          best = (opener[0], m.end(), text[opener[1]:m.start()])
    else:
      stack.append((m.start(), m.end()) if token != "{" else None)
  return best


def _last_match(pattern: re.Pattern, text: str, end: int | None = None) -> re.Match | None:
  matches = list(pattern.finditer(text, 0, len(text) if end is None else end))
  return matches[-1] if matches else None


def _last_answer_tag(text: str) -> tuple[int, str] | None:
  """(end, content) of the last `<answer>...</answer>`."""
  close = _last_match(_ANSWER_CLOSE_RE, text)
  if close is None:
    return None
  opening = _last_match(_ANSWER_OPEN_RE, text, close.start())
  if opening is None:
    return None
  return close.end(), text[opening.end():close.start()]


def _after_marker(text: str) -> str:
  """The sentence after the last "final answer" / "answer is" / "answer:" marker."""
  marker = _last_match(_MARKER_RE, text)
  if marker is None:
    return ""
  rest = _MARKER_LEAD_RE.sub("", text[marker.end():], count=1)
  line = next((s for s in rest.splitlines() if s.strip()), "")
  return _SENTENCE_END_RE.split(line, maxsplit=1)[0]


def _normalize(answer: str) -> str:
  """Strip whitespace, math delimiters, whole-answer `\\boxed{}` wrappers and a final '.'."""
  answer = answer.strip()
  while True:
    before = answer
    for left, right in _MATH_DELIMITERS:
      if (len(answer) >= len(left) + len(right) and answer.startswith(left)
          and answer.endswith(right)):
        answer = answer[len(left):len(answer) - len(right)].strip()
        break
    boxed = _last_boxed(answer)
    if boxed is not None and boxed[0] == 0 and boxed[1] == len(answer):
      answer = boxed[2].strip()
    answer = answer.rstrip(".").strip()
    if answer == before:
      return answer


def extract_answer(response: str) -> str:
  """The final answer in a response: the last `\\boxed{...}`, else the last
  `<answer>...</answer>`, else the sentence after a final-answer marker, else the last
  number; '' when there is none."""
  for found in (_last_boxed(response), _last_answer_tag(response)):
    if found is not None:
      answer = _normalize(found[-1])
      if answer:
        return answer
  answer = _normalize(_after_marker(response))
  if answer:
    return answer
  numbers = _NUMBER_RE.findall(response)
  return numbers[-1].replace(",", "") if numbers else ""


def format_score(response: str) -> float:
  """1.0 if the response ends with a non-empty boxed answer or answer tag (only whitespace,
  punctuation and closing delimiters after it), else 0.0."""
  ends = [found[-2] for found in (_last_boxed(response), _last_answer_tag(response))
          if found is not None and found[-1].strip()]
  if not ends:
    return 0.0
  return 1.0 if _TRAILER_RE.fullmatch(response, max(ends)) else 0.0


# ---- built-in rewards ------------------------------------------------------------------


def _signal_timeout_s() -> int | None:
  """math_verify's timeouts use SIGALRM, which works only in the main thread (true in a
  pool worker); elsewhere they are off and the caller must bound the time (the pool does)."""
  return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _warm_math_verify() -> None:
  math_verify_reward("\\boxed{\\frac{1}{2}}", "0.5", "", {})


@register_reward("math_verify", warmup=_warm_math_verify)
def math_verify_reward(response: str, ground_truth: str, data_source: str,
                       extra_info: dict) -> float:
  """1.0 if the extracted answer equals ground_truth mathematically (math_verify), else 0.0.

  A ground truth math_verify cannot parse raises (counted as an error): it is a data bug.
  """
  from math_verify import parse, verify
  answer = extract_answer(response)
  if not answer:
    return 0.0
  timeout_s = _signal_timeout_s()
  truth = ground_truth.strip()
  gold = parse(truth if ("\\boxed" in truth or "$" in truth) else f"\\boxed{{{truth}}}",
               parsing_timeout=timeout_s)
  if not gold:
    raise ValueError(f"ground truth {ground_truth[:80]!r} is not parseable by math_verify")
  predicted = parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout_s)
  if not predicted:
    return 0.0
  return 1.0 if verify(gold, predicted, timeout_seconds=timeout_s) else 0.0


# (task, JSON of its settings) -> dataset; score_answer is a dataset method and some tasks
# score with their config (e.g. decimal_arithmetic's precision), so one per task + settings.
_GYM_DATASETS: dict[tuple[str, str], Any] = {}


def _gym_dataset(task: str, task_config: dict) -> Any:
  key = (task, json.dumps(task_config, sort_keys=True))
  dataset = _GYM_DATASETS.get(key)
  if dataset is None:
    import reasoning_gym
    from reasoning_gym.factory import DATASETS
    if task not in DATASETS:
      raise ValueError(f"data_source {task!r} is not a reasoning-gym task")
    fields = {f.name for f in dataclasses.fields(DATASETS[task][1])}
    settings = dict(task_config)
    # Scoring reads the entry, not generated items: the smallest deterministic dataset.
    for field, value in (("seed", 0), ("size", 1)):
      if field in fields:
        settings.setdefault(field, value)
    dataset = _GYM_DATASETS[key] = reasoning_gym.create_dataset(task, **settings)
  return dataset


def _warm_reasoning_gym() -> None:
  import reasoning_gym  # noqa: F401 - ~2 s of imports, kept out of the first item's timeout


@register_reward("reasoning_gym", warmup=_warm_reasoning_gym)
def reasoning_gym_reward(response: str, ground_truth: str, data_source: str,
                         extra_info: dict) -> float:
  """The reasoning-gym task's own score_answer(extracted answer, entry).

  data_source is the task name; extra_info["entry"] the entry (question, answer, metadata)
  and extra_info["task_config"] (optional) the task settings it was generated with.
  """
  entry = extra_info.get("entry")
  if not isinstance(entry, dict):
    raise ValueError("extra_info['entry'] is missing: the reasoning_gym reward needs the "
                     "task entry")
  answer = extract_answer(response)
  if not answer:
    return 0.0
  dataset = _gym_dataset(data_source, extra_info.get("task_config") or {})
  return float(dataset.score_answer(answer, entry))


@register_reward("format")
def format_reward(response: str, ground_truth: str, data_source: str,
                  extra_info: dict) -> float:
  """format_score as a reward on its own (ground truth unused)."""
  return format_score(response)


# ---- scoring ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RewardItem:
  """One response to score, with its prompt's record fields."""
  response: str
  ground_truth: str
  data_source: str = ""
  extra_info: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class RewardResult:
  """float32 [n] arrays in item order. rewards = scores + format_weight * format; items that
  raised or timed out have all three 0 and are counted in errors / timeouts."""
  rewards: np.ndarray
  scores: np.ndarray
  format: np.ndarray
  timeouts: int
  errors: int
  first_error: str | None


def _one_line(error: BaseException) -> str:
  text = " ".join(f"{type(error).__name__}: {error}".split())
  return text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS - 3] + "..."


def _score_one(fn: RewardFn, response: str, ground_truth: str, data_source: str,
               extra_info: dict) -> tuple[float, float, str | None]:
  """(score, format, error message or None); a failure scores (0, 0)."""
  try:
    score = float(fn(response, ground_truth, data_source, extra_info))
    if not math.isfinite(score):
      raise ValueError(f"reward is {score}")
    return score, format_score(response), None
  except (KeyboardInterrupt, SystemExit):
    raise
  except BaseException as e:  # noqa: BLE001 - math_verify's TimeoutException is a BaseException
    return 0.0, 0.0, _one_line(e)


def score_in_process(spec: RewardSpec, items: Sequence[RewardItem]) -> RewardResult:
  """The pool's result computed here, without timeouts: for tests and debugging."""
  fn = get_reward(spec.name)
  outcomes = [_score_one(fn, i.response, i.ground_truth, i.data_source, i.extra_info)
              for i in items]
  errors = [e for _, _, e in outcomes if e is not None]
  return _result(spec, np.array([s for s, _, _ in outcomes], np.float32),
                 np.array([f for _, f, _ in outcomes], np.float32), 0, len(errors),
                 errors[0] if errors else None)


def _result(spec: RewardSpec, scores: np.ndarray, formats: np.ndarray, timeouts: int,
            errors: int, first_error: str | None) -> RewardResult:
  rewards = (scores + np.float32(spec.format_weight) * formats).astype(np.float32)
  return RewardResult(rewards, scores, formats, timeouts, errors, first_error)


def require_some_scored(result: RewardResult, name: str) -> None:
  """UserInputError naming --reward when no item of a batch was scored and at least one
  raised: the reward function, not a response, is at fault, and training on all-zero
  rewards would only waste the run. Batches where some items fail, or all time out, go on
  with the faults counted (`reward/errors`, `reward/timeouts`)."""
  n = len(result.rewards)
  if n and result.errors and result.errors + result.timeouts == n:
    raise UserInputError(f"--reward={name}: all {n} responses of a batch failed to score "
                         f"({result.errors} raised, {result.timeouts} timed out); the first: "
                         f"{result.first_error}")


def _worker_main(conn, payload: bytes) -> None:
  """A worker's loop: unpickle the reward (importing its module), warm up, report ready,
  then score (index, item fields) messages until None or the parent's end closes."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
  try:
    fn, warmup = pickle.loads(payload)
    if warmup is not None:
      warmup()
  except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
    conn.send(("failed", _one_line(e)))
    return
  conn.send(("ready",))
  while True:
    try:
      message = conn.recv()
    except (EOFError, OSError):
      return
    if message is None:
      return
    index, *fields = message
    conn.send(("result", index, *_score_one(fn, *fields)))


class _Worker:
  """One worker process and the parent's end of its pipe; at most one item in flight."""

  def __init__(self, context, payload: bytes):
    self.conn, child_conn = context.Pipe(duplex=True)
    self.process = context.Process(target=_worker_main, args=(child_conn, payload),
                                   name="tlt-reward-worker", daemon=True)
    self.process.start()
    child_conn.close()
    self.started_at = time.monotonic()
    self.ready = False
    self.index: int | None = None  # the item in flight
    self.deadline = math.inf

  def kill(self) -> None:
    self.process.kill()  # SIGKILL: also ends a worker stuck inside a C extension
    self.process.join(timeout=10)
    self.conn.close()


class _Batch:
  """One score() call's results as they arrive."""

  def __init__(self, n: int):
    self.scores = np.zeros(n, np.float32)
    self.formats = np.zeros(n, np.float32)
    self.timeouts = 0
    self.errors: list[str] = []

  def on_result(self, worker: _Worker, message: tuple) -> None:
    _, index, score, fmt, error = message
    worker.index, worker.deadline = None, math.inf
    if error is not None:
      self.errors.append(f"item {index}: {error}")
    else:
      self.scores[index], self.formats[index] = score, fmt


class RewardPool:
  """Scores batches with `spec` in `num_workers` worker processes, `timeout_s` per item.

  Workers are started once ('spawn' or 'forkserver', never fork: the parent runs JAX
  threads) and reused across steps. Each takes one item at a time over its own pipe; an item
  that overruns its timeout scores 0 and its worker is killed (SIGKILL) and replaced, as is
  a worker that dies. `score` is serialized by a lock; close() (or `with`) ends the workers.
  """

  def __init__(self, spec: RewardSpec, num_workers: int = 2, timeout_s: float = 10.0,
               start_method: str = "spawn", startup_timeout_s: float = 120.0):
    if num_workers < 1:
      raise UserInputError(f"--reward_workers={num_workers}: must be >= 1")
    if not (math.isfinite(timeout_s) and timeout_s > 0):
      raise UserInputError(f"--reward_timeout_s={timeout_s}: must be a number of seconds > 0")
    if start_method not in START_METHODS:
      raise UserInputError(f"--reward_start_method={start_method!r}: expected one of "
                           f"{', '.join(START_METHODS)}")
    entry = _resolve(spec.name)
    self.spec = spec
    self.num_workers = num_workers
    self.timeout_s = float(timeout_s)
    self.startup_timeout_s = float(startup_timeout_s)
    self.restarts = 0  # workers replaced after a timeout or a crash
    self._payload = pickle.dumps((entry.fn, entry.warmup))
    self._context = multiprocessing.get_context(start_method)
    self._lock = threading.Lock()
    self._closed = False
    self._workers: list[_Worker] = []
    try:
      for _ in range(num_workers):
        self._workers.append(_Worker(self._context, self._payload))
      while not all(w.ready for w in self._workers):
        self._wait_and_receive(on_result=None)
    except BaseException:
      self.close()
      raise

  def __enter__(self) -> RewardPool:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _replace(self, worker: _Worker) -> None:
    worker.kill()
    self._workers[self._workers.index(worker)] = _Worker(self._context, self._payload)
    self.restarts += 1

  def _wait_and_receive(self, on_result) -> list[tuple[int, str]]:
    """Waits for the next message or deadline. Marks workers ready, passes results to
    on_result(worker, message), and replaces workers that died or overran; returns
    (item index, "timeout" or why it died) for the items those workers had in flight."""
    waiting = [w for w in self._workers if w.index is not None or not w.ready]
    if not waiting:
      return []
    next_deadline = min(w.deadline if w.ready else w.started_at + self.startup_timeout_s
                        for w in waiting)
    ready_conns = multiprocessing.connection.wait(
        [w.conn for w in waiting], timeout=max(0.0, next_deadline - time.monotonic()))
    lost: list[tuple[_Worker, str]] = []
    for worker in [w for w in waiting if w.conn in ready_conns]:
      try:
        message = worker.conn.recv()
      except (EOFError, OSError):
        worker.process.join(timeout=10)
        if not worker.ready:
          raise RuntimeError(f"--reward={self.spec.name}: a reward worker exited while starting "
                             f"(exit code {worker.process.exitcode}); see its output above")
        lost.append((worker, f"reward worker died (exit code {worker.process.exitcode})"))
        continue
      if message[0] == "ready":
        worker.ready = True
      elif message[0] == "failed":
        raise UserInputError(f"--reward={self.spec.name}: reward worker failed to start: "
                             f"{message[1]}")
      else:
        on_result(worker, message)
    now = time.monotonic()
    for worker in waiting:
      if not worker.ready and now >= worker.started_at + self.startup_timeout_s:
        raise RuntimeError(f"--reward={self.spec.name}: a reward worker did not start within "
                           f"{self.startup_timeout_s:g} s")
      if worker.index is not None and now >= worker.deadline and all(
          worker is not w for w, _ in lost):
        lost.append((worker, "timeout"))
    for worker, _ in lost:
      self._replace(worker)
    return [(worker.index, reason) for worker, reason in lost if worker.index is not None]

  def score(self, items: Sequence[RewardItem]) -> RewardResult:
    """Scores items; results in item order whatever order the workers finish in."""
    with self._lock:
      if self._closed:
        raise RuntimeError("RewardPool.score: the pool is closed")
      batch = _Batch(len(items))
      try:
        self._run(items, batch)
      except BaseException:
        self.close()  # an interrupted batch leaves stale items in flight: the pool is done
        raise
      return _result(self.spec, batch.scores, batch.formats, batch.timeouts, len(batch.errors),
                     batch.errors[0] if batch.errors else None)

  def _run(self, items: Sequence[RewardItem], batch: _Batch) -> None:
    """Hands pending items to idle workers until each is scored, failed or timed out."""
    pending = collections.deque(range(len(items)))
    while pending or any(w.index is not None for w in self._workers):
      for slot in range(len(self._workers)):
        worker = self._workers[slot]
        while worker.ready and worker.index is None and pending:
          index = pending.popleft()
          item = items[index]
          try:
            worker.conn.send((index, item.response, item.ground_truth, item.data_source,
                              item.extra_info))
          except OSError:  # it died while idle: replace it and retry the item elsewhere
            pending.appendleft(index)
            self._replace(worker)
            break
          except Exception as e:  # noqa: BLE001 - unpicklable extra_info: this item's error
            batch.errors.append(f"item {index}: not picklable: {_one_line(e)}")
            continue
          worker.index, worker.deadline = index, time.monotonic() + self.timeout_s
      for index, reason in self._wait_and_receive(batch.on_result):
        if reason == "timeout":
          batch.timeouts += 1
        else:
          batch.errors.append(f"item {index}: {reason}")

  def close(self) -> None:
    """Ends the workers: idle ones are asked to exit, busy or still-starting ones killed.
    Idempotent."""
    if self._closed:
      return
    self._closed = True
    leaving = []
    for worker in self._workers:
      try:
        if worker.ready and worker.index is None:
          worker.conn.send(None)
          leaving.append(worker)
          continue
      except OSError:
        pass   # its pipe is already broken: the worker is gone or going, kill it below
      worker.kill()
    deadline = time.monotonic() + 2.0
    for worker in leaving:
      worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
      if worker.process.is_alive():
        worker.kill()
      else:
        worker.conn.close()
    self._workers = []

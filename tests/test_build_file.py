"""Keeps the Bazel BUILD file in step with the Python tree.

BUILD is evaluated as Python with a tiny fake Starlark environment (its syntax is the common
subset): the rule functions only record their keyword arguments. No Bazel is needed.
"""

from __future__ import annotations

import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
BUILD = REPO / "BUILD"
# Every Python file under these folders must be a src of some target.
SOURCE_ROOTS = ("tlt_jax", "experiments", "benchmarks", "tests")
RULES = ("py_library", "py_binary", "py_test", "filegroup")


def _glob(include, exclude=(), **_):
  found = {
      p.relative_to(REPO).as_posix()
      for pattern in include
      for p in REPO.glob(pattern)
      if p.is_file()
  }
  dropped = {p.relative_to(REPO).as_posix() for pattern in exclude for p in REPO.glob(pattern)}
  return sorted(found - dropped)


def load_build_targets(path: pathlib.Path = BUILD) -> dict[str, dict]:
  """Evaluates BUILD; returns {target name: {"rule": ..., **kwargs}}."""
  targets: dict[str, dict] = {}

  def rule(kind):
    def record(name, **kwargs):
      if name in targets:
        raise AssertionError(f"BUILD defines target {name!r} twice")
      targets[name] = {"rule": kind, **kwargs}
    return record

  env = {kind: rule(kind) for kind in RULES}
  env.update(
      load=lambda *args, **kwargs: None,
      package=lambda **kwargs: None,
      exports_files=lambda *args, **kwargs: None,
      glob=_glob,
      __builtins__={"sorted": sorted, "len": len, "list": list, "dict": dict},
  )
  exec(compile(path.read_text(), str(path), "exec"), env)  # noqa: S102 - our own file
  return targets


def _python_files_in_repo() -> set[str]:
  return {
      p.relative_to(REPO).as_posix()
      for root in SOURCE_ROOTS
      for p in (REPO / root).rglob("*.py")
      if p.is_file()
  }


def _local_label(dep: str) -> str | None:
  """':foo' or '//:foo' -> 'foo'; external labels ('@...') -> None."""
  if dep.startswith("@"):
    return None
  if dep.startswith("//:"):
    return dep[3:]
  if dep.startswith(":"):
    return dep[1:]
  raise AssertionError(f"unexpected dep label form {dep!r} (use ':name')")


@pytest.fixture(scope="module")
def targets():
  assert BUILD.is_file(), f"missing {BUILD}"
  return load_build_targets()


def _listed_srcs(targets) -> list[str]:
  return [src for t in targets.values() for src in t.get("srcs", [])]


def test_every_python_file_is_in_build(targets):
  missing = sorted(_python_files_in_repo() - set(_listed_srcs(targets)))
  assert not missing, "Python files not listed in any BUILD target's srcs:\n  " + "\n  ".join(missing)


def test_build_lists_only_existing_files(targets):
  ghosts = sorted({src for src in _listed_srcs(targets) if not (REPO / src).is_file()})
  assert not ghosts, "BUILD lists files that do not exist:\n  " + "\n  ".join(ghosts)


def test_each_file_is_in_one_target(targets):
  srcs = _listed_srcs(targets)
  twice = sorted({src for src in srcs if srcs.count(src) > 1})
  assert not twice, "files listed in more than one BUILD target:\n  " + "\n  ".join(twice)


def test_tests_and_binaries_are_well_formed(targets):
  for name, t in targets.items():
    srcs = t.get("srcs", [])
    if t["rule"] == "py_test":
      assert len(srcs) == 1 and pathlib.PurePath(srcs[0]).name.startswith("test_"), (
          f"py_test {name!r} should have exactly one tests/test_*.py src, has {srcs}")
    if t["rule"] == "py_binary":
      main = t.get("main") or (srcs[0] if len(srcs) == 1 else None)
      assert main in srcs, f"py_binary {name!r}: main {main!r} is not among srcs {srcs}"
  for src in _python_files_in_repo():
    if src.startswith("tests/") and pathlib.PurePath(src).name.startswith("test_"):
      owners = [n for n, t in targets.items() if src in t.get("srcs", [])]
      assert all(targets[n]["rule"] == "py_test" for n in owners), (
          f"{src} should be the src of a py_test, is in {owners}")


def test_deps_exist_and_have_no_cycles(targets):
  graph = {}
  for name, t in targets.items():
    local = [label for label in map(_local_label, t.get("deps", [])) if label is not None]
    unknown = [label for label in local if label not in targets]
    assert not unknown, f"target {name!r} depends on undefined targets {unknown}"
    graph[name] = local

  state: dict[str, str] = {}  # name -> "open" | "done"

  def visit(node, path):
    if state.get(node) == "done":
      return
    if state.get(node) == "open":
      cycle = path[path.index(node):] + [node]
      raise AssertionError("dependency cycle in BUILD: " + " -> ".join(cycle))
    state[node] = "open"
    for dep in graph[node]:
      visit(dep, path + [node])
    state[node] = "done"

  for name in graph:
    visit(name, [])

"""Writes docs/configuration.md from the absl flag registry of each entry point.

  python docs/gen_flags.py           # rewrite docs/configuration.md
  python docs/gen_flags.py --check   # exit 1 if docs/configuration.md is out of date

The entry points define flags with the same names (`--model`, `--drafter`, ...), which one
absl registry cannot hold twice, so each module is imported in a subprocess of its own that
prints its flags as JSON. tests/test_docs.py uses the same functions to check that every
flag the docs name exists.
"""
from __future__ import annotations

import ast
import concurrent.futures
import json
import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
OUTPUT = REPO / "docs" / "configuration.md"

# (module, how it is called): the sections of configuration.md, in this order.
ENTRY_POINTS = (
    ("experiments.run", "python -m experiments.run --flagfile=experiments/configs/quickstart.flags "
     "[--FLAG=VALUE ...]"),
    ("experiments.generate", "python -m experiments.generate --prompts_json=F "
     "--output_json=OUT [--FLAG=VALUE ...]"),
    ("experiments.train_drafter", "python -m experiments.train_drafter --out=DIR "
     "[--FLAG=VALUE ...]"),
    ("experiments.export_drafter", "python -m experiments.export_drafter --drafter=DIR "
     "--out=DIR2 [--FLAG=VALUE ...]"),
    ("experiments.ablate", "python -m experiments.ablate --configs=baseline,tlt --steps=N "
     "[--FLAG=VALUE ...]"),
)

# Flags absl's parser handles itself, on every entry point.
ABSL_SPECIAL = frozenset({"flagfile", "undefok", "help", "helpshort", "helpfull", "helpxml"})

# Run in the subprocess: import the module, print every registered flag (absl's own
# included: `--verbosity` is a valid flag of every entry point).
_DUMP = r"""
import importlib, json, sys
from absl import flags
importlib.import_module(sys.argv[1])
out = []
for module, module_flags in flags.FLAGS.flags_by_module_dict().items():
  for f in module_flags:
    required = any("must have a value other than None" in getattr(v, "message", "")
                   for v in f.validators)
    default = f.default
    if not isinstance(default, (str, int, float, bool, list, type(None))):
      default = str(default)
    out.append(dict(name=f.name, module=module, type=f.flag_type(), boolean=f.boolean,
                    default=default, required=required,
                    enum=getattr(f.parser, "enum_values", None), help=f.help))
print(json.dumps(out))
"""


def registered_flags(module: str) -> list[dict]:
  """Every flag registered once `module` is imported (absl's own included), in definition
  order: name, defining module, type, boolean, default, enum values, help."""
  result = subprocess.run([sys.executable, "-c", _DUMP, module], cwd=REPO, capture_output=True,
                          text=True, check=False)
  if result.returncode != 0:
    raise RuntimeError(f"importing {module} failed:\n{result.stderr[-2000:]}")
  return json.loads(result.stdout)


def own_flags(flag_list: list[dict]) -> list[dict]:
  """The flags the project defines (those of absl, orbax and other libraries left out)."""
  return [f for f in flag_list if f["module"].split(".")[0] in ("experiments", "tlt_jax")]


def all_registered(modules) -> dict[str, list[dict]]:
  """registered_flags for several modules, their subprocesses run side by side."""
  modules = list(modules)
  with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
    return dict(zip(modules, pool.map(registered_flags, modules)))


def argparse_flags(path: pathlib.Path) -> set[str]:
  """The `--names` a script passes to argparse's add_argument (read from its source: some
  of these scripts take seconds to import)."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr == "add_argument"):
      for arg in node.args:
        if isinstance(arg, ast.Constant) and str(arg.value).startswith("--"):
          name = arg.value[2:]
          names.update({name, name.replace("-", "_")})
          if any(isinstance(k.value, ast.Attribute) and k.value.attr == "BooleanOptionalAction"
                 for k in node.keywords):
            names.add("no-" + name)
  return names


def _cell(text) -> str:
  return " ".join(str(text).split()).replace("|", "\\|")


def _default(flag: dict) -> str:
  value = flag["default"]
  if flag["required"]:
    return "required"
  if value is None:
    return "unset"
  if isinstance(value, list):
    if not value:
      return "empty"
    value = ",".join(map(str, value))
  if isinstance(value, bool):
    value = str(value).lower()
  return f"`{value}`" if str(value) != "" else "`''`"


def _type(flag: dict) -> str:
  if flag["enum"]:
    return " \\| ".join(flag["enum"])
  if flag["type"].startswith("comma separated list"):
    return "list"
  return flag["type"]


def _help(flag: dict) -> str:
  """The help text, without the `<a|b>: ` that absl puts before an enum's (the type column
  lists the values)."""
  text = flag["help"]
  if flag["enum"]:
    text = re.sub(r"^<[^>]*>:\s*", "", text)
  return _cell(text)


def render(flags_by_module: dict[str, list[dict]]) -> str:
  lines = [
      "# Configuration reference",
      "",
      "<!-- Generated by docs/gen_flags.py from the entry points' absl flags: do not edit by",
      "hand; run `python docs/gen_flags.py` after changing a flag (tests/test_docs.py checks",
      "that this file is current). -->",
      "",
      "Every entry point is an absl app. Flags take `--NAME=VALUE`; a boolean also takes the",
      "bare flag or its `no` form (`--precompile`, `--noprecompile`). `--flagfile=FILE` reads",
      "flags from a file, one per line (the files in `experiments/configs/`), and flags after",
      "it on the command line override the file's. Bad values stop the program before any",
      "long work with exit code 2 and one `error: ...` line. Run a module with `--helpfull`",
      "to see absl's own flags as well.",
      "",
  ]
  for module, usage in ENTRY_POINTS:
    lines += [f"## {module}", "", "```", usage, "```", "",
              "| flag | type | default | meaning |", "|---|---|---|---|"]
    for flag in own_flags(flags_by_module[module]):
      lines.append(f"| `--{flag['name']}` | {_type(flag)} | {_default(flag)} | "
                   f"{_help(flag)} |")
    lines.append("")
  return "\n".join(lines)


def generate() -> str:
  return render(all_registered(module for module, _ in ENTRY_POINTS))


def main(argv: list[str]) -> int:
  text = generate()
  if argv[1:] == ["--check"]:
    if OUTPUT.read_text() != text:
      print(f"{OUTPUT.relative_to(REPO)} is out of date: run python docs/gen_flags.py",
            file=sys.stderr)
      return 1
    return 0
  if argv[1:]:
    print("usage: python docs/gen_flags.py [--check]", file=sys.stderr)
    return 2
  OUTPUT.write_text(text)
  print(f"wrote {OUTPUT.relative_to(REPO)}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))

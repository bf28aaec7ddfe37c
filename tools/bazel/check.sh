#!/usr/bin/env bash
# Builds every target of BUILD with Bazel (docs/build.md): Bazel parses the Starlark,
# resolves every label, finds every listed file and rejects dependency cycles. CI runs it
# after `make test` (.ci/run). Where bazel is missing it installs Debian's bazel-bootstrap
# (Bazel 4.2) with apt-get, as root or through passwordless sudo; where neither can be
# done it says so and skips. Nothing is downloaded by Bazel itself (WORKSPACE).
set -euo pipefail
cd "$(dirname "$0")/../.."

if ! command -v bazel >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    as_root=()
  elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
  else
    as_root=(none)
  fi
  if ! command -v apt-get >/dev/null || [ "${as_root[*]}" = none ]; then
    echo "SKIPPED: bazel is not installed and cannot be here (needs apt-get and root);" \
         "BUILD is checked only by tests/test_build_file.py"
    exit 0
  fi
  echo "installing Debian's bazel-bootstrap ..."
  "${as_root[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq \
    --no-install-recommends bazel-bootstrap >/dev/null
fi
start=$(date +%s)
# --batch: no Bazel server is left running after the check.
bazel --batch build //...
echo "bazel build //...: ok in $(( $(date +%s) - start ))s"

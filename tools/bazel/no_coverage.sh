#!/bin/sh
# See tools/bazel/BUILD: coverage is not collected through Bazel.
echo "tlt_jax: coverage is not collected through Bazel (see docs/build.md)" >&2
exit 1

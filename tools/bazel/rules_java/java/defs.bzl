"""Stand-in for rules_java's java/defs.bzl: the built-in rules that Bazel 4's own tool
packages (@bazel_tools//tools/jdk) load from it."""

java_binary = native.java_binary
java_import = native.java_import
java_library = native.java_library
java_proto_library = native.java_proto_library
java_runtime = native.java_runtime
java_toolchain = native.java_toolchain

#!/usr/bin/env python3
"""The control plane never sees LibTorch (docs/code-map.md): no source file of the coordinator,
the agent, the CLI and client, storage, metrics, data or interop is compiled with LibTorch's
include paths, definitions or precompiled header (build/compile_commands.json), and the
control-plane binaries link no LibTorch library (ldd). A target that picked up LibTorch through
a link dependency fails here, naming the file or binary. The other way round, gRPC is the agent
protocol's alone (loom_agent_grpc): the trainer, which has LibTorch, links no gRPC library.

Includes name their folder: every quoted #include of Loom's own sources is a path from the
repository root ("storage/checkpoint.h"), an API header ("loom/spec.h", api/loom/, with the
generated "loom/v1/*.pb.h"), or one of the headers the build generates; a bare "checkpoint.h"
fails here with its file and line.

The attention-only build (-DLOOM_ATTENTION_ONLY=ON: a GPU machine with only PyTorch, where
scripts/gpu-check runs) has LibTorch, CUDA and the standard library, nothing else: no source it
compiles (cpu_kernels/, plugins/attention/, and the headers they include) includes, directly or through a header of
Loom's, a header of absl, protobuf, gRPC, Boost or the other control-plane libraries; and,
configured here with -DLOOM_ATTENTION_ONLY=ON, no target of it links a Loom library that only the
full build defines (CMake takes an unknown target name for "-lloom_…", which fails at link)."""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

CONTROL_PLANE = ["coordinator/", "worker/agent/", "worker/train_metrics/", "cli/", "client/",
                 "storage/", "metrics/", "data/", "interop/", "console/", "base/"]
GENERATED_HEADERS = {"console_files.h", "interop_files.h"}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def check_includes(source_dir):
    files = subprocess.run(["git", "-C", source_dir, "ls-files", "*.h", "*.cc", "*.cu", "*.cuh"],
                           capture_output=True, text=True, check=True).stdout.split()
    top = {f.split("/")[0] for f in files}
    bad = []
    for f in files:
        with open(os.path.join(source_dir, f)) as fh:
            text = fh.read()
        for m in INCLUDE.finditer(text):
            name = m.group(1)
            first = name.split("/")[0]
            if name in GENERATED_HEADERS or name.startswith("loom/"):
                continue
            if first not in top and "/" in name:
                continue  # a library's own path (absl/..., CLI/..., prometheus/...)
            if not os.path.exists(os.path.join(source_dir, name)):
                line = text.count("\n", 0, m.start()) + 1
                bad.append(f"{f}:{line}: #include \"{name}\"")
    assert len(files) > 200, f"only {len(files)} sources listed"
    assert not bad, "includes that do not name their folder:\n" + "\n".join(bad)
    print(f"ok: the quoted includes of {len(files)} source files name their folder")
ATTENTION_ONLY_DIRS = ("cpu_kernels/", "plugins/attention/")
# Libraries the attention-only build does not have (their include paths' first component).
NOT_IN_ATTENTION_ONLY = {"absl", "google", "grpc", "grpcpp", "boost", "nlohmann", "rocksdb",
                         "CLI", "prometheus", "httplib.h", "curl", "openssl", "sentencepiece",
                         "yaml-cpp", "re2", "pcre2.h", "zstd.h"}
ANY_INCLUDE = re.compile(r'^\s*#\s*include\s+[<"]([^">]+)[">]', re.M)


def check_attention_only(source_dir):
    files = subprocess.run(["git", "-C", source_dir, "ls-files", *ATTENTION_ONLY_DIRS],
                           capture_output=True, text=True, check=True).stdout.split()
    todo = [(f, f) for f in files if f.endswith((".h", ".cc", ".cu", ".cuh"))]
    seen, bad = set(), []
    while todo:
        f, via = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        with open(os.path.join(source_dir, f)) as fh:
            text = fh.read()
        for m in ANY_INCLUDE.finditer(text):
            name = m.group(1)
            if name.split("/")[0] in NOT_IN_ATTENTION_ONLY or name.startswith("loom/v1/"):
                line = text.count("\n", 0, m.start()) + 1
                bad.append(f"{f}:{line}: #include {name}" + (f" (through {via})" if via != f else ""))
            else:  # Loom's own headers: from the root, or the API's from api/
                for own in (name, "api/" + name):
                    if os.path.exists(os.path.join(source_dir, own)):
                        todo.append((own, via))
    assert len(seen) > 50, f"only {len(seen)} attention-only sources"
    assert not bad, ("the attention-only build has none of these libraries:\n" + "\n".join(bad))
    print(f"ok: the {len(seen)} sources and headers of the attention-only build include only "
          "LibTorch, CUDA and the standard library")


def check_attention_only_links(source_dir):
    with tempfile.TemporaryDirectory(prefix="loom-attention-only-") as build:
        generator = "Ninja" if shutil.which("ninja") else "Unix Makefiles"
        r = subprocess.run(["cmake", "-S", source_dir, "-B", build, "-G", generator,
                            "-DLOOM_ATTENTION_ONLY=ON"], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"the attention-only build does not configure:\n{r.stderr[-3000:]}"
        missing = set()
        for root, _, names in os.walk(build):
            for name in names:
                if name in ("build.ninja", "link.txt"):
                    with open(os.path.join(root, name), errors="replace") as f:
                        missing |= set(re.findall(r"-l(loom_\w+)", f.read()))
    assert not missing, ("the attention-only build links Loom libraries it does not build: "
                         + ", ".join(sorted(missing)))
    print("ok: the attention-only build configures and links only its own Loom libraries")


TORCH_MARKERS = ["torch/csrc/api/include", "-DUSE_C10D", "loom_torch_pch", "/ATen", "-DTORCH_"]
BINARIES = ["loom-coordinator", "loom-worker", "loom", "loom-data"]
NO_GRPC_BINARIES = ["loom-train"]  # LibTorch programs: gRPC stays on the control plane


def compiled_sources(path):
    """The sources one compile command compiles: the file itself, or, for a unity build's batch
    (CMake's Unity/unity_N_cxx.cxx), the files it includes."""
    path = os.path.realpath(path)
    if "/Unity/unity_" not in path:
        return [path]
    with open(path) as f:
        return [os.path.realpath(m) for m in re.findall(r'^#include "([^"]+)"', f.read(), re.M)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", required=True)
    ap.add_argument("--source-dir", required=True)
    a = ap.parse_args()
    check_includes(os.path.realpath(a.source_dir))
    check_attention_only(os.path.realpath(a.source_dir))
    check_attention_only_links(os.path.realpath(a.source_dir))
    with open(os.path.join(a.build_dir, "compile_commands.json")) as f:
        commands = json.load(f)
    source = os.path.realpath(a.source_dir) + "/"
    checked, bad = 0, []
    for e in commands:
        command = e.get("command") or " ".join(e.get("arguments", []))
        for path in compiled_sources(os.path.join(e.get("directory", ""), e["file"])):
            rel = path[len(source):] if path.startswith(source) else ""
            if not any(rel.startswith(c) for c in CONTROL_PLANE):
                continue
            checked += 1
            bad += [f"{rel}: {m}" for m in TORCH_MARKERS if m in command]
    assert checked > 40, f"only {checked} control-plane files in compile_commands.json"
    assert not bad, "control-plane sources compiled against LibTorch:\n" + "\n".join(bad)
    print(f"ok: {checked} control-plane source files compiled without LibTorch")
    for name in BINARIES:
        binary = os.path.join(a.build_dir, "bin", name)
        libs = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
        linked = [l.split()[0] for l in libs.splitlines() if "libtorch" in l or "libc10" in l]
        assert not linked, f"{name} links {linked}"
    print(f"ok: {', '.join(BINARIES)} link no LibTorch library")
    for name in NO_GRPC_BINARIES:
        binary = os.path.join(a.build_dir, "bin", name)
        if not os.path.exists(binary):
            continue  # a control-plane-only build
        libs = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
        linked = [l.split()[0] for l in libs.splitlines() if "libgrpc" in l or "libgpr" in l]
        assert not linked, f"{name} links {linked}"
        print(f"ok: {name} links no gRPC library")


if __name__ == "__main__":
    sys.exit(main())

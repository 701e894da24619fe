#!/usr/bin/env python3
"""The control plane never sees LibTorch (docs/code-map.md): no source file of the coordinator,
the agent, the CLI and client, storage, metrics, data or interop is compiled with LibTorch's
include paths, definitions or precompiled header (build/compile_commands.json), and the
control-plane binaries link no LibTorch library (ldd). A target that picked up LibTorch through
a link dependency fails here, naming the file or binary."""
import argparse
import json
import os
import subprocess
import sys

CONTROL_PLANE = ["coordinator/", "worker/agent/", "cli/", "client/", "storage/", "metrics/", "data/",
                 "interop/", "console/"]
TORCH_MARKERS = ["torch/csrc/api/include", "-DUSE_C10D", "loom_torch_pch", "/ATen", "-DTORCH_"]
BINARIES = ["loom-coordinator", "loom-worker", "loom", "loom-data"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", required=True)
    ap.add_argument("--source-dir", required=True)
    a = ap.parse_args()
    with open(os.path.join(a.build_dir, "compile_commands.json")) as f:
        commands = json.load(f)
    source = os.path.realpath(a.source_dir) + "/"
    checked, bad = 0, []
    for e in commands:
        path = os.path.realpath(e["file"])
        rel = path[len(source):] if path.startswith(source) else ""
        if not any(rel.startswith(c) for c in CONTROL_PLANE):
            continue
        checked += 1
        command = e.get("command") or " ".join(e.get("arguments", []))
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


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Every registered test says how much CPU it takes (RESOURCE_GROUPS, cmake/LoomTesting.cmake's
loom_test_cpu): `make test` schedules by those slots, and a test without one would run beside
the others uncounted. The resource file offers two slots per core."""
import argparse
import json
import os
import subprocess
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", required=True)
    ap.add_argument("--ctest", required=True)
    a = ap.parse_args()
    out = subprocess.run([a.ctest, "--show-only=json-v1"], cwd=a.build_dir, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    tests = json.loads(out)["tests"]
    missing, slots = [], {}
    for t in tests:
        groups = [p["value"] for p in t.get("properties", []) if p["name"] == "RESOURCE_GROUPS"]
        if not groups:
            missing.append(t["name"])
            continue
        reqs = [r for g in groups[0] for r in g["requirements"]]
        assert [r[".type"] for r in reqs] == ["cpu"], (t["name"], reqs)
        slots[t["name"]] = reqs[0]["slots"]
    assert not missing, f"tests without loom_test_cpu (RESOURCE_GROUPS): {missing}"
    assert set(slots.values()) <= {1, 2}, slots
    with open(os.path.join(a.build_dir, "ctest-resources.json")) as f:
        spec = json.load(f)
    offered = spec["local"][0]["cpu"][0]["slots"]
    assert offered == 2 * os.cpu_count(), (offered, os.cpu_count())
    light = sorted(n for n, k in slots.items() if k == 1)
    print(f"ok: {len(tests)} tests, each with its CPU slots ({len(light)} light: {', '.join(light)}); "
          f"{offered} slots offered")


if __name__ == "__main__":
    sys.exit(main())

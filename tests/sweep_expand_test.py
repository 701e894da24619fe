#!/usr/bin/env python3
"""`loom sweep expand` and experiments/time_cells.py on real files, with the real binaries.

expand, offline (no coordinator anywhere): the App. D binary file's simplicial cell at seed 3 is
the base spec with exactly the cell's overrides and that seed; the whole file is 30 (cell, seed)
jobs in the file's order; `loom-train train --spec` takes an expanded spec (--print-spec shows
the cell's plugin and FFN width); an unknown cell or seed is a usage error (exit 2) naming the
flag and listing the choices; a bad file names the file. time_cells.py times two cells of a
small sweep (micro models, 5 steps) and prints one row per cell with a positive median.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
APPD = os.path.join(ROOT, "experiments", "relation", "appD-binary-lr1e-3.yaml")

SMALL_SWEEP = """\
name: time-cells-test
base:
  spec: {preset: micro, steps: 5, micro_batch: 4, seq_len: 32, threads: 1,
         model: {n_layers: 2, schedule: [{repeat: 2, attention: {plugin: mha}}]},
         data: {corpus_bytes: 65536}, eval: {batches: 1}}
cells:
  - name: mha
    set: {"model.schedule[0].attention.plugin": mha}
  - name: iha
    set: {"model.schedule[0].attention.plugin": iha}
seeds: [4, 5]
"""


def run(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, timeout=300, **kw)


def expected_simplicial(seed):
    """The App. D file's base spec with the simplicial cell's overrides, read from the YAML."""
    sweep = yaml.safe_load(open(APPD))
    spec = json.loads(json.dumps(sweep["base"]["spec"]))
    cell = next(c for c in sweep["cells"] if c["name"] == "simplicial")
    assert cell["set"] == {"model.schedule[0].attention.plugin": "simplicial", "model.ffn_hidden": 416}
    spec["model"]["schedule"][0]["attention"]["plugin"] = "simplicial"
    spec["model"]["ffn_hidden"] = 416
    spec["seed"] = seed
    return spec


def subset(small, big, where=""):
    """Every field of `small` is in `big` with the same value (the printed spec may add none)."""
    if isinstance(small, dict):
        for k, v in small.items():
            assert k in big, f"{where}.{k} missing from the expanded spec"
            subset(v, big[k], f"{where}.{k}")
    elif isinstance(small, list):
        assert len(small) == len(big), f"{where}: {small} vs {big}"
        for i, (a, b) in enumerate(zip(small, big)):
            subset(a, b, f"{where}[{i}]")
    else:
        assert small == big or (isinstance(small, (int, float)) and float(small) == float(big)), \
            f"{where}: {small!r} in the file, {big!r} expanded"


def test_expand(loom, loom_train, tmp):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOM_COORDINATOR")}
    env["LOOM_COORDINATOR"] = "http://127.0.0.1:9"  # nothing listens: expand must not ask
    one = run([loom, "sweep", "expand", APPD, "--cell", "simplicial", "--seed", "3"], env=env)
    assert one.returncode == 0, one.stderr
    spec = json.loads(one.stdout)
    subset(expected_simplicial(3), spec)
    assert int(spec["seed"]) == 3 and int(spec["steps"]) == 1000000000, spec
    print("ok: the simplicial cell at seed 3 is the base spec with the cell's overrides")

    whole = run([loom, "sweep", "expand", APPD], env=env)
    assert whole.returncode == 0, whole.stderr
    jobs = json.loads(whole.stdout)
    assert [(j["cell"], int(j["seed"])) for j in jobs] == \
        [(c, s) for c in ("mha", "iha-p8", "simplicial") for s in range(1, 11)], jobs[:3]
    assert all(int(j["spec"]["seed"]) == int(j["seed"]) for j in jobs)
    assert jobs[10]["spec"]["model"]["schedule"][0]["attention"] == {"plugin": "iha", "options": {"p": 8}}
    print(f"ok: the whole file expands to {len(jobs)} jobs in the file's order")

    path = os.path.join(tmp, "simplicial.json")
    open(path, "w").write(one.stdout)
    printed = run([loom_train, "train", "--spec", path, "--print-spec"])
    assert printed.returncode == 0, printed.stderr
    assert "simplicial" in printed.stdout and "416" in printed.stdout, printed.stdout[:2000]
    print("ok: loom-train takes the expanded spec")

    for argv, words in (
            (["--cell", "nope"], ["--cell: no cell named 'nope'", "mha; iha-p8; simplicial"]),
            (["--seed", "11"], ["--seed: 11 is not one of the sweep's seeds", "1, 2, 3"]),
            (["--seed", "x"], ["--seed"])):
        bad = run([loom, "sweep", "expand", APPD] + argv, env=env)
        assert bad.returncode == 2, (argv, bad.returncode, bad.stderr)
        for w in words:
            assert w in bad.stderr, (argv, bad.stderr)
    missing = run([loom, "sweep", "expand", os.path.join(tmp, "no-such.yaml")], env=env)
    assert missing.returncode == 2 and "no-such.yaml" in missing.stderr, missing.stderr
    print("ok: unknown cells, seeds and files are usage errors naming them")


def test_time_cells(bin_dir, tmp):
    sweep = os.path.join(tmp, "small.yaml")
    open(sweep, "w").write(SMALL_SWEEP)
    out = run([sys.executable, os.path.join(ROOT, "experiments", "time_cells.py"), sweep,
               "--steps", "5", "--bin", bin_dir, "--keep", os.path.join(tmp, "timing")])
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| mha") or line.startswith("| iha")]
    assert len(rows) == 2, out.stdout
    for row in rows:
        median = float(row.split("|")[2])
        assert median > 0, row
    assert "seed 4" in out.stdout, out.stdout
    assert os.path.exists(os.path.join(tmp, "timing", "iha.jsonl"))
    print("ok: time_cells.py timed both cells:\n" + out.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="loom-sweep-expand-") as tmp:
        test_expand(os.path.join(a.bin, "loom"), os.path.join(a.bin, "loom-train"), tmp)
        test_time_cells(a.bin, tmp)
    print("sweep expand: all checks passed")


if __name__ == "__main__":
    main()

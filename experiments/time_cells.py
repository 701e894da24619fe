#!/usr/bin/env python3
"""Seconds per training step of each cell of a sweep file, measured here: what a sweep will cost
before it is submitted (docs/results.md's App. D cost table is this program's kind of number).

usage: time_cells.py SWEEP_FILE [--steps 30] [--cells a,b] [--seed S] [--set PATH=VALUE ...]
                     [--bin build/bin] [--keep DIR]

Per cell: `loom sweep expand SWEEP_FILE --cell C --seed S` (the job spec the sweep would submit,
offline), then `loom-train train --spec it --steps N` with the --set overrides (e.g. smaller
validation and test splits, a thread count), one cell at a time. The step time is the median
of the JSONL `step_seconds` of steps 3..N (the first two warm up allocators and caches), with
its range; the wall-clock of the whole run is printed beside it. Prints a markdown table.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def expanded(loom, sweep_file):
    """(cell names in the sweep's order, its first seed) from `loom sweep expand`; one cell of
    one seed comes back as its spec alone, named None."""
    run = subprocess.run([loom, "sweep", "expand", sweep_file], capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"time_cells: {run.stderr.strip()}")
    listed = json.loads(run.stdout)
    if isinstance(listed, dict):
        return [None], int(listed["seed"])
    names = []
    for job in listed:
        if job["cell"] not in names:
            names.append(job["cell"])
    return names, int(listed[0]["seed"])


def time_cell(args, cell, work):
    spec_file = os.path.join(work, f"{cell or 'base'}.json")
    expand = [args.loom, "sweep", "expand", args.sweep_file, "--seed", str(args.seed)]
    if cell is not None:
        expand += ["--cell", cell]
    with open(spec_file, "w") as f:
        subprocess.run(expand, check=True, stdout=f)
    metrics = os.path.join(work, f"{cell or 'base'}.jsonl")
    command = [args.loom_train, "train", "--spec", spec_file, "--steps", str(args.steps),
               "--metrics-jsonl", metrics, "--checkpoint-dir", os.path.join(work, f"ck-{cell}")]
    for s in args.set:
        command += ["--set", s]
    start = time.monotonic()
    run = subprocess.run(command, capture_output=True, text=True)
    wall = time.monotonic() - start
    if run.returncode != 0:
        sys.exit(f"time_cells: cell {cell}: loom-train failed ({run.returncode}):\n{run.stderr[-2000:]}")
    steps = [json.loads(line) for line in open(metrics)]
    seconds = [e["step_seconds"] for e in steps if e.get("event") == "step" and e["step"] >= 3]
    if not seconds:
        sys.exit(f"time_cells: cell {cell}: no step past the second (use --steps 3 or more)")
    return statistics.median(seconds), min(seconds), max(seconds), len(seconds), wall


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sweep_file")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--cells", default="", help="comma-separated; default: every cell")
    ap.add_argument("--seed", type=int, default=0, help="default: the sweep's first seed")
    ap.add_argument("--set", action="append", default=[], help="loom-train --set PATH=VALUE")
    ap.add_argument("--bin", default="build/bin", help="where loom and loom-train are")
    ap.add_argument("--keep", default="", help="keep specs, metrics and checkpoints here")
    args = ap.parse_args()
    args.loom = os.path.join(args.bin, "loom")
    args.loom_train = os.path.join(args.bin, "loom-train")
    names, first_seed = expanded(args.loom, args.sweep_file)
    args.seed = args.seed or first_seed
    if args.cells:
        wanted = args.cells.split(",")
        unknown = [c for c in wanted if c not in names]
        if unknown:
            sys.exit(f"time_cells: --cells: no cell {', '.join(unknown)} (cells: {', '.join(map(str, names))})")
        names = wanted
    work = args.keep or tempfile.mkdtemp(prefix="loom-time-cells-")
    os.makedirs(work, exist_ok=True)
    print(f"{args.sweep_file}, seed {args.seed}, {args.steps} steps per cell"
          f"{'; --set ' + ' '.join(args.set) if args.set else ''}\n")
    print("| cell | s per step (median) | range | steps timed | wall s |")
    print("| --- | ---: | --- | ---: | ---: |")
    for cell in names:
        median, low, high, n, wall = time_cell(args, cell, work)
        print(f"| {cell or 'base'} | {median:.4f} | {low:.4f}–{high:.4f} | {n} | {wall:.1f} |",
              flush=True)
    if not args.keep:
        subprocess.run(["rm", "-rf", work])


if __name__ == "__main__":
    main()

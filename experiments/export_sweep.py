#!/usr/bin/env python3
"""Writes a finished sweep's raw per-job results as CSV (one row per job: cell, seed, state,
the held-out value at the sweep's selection for each metric, steps run, wall-clock seconds) so
docs/results.md's tables can be recomputed without the coordinator that ran them.

usage: export_sweep.py --coordinator URL --token-file F --sweep ID --out raw.csv [--length N]
                       [--solved-accuracy X] [--curves curves.csv]
(--length: the end-of-run evaluations at that eval.lengths length instead of the training length's;
--solved-accuracy: add `solved_step`, the first held-out evaluation with accuracy >= X, empty if
none: for tasks that a model solves in a sudden transition, when it happened; --curves: also every
held-out evaluation of every job, one row each, so that `select: reach` at any threshold can be
recomputed. A `select: reach` sweep's rows hold each job's final evaluation. Every row also has
`mean_<metric>`, select mean's value: the metric over the held-out evaluations after step 0.)
"""
import argparse
import csv
import json
import urllib.request


def get(base, token, path):
    req = urllib.request.Request(base + path, headers={"Authorization": "Bearer " + token})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.load(resp)


def curve(evals):
    """One evaluation per (kind, length, step): a resumed attempt evaluates again at the steps
    after its checkpoint, and the latest attempt's evaluation replaces the earlier ones (the
    coordinator's report reads a job the same way)."""
    latest = {}
    for e in evals:
        key = (e.get("kind", ""), int(e.get("length", 0)), int(e.get("step", 0)))
        if key not in latest or int(e.get("attempt", 0)) >= int(latest[key].get("attempt", 0)):
            latest[key] = e
    return [e for e in evals if latest[(e.get("kind", ""), int(e.get("length", 0)), int(e.get("step", 0)))] is e]


CURVE_FIELDS = ["cell", "seed", "job", "step", "eval_loss", "accuracy", "exact_match"]


def held_out_evals(evals):
    """The held-out evaluations at the training length (validation ones under data.splits)."""
    return [e for e in evals if e.get("kind", "") in ("", "heldout", "validation")]


def selected(evals, select, length=0):
    """The evaluation the sweep report reads for `select` and `length` (coordinator/sweep.cc's
    rule)."""
    if length > 0:
        held_out = [e for e in evals if e.get("kind") == "length" and int(e.get("length", 0)) == length]
    else:
        held_out = held_out_evals(evals)
    if select == "test":
        tests = [e for e in evals if e.get("kind") == "test"]
        return tests[-1] if tests else None
    if not held_out:
        return None
    if select == "best":
        return min(held_out, key=lambda e: e.get("eval_loss", 0.0))
    return held_out[-1]  # final, and reach (its steps are in solved_step and the curves)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--token-file", required=True)
    ap.add_argument("--sweep", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--length", type=int, default=0)
    ap.add_argument("--solved-accuracy", type=float, default=None)
    ap.add_argument("--curves", default=None)
    a = ap.parse_args()
    token = open(a.token_file).read().strip()
    sweep = get(a.coordinator, token, f"/v1/sweeps/{a.sweep}")
    select = sweep["spec"].get("select") or "final"
    rows, curves = [], []
    for sj in sweep["jobs"]:
        job = get(a.coordinator, token, f"/v1/jobs/{sj['job_id']}")
        evals = sorted(curve(job.get("evals", [])), key=lambda e: int(e.get("step", 0)))
        e = selected(evals, select, a.length) or {}
        start, end = int(job.get("start_time_ms", 0)), int(job.get("end_time_ms", 0))
        rows.append({
            "cell": sj["cell"], "seed": int(sj["seed"]), "job": sj["job_id"],
            "state": job["state"], "select": select, "length": a.length, "step": int(e.get("step", 0)),
            "eval_loss": e.get("eval_loss", ""), "accuracy": e.get("accuracy", ""),
            "exact_match": e.get("exact_match", ""),
            "steps_run": int(job.get("progress", {}).get("step", 0)),
            "wall_s": round((end - start) / 1000.0, 1) if end and start else "",
        })
        held_out = held_out_evals(evals)
        for h in held_out:
            curves.append({"cell": sj["cell"], "seed": int(sj["seed"]), "job": sj["job_id"],
                           "step": int(h.get("step", 0)), "eval_loss": h.get("eval_loss", ""),
                           "accuracy": h.get("accuracy", ""), "exact_match": h.get("exact_match", "")})
        # select mean's values: each metric over the held-out evaluations after step 0.
        trained = [h for h in held_out if int(h.get("step", 0)) > 0]
        for m in ("eval_loss", "accuracy", "exact_match"):
            values = [float(h.get(m, 0.0)) for h in trained]
            rows[-1]["mean_" + m] = sum(values) / len(values) if values else ""
        if a.solved_accuracy is not None:
            solved = [e for e in held_out if float(e.get("accuracy", 0)) >= a.solved_accuracy]
            rows[-1]["solved_step"] = int(solved[0].get("step", 0)) if solved else ""
    with open(a.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    print(f"{a.out}: {len(rows)} jobs of {a.sweep}")
    if a.curves:  # written even when no job has evaluated yet: readers get the header
        with open(a.curves, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=CURVE_FIELDS)
            w.writeheader()
            w.writerows(curves)
        print(f"{a.curves}: {len(curves)} held-out evaluations")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The analysis pre-registered in experiments/khop/khop-simple-hops3-heads2-confirm.yaml's header,
from the sweep's curves (export_sweep.py --curves): IHA P = 2 (iha-lr1e-3-const) against MHA
(mha-lr1e-3-cos), paired by seed over seeds 17-36. Every difference is IHA - MHA, in points.

usage: report_confirm.py CONFIRM.curves.csv [--json OUT.json] [--allow-incomplete]

Per seed and cell (report_controls.measures): the mean held-out accuracy over the run
(evaluations after step 0 up to 12 000), the final accuracy at 12 000 and the first step at 80 %.
  Primary: mean accuracy over the run, two-sided paired t, alone at alpha 0.05.
  Secondary, Holm among the four: S1 final accuracy, paired t; S2 steps until 80 %, exact sign
  test (never = censored); S3 seeds at 80 % per cell, exact McNemar (sign test on discordant
  pairs); S4 the primary's differences, exact sign-flip test over all 2^n sign assignments.
The script refuses to run unless every pre-registered seed has a complete run in both cells (no
seed is excluded); --allow-incomplete analyses the complete pairs and labels everything
INCOMPLETE.
"""
import argparse
import bisect
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from adjust_pvalues import holm  # noqa: E402
from compare_across import mean_ci, order, paired_t, sign_p  # noqa: E402
from report_controls import BUDGET, THRESHOLD, measures, read_curves  # noqa: E402

NAME = "khop-simple-hops3-heads2-confirm"
IHA, MHA = "iha-lr1e-3-const", "mha-lr1e-3-cos"
SEEDS = list(range(17, 37))
EVAL_STEPS = set(range(500, BUDGET + 1, 500))  # eval.interval 500: every one must be there
ALPHA = 0.05


# ---------------------------------------------------------------- the exact sign-flip test

def signed_sums(xs):
    """The 2^len(xs) sums of xs under every assignment of signs."""
    sums = [0.0]
    for x in xs:
        sums = [s + x for s in sums] + [s - x for s in sums]
    return sums


def signflip_count(d, rel_tol=1e-9):
    """(k, 2^n): k of the 2^n sign assignments of d have |sum| >= the observed |sum| (the same as
    |mean|: n is fixed). Every assignment is counted, in 2^(n/2) binary searches: an
    assignment's sum is a left-half signed sum plus a right-half one. rel_tol absorbs float
    rounding, so that exact ties count as ties."""
    n = len(d)
    obs = abs(sum(d))
    tol = rel_tol * max(1.0, sum(abs(x) for x in d))
    if obs <= tol:
        return 2 ** n, 2 ** n
    left, right = signed_sums(d[: n // 2]), sorted(signed_sums(d[n // 2:]))
    k = 0
    for a in left:  # a + b >= obs, or a + b <= -obs (disjoint: obs > tol)
        k += len(right) - bisect.bisect_left(right, obs - tol - a)
        k += bisect.bisect_right(right, -obs + tol - a)
    return k, 2 ** n


def signflip_p(d):
    k, total = signflip_count(d)
    return k / total


# ---------------------------------------------------------------- reading and checking

def check(curves):
    """The pre-registered (cell, seed) pairs without a complete run; refuses extra cells or seeds
    (a wrong file, not a missing run)."""
    extra = sorted(set(curves) - {IHA, MHA})
    if extra:
        raise SystemExit(f"report_confirm.py: cells not in {NAME}: {', '.join(extra)}")
    missing = []
    for cell in (IHA, MHA):
        seeds = curves.get(cell, {})
        stray = sorted(set(seeds) - set(SEEDS))
        if stray:
            raise SystemExit(f"report_confirm.py: {cell}: seeds {stray} are not the "
                             "pre-registered 17-36")
        long = sorted(s for s, c in seeds.items() if max(c) > BUDGET)
        if long:
            raise SystemExit(f"report_confirm.py: {cell}: seeds {long} ran past step {BUDGET}")
        missing += [(cell, s) for s in SEEDS if s not in seeds or not EVAL_STEPS <= set(seeds[s])]
    return missing


def refuse(missing):
    lines = [f"  {cell} seed {s}" for cell, s in missing]
    raise SystemExit("report_confirm.py: the pre-registered analysis needs every seed 17-36 in "
                     "both cells, run to step 12 000; incomplete:\n" + "\n".join(lines) +
                     "\nRerun (or resume) those jobs with their seeds; --allow-incomplete "
                     "analyses the complete pairs, labelled INCOMPLETE.")


# ---------------------------------------------------------------- the measures

def t_row(mid, label, per, key, seeds):
    d = [100 * (per[IHA][s][key] - per[MHA][s][key]) for s in seeds]
    m, lo, hi, p = paired_t(d)
    return {"id": mid, "label": label, "test": "paired t", "n": len(d), "estimate": m,
            "ci": [lo, hi], "p": p, "differences": d}


def reach_row(per, seeds):
    ra = {s: per[MHA][s]["reach"] for s in seeds}
    rb = {s: per[IHA][s]["reach"] for s in seeds}
    first, later, ties, neither = order(ra, rb)
    return {"id": "reach80", "label": "S2. steps until 80 % (sign test, never = censored)",
            "test": "exact sign", "n": len(seeds), "first": first, "later": later,
            "ties": ties, "unordered": neither, "p": sign_p(first, first + later)}


def seeds80_row(per, seeds):
    ra = {s: per[MHA][s]["reach"] for s in seeds}
    rb = {s: per[IHA][s]["reach"] for s in seeds}
    only_iha, only_mha, _, neither = order(ra, rb, only_one=True)
    return {"id": "seeds80", "label": "S3. seeds reaching 80 % (exact McNemar: discordant pairs)",
            "test": "exact McNemar", "n": len(seeds),
            "iha_reached": sum(v is not None for v in rb.values()),
            "mha_reached": sum(v is not None for v in ra.values()),
            "only_iha": only_iha, "only_mha": only_mha, "neither": neither,
            "p": sign_p(only_iha, only_iha + only_mha)}


def signflip_row(primary):
    d = primary["differences"]
    k, total = signflip_count(d)
    return {"id": "signflip", "label": "S4. mean accuracy over the run (exact sign-flip test)",
            "test": "exact sign-flip", "n": len(d), "estimate": primary["estimate"],
            "extreme": k, "assignments": total, "p": k / total}


def analyse(per, seeds):
    """The primary and the four secondaries (Holm among the secondaries), as dicts."""
    primary = t_row("mean", "Primary. mean accuracy over the run (paired t)", per, "mean", seeds)
    primary["kind"] = "primary"
    rows = [t_row("final", "S1. final accuracy at 12 000 (paired t)", per, "final", seeds),
            reach_row(per, seeds), seeds80_row(per, seeds), signflip_row(primary)]
    for r, h in zip(rows, holm([r["p"] for r in rows])):
        r["kind"], r["holm"] = "secondary", h
    return [primary] + rows


def verdict(primary, incomplete):
    if incomplete:
        return "INCOMPLETE: not the pre-registered test; no verdict."
    if primary["p"] >= ALPHA:
        return f"not confirmed: no significant difference (p {primary['p']:.3g} >= {ALPHA})."
    side = "IHA ahead: confirmed" if primary["estimate"] > 0 else "MHA ahead: reversed"
    return f"{side} (p {primary['p']:.3g} < {ALPHA})."


# ---------------------------------------------------------------- output

def cell_lines(per, seeds):
    lines = ["| cell | seeds | mean accuracy over the run [95 % CI] | final at 12 000 [95 % CI] "
             "| seeds at 80 % |", "| --- | ---: | --- | --- | ---: |"]
    for cell in (IHA, MHA):
        m = [per[cell][s] for s in seeds]
        mean, lo, hi = mean_ci([100 * x["mean"] for x in m])
        fin, flo, fhi = mean_ci([100 * x["final"] for x in m])
        reached = sum(x["reach"] is not None for x in m)
        lines.append(f"| {cell} | {len(m)} | {mean:.1f} [{lo:.1f}, {hi:.1f}] | "
                     f"{fin:.1f} [{flo:.1f}, {fhi:.1f}] | {reached} |")
    return lines


def seed_lines(per, seeds):
    step = lambda v: "never" if v is None else str(v)
    lines = ["| seed | IHA mean | MHA mean | IHA − MHA | IHA final | MHA final | IHA at 80 % "
             "| MHA at 80 % |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in seeds:
        a, b = per[IHA][s], per[MHA][s]
        lines.append(f"| {s} | {100 * a['mean']:.1f} | {100 * b['mean']:.1f} | "
                     f"{100 * (a['mean'] - b['mean']):+.1f} | {100 * a['final']:.1f} | "
                     f"{100 * b['final']:.1f} | {step(a['reach'])} | {step(b['reach'])} |")
    return lines


def estimate(r):
    if r["id"] == "reach80":
        return (f"IHA first {r['first']}, later {r['later']}, ties {r['ties']}, "
                f"neither {r['unordered']}")
    if r["id"] == "seeds80":
        return (f"IHA {r['iha_reached']}, MHA {r['mha_reached']} of {r['n']}; only IHA "
                f"{r['only_iha']}, only MHA {r['only_mha']}")
    if r["id"] == "signflip":
        return f"{r['estimate']:+.2f}; {r['extreme']} of {r['assignments']} assignments"
    return f"{r['estimate']:+.2f} [{r['ci'][0]:+.2f}, {r['ci'][1]:+.2f}]"


def measure_lines(rows):
    lines = ["| measure | n | estimate (IHA − MHA) | p | Holm p (secondaries, 4) |",
             "| --- | ---: | --- | ---: | ---: |"]
    for r in rows:
        h = f"{r['holm']:.3g}" if "holm" in r else "— (alone)"
        lines.append(f"| {r['label']} | {r['n']} | {estimate(r)} | {r['p']:.3g} | {h} |")
    return lines


def report(per, seeds, missing):
    rows = analyse(per, seeds)
    tag = "INCOMPLETE — " if missing else ""
    out = [f"# {tag}{NAME}: {IHA} − {MHA}, seeds {seeds[0]}-{seeds[-1]} ({len(seeds)} pairs)"]
    if missing:
        out.append("INCOMPLETE: missing or unfinished runs: " +
                   ", ".join(f"{c} seed {s}" for c, s in missing))
    out += [""] + cell_lines(per, seeds) + [""] + seed_lines(per, seeds)
    out += ["", "\n".join(measure_lines(rows)), "", f"Primary: {verdict(rows[0], bool(missing))}",
            "The primary also joins the at-a-glance family `glance` (experiments/families.json): "
            "read its Holm p there beside this one."]
    return rows, "\n".join(out)


def write_json(path, per, seeds, missing, rows):
    doc = {"sweep": NAME, "cells": {"iha": IHA, "mha": MHA}, "baseline": MHA,
           "sign": "IHA - MHA, points", "alpha": ALPHA, "incomplete": bool(missing),
           "missing": [[c, s] for c, s in missing], "seeds": seeds,
           "per_seed": {str(s): {c: per[c][s] for c in (IHA, MHA)} for s in seeds},
           "verdict": verdict(rows[0], bool(missing)), "measures": rows}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("curves")
    ap.add_argument("--json", help="also write every per-seed value and measure here")
    ap.add_argument("--allow-incomplete", action="store_true",
                    help="analyse the complete pairs only; the output says INCOMPLETE")
    a = ap.parse_args(argv)
    curves = read_curves(a.curves)
    missing = check(curves)
    if missing and not a.allow_incomplete:
        refuse(missing)
    gone = {s for _, s in missing}
    seeds = [s for s in SEEDS if s not in gone]
    if len(seeds) < 2:
        raise SystemExit(f"report_confirm.py: {len(seeds)} complete pairs, need 2")
    per = {c: {s: measures(curves[c][s]) for s in seeds} for c in (IHA, MHA)}
    rows, text = report(per, seeds, missing)
    print(text)
    if a.json:
        write_json(a.json, per, seeds, missing, rows)


if __name__ == "__main__":
    main()

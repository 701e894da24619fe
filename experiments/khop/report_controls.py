#!/usr/bin/env python3
"""The analysis fixed in experiments/khop/khop-simple-hops3-heads2-controls-mha.yaml's header,
from the two sweeps' curves (export_sweep.py --curves): every held-out evaluation of every job.

usage: report_controls.py MHA.curves.csv IHA.curves.csv [--json OUT.json]   (prints markdown tables)

Per configuration (model, lr, schedule) and seed: the mean held-out accuracy over the run
(evaluations after step 0 up to step 12 000), the final accuracy at step 12 000 and the first
step at 80 %. MHA's "lr 1e-3 constant" is mha-2x's curve up to step 12 000: with a constant rate
the first 12 000 steps of the 24 000-step run are the 12 000-step run. Selection: per model the
configuration with the highest mean over seeds of the mean accuracy. Then the four fixed
measures, Holm-adjusted as one family:
  1. (primary) best IHA - best MHA, mean accuracy over the run, paired t;
  2. best IHA - best MHA, final accuracy, paired t;
  3. best IHA vs best MHA, steps until 80 %, sign test (censored = never);
  4. IHA lr 1e-3 constant at 12 000 steps - MHA at 24 000 (mha-2x), final accuracy, paired t.
"""
import argparse
import csv
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from adjust_pvalues import holm  # noqa: E402
from compare_across import mean_ci, order, paired_t, sign_p  # noqa: E402

BUDGET = 12000
THRESHOLD = 0.8
CONFIGS = [f"lr{lr}-{s}" for s in ("const", "cos") for lr in ("3e-4", "1e-3", "3e-3")]


def read_curves(path):
    """cell -> seed -> {step: accuracy}."""
    out = {}
    for r in csv.DictReader(open(path)):
        out.setdefault(r["cell"], {}).setdefault(int(r["seed"]), {})[int(r["step"])] = float(r["accuracy"])
    return out


def configurations(mha, iha):
    """(model, config) -> seed -> curve up to BUDGET; MHA lr1e-3-const from mha-2x."""
    table = {}
    for model, curves in (("mha", mha), ("iha", iha)):
        for config in CONFIGS:
            cell = "mha-2x" if (model, config) == ("mha", "lr1e-3-const") else f"{model}-{config}"
            if cell not in curves:
                continue
            table[(model, config)] = {s: {st: a for st, a in c.items() if st <= BUDGET}
                                      for s, c in curves[cell].items()}
    return table


def measures(curve):
    evals = [a for st, a in sorted(curve.items()) if st > 0]
    reach = next((st for st, a in sorted(curve.items()) if a >= THRESHOLD), None)
    complete = max(curve) == BUDGET
    return {"mean": sum(evals) / len(evals) if evals else float("nan"),
            "final": curve.get(BUDGET, float("nan")), "reach": reach, "complete": complete}


def paired(a, b):
    """b - a over the seeds both have: n, mean, 95 % CI, two-sided p."""
    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        return len(seeds), float("nan"), (float("nan"), float("nan")), float("nan")
    m, lo, hi, p = paired_t([b[s] - a[s] for s in seeds])
    return len(seeds), m, (lo, hi), p


def cell_table(table, per):
    lines = ["| model | configuration | seeds | mean accuracy over the run [95 % CI] | final at 12 000 "
             "[95 % CI] | seeds at 80 % |", "| --- | --- | ---: | --- | --- | ---: |"]
    for (model, config), seeds in sorted(table.items()):
        m = [per[(model, config)][s] for s in sorted(seeds)]
        done = [x for x in m if x["complete"]]
        if not done:
            continue
        mean, lo, hi = mean_ci([100 * x["mean"] for x in done])
        fin, flo, fhi = mean_ci([100 * x["final"] for x in done])
        reached = sum(x["reach"] is not None for x in done)
        lines.append(f"| {model} | {config} | {len(done)} | {mean:.1f} [{lo:.1f}, {hi:.1f}] | "
                     f"{fin:.1f} [{flo:.1f}, {fhi:.1f}] | {reached} |")
    return lines


def best(per, model):
    """The configuration with the highest mean over seeds of the mean accuracy (complete runs)."""
    scores = {}
    for (m, config), seeds in per.items():
        done = [x["mean"] for x in seeds.values() if x["complete"]]
        if m == model and done:
            scores[config] = (sum(done) / len(done), len(done))
    if not scores:
        return None, scores
    return max(scores, key=lambda c: scores[c][0]), scores


def family(per, mha, bm, bi):
    """The four fixed measures as dicts (id, label, comparison, n, estimate or counts, p), in the
    order of the file's header."""
    out = []
    for column, mid, label in (("mean", "mean", "1. mean accuracy over the run (primary)"),
                               ("final", "final", "2. final accuracy")):
        x = {s: 100 * v[column] for s, v in per[("mha", bm)].items() if v["complete"]}
        y = {s: 100 * v[column] for s, v in per[("iha", bi)].items() if v["complete"]}
        n, mean, ci, p = paired(x, y)
        out.append({"id": mid, "label": label, "comparison": f"best IHA ({bi}) − best MHA ({bm})",
                    "n": n, "estimate": mean, "ci": list(ci), "p": p})
    ra = {s: v["reach"] for s, v in per[("mha", bm)].items() if v["complete"]}
    rb = {s: v["reach"] for s, v in per[("iha", bi)].items() if v["complete"]}
    first, later, ties, unordered = order(ra, rb)
    out.append({"id": "reach80", "label": "3. steps until 80 % (sign test)",
                "comparison": "best IHA vs best MHA", "n": first + later + ties + unordered,
                "first": first, "later": later, "ties": ties, "unordered": unordered,
                "p": sign_p(first, first + later)})
    twice = {s: c for s, c in mha.get("mha-2x", {}).items() if max(c) == 2 * BUDGET}
    x = {s: 100 * c[2 * BUDGET] for s, c in twice.items()}
    y = {s: 100 * v["final"] for s, v in per.get(("iha", "lr1e-3-const"), {}).items() if v["complete"]}
    n, mean, ci, p = paired(x, y)
    out.append({"id": "twice", "label": "4. final accuracy",
                "comparison": "IHA lr 1e-3 const at 12 000 − MHA at 24 000", "n": n,
                "estimate": mean, "ci": list(ci), "p": p,
                "mha_2x_reached_80": sum(any(a >= THRESHOLD for a in c.values())
                                         for c in twice.values()),
                "mha_2x_seeds": len(twice)})
    for m, h in zip(out, holm([1.0 if math.isnan(m["p"]) else m["p"] for m in out])):
        m["holm"] = h
    return out


def family_table(rows):
    lines = ["| measure | comparison | n | estimate | p | Holm p (family of 4) |",
             "| --- | --- | ---: | --- | ---: | ---: |"]
    for m in rows:
        if "first" in m:
            est = f"IHA first {m['first']}, later {m['later']}, ties {m['ties']}, neither {m['unordered']}"
        else:
            est = f"{m['estimate']:+.2f} [{m['ci'][0]:+.2f}, {m['ci'][1]:+.2f}]"
        lines.append(f"| {m['label']} | {m['comparison']} | {m['n']} | {est} | {m['p']:.3g} | "
                     f"{m['holm']:.3g} |")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mha_curves")
    ap.add_argument("iha_curves")
    ap.add_argument("--json", help="also write the selection and the four measures here")
    a = ap.parse_args()
    mha, iha = read_curves(a.mha_curves), read_curves(a.iha_curves)
    table = configurations(mha, iha)
    per = {k: {s: measures(c) for s, c in seeds.items()} for k, seeds in table.items()}
    print("\n".join(cell_table(table, per)))
    bm, mscores = best(per, "mha")
    bi, iscores = best(per, "iha")
    for name, b, scores in (("MHA", bm, mscores), ("IHA", bi, iscores)):
        ranked = ", ".join(f"{c} {100 * v[0]:.1f} (n {v[1]})" for c, v in
                           sorted(scores.items(), key=lambda kv: -kv[1][0]))
        print(f"\nselected {name}: {b}   (mean accuracy over the run by configuration: {ranked})")
    if bm is None or bi is None:
        return
    rows = family(per, mha, bm, bi)
    print("\n" + "\n".join(family_table(rows)))
    print(f"\nMHA at 24 000 steps: {rows[-1]['mha_2x_reached_80']} of {rows[-1]['mha_2x_seeds']} "
          "seeds reached 80 % held-out accuracy.")
    if a.json:
        scores = {m: {c: {"mean_accuracy": v[0], "seeds": v[1]} for c, v in sc.items()}
                  for m, sc in (("mha", mscores), ("iha", iscores))}
        with open(a.json, "w") as f:
            json.dump({"selected": {"mha": bm, "iha": bi}, "scores": scores, "measures": rows},
                      f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Markdown report of a loom-exp-polyfilter run (experiments/polyfilter/theorem3.yaml): Theorem 3
trained directly, MHA with H heads against IHA with H heads and P = H on the polynomial filter
bank [X, AX, ..., A^{k-1}X].

What it prints, by the rules the plan file fixes before the run:
  - one restart per (family, k, model, H, seed): the one with the lowest final train loss;
  - mean held-out relative residual with its 95 % t interval over seeds per cell, next to the
    Eckart-Young floors (ey_bound_heads: the best any H-head MHA can do; ey_bound_rank: IHA's H^2
    rank cap) and the trained residual over its floor;
  - the smallest H whose residual is below the threshold, per seed and for all seeds at once,
    against theory (MHA: k, and the smallest H whose floor is below the threshold; IHA: the
    construction's ceil(sqrt(k)) and the smallest H whose rank floor is below it);
  - IHA - MHA at equal H, paired by seed: 95 % paired-t interval, two-sided p and Holm-adjusted p
    over the comparisons H >= 2 present for both models (H = 1 is MHA's function class for both);
  - checks: held-out against the exact population residual, steps, wall time.
Standard library only (t distribution from experiments/compare_across.py).

usage: report_polyfilter.py RAW.csv [--plan PLAN.yaml] [--threshold 1e-2] [--secondary 1e-3]
"""
import argparse
import csv
import math
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from adjust_pvalues import holm  # noqa: E402
from compare_across import mean_ci, paired_t  # noqa: E402

FLOATS = ["train_loss", "train_residual", "heldout_residual", "population_residual",
          "ey_bound_heads", "ey_bound_rank", "wall_s"]
INTS = ["k", "heads", "pseudo", "params", "seed", "restart", "steps", "rank_cap"]


def read_rows(path):
    rows = []
    for r in csv.DictReader(open(path)):
        for c in FLOATS:
            r[c] = float(r[c])
        for c in INTS:
            r[c] = int(r[c])
        rows.append(r)
    if not rows:
        raise SystemExit(f"{path}: no rows")
    return rows


def plan_thresholds(path):
    """report.threshold and report.secondary_threshold from the plan's YAML text."""
    text = open(path).read()
    found = {}
    for key in ("threshold", "secondary_threshold"):
        m = re.search(r"[{,\s]" + key + r":\s*([0-9.eE+-]+)", text)
        if m:
            found[key] = float(m.group(1))
    return found.get("threshold"), found.get("secondary_threshold")


def select_restarts(rows):
    """(family, k, model, heads, seed) -> the row of the restart with the lowest train loss."""
    best = {}
    for r in rows:
        key = (r["family"], r["k"], r["model"], r["heads"], r["seed"])
        if key not in best or (r["train_loss"], r["restart"]) < (best[key]["train_loss"],
                                                                  best[key]["restart"]):
            best[key] = r
    return best


def e(x):
    return f"{x:.2e}"


def ci(m, lo, hi):
    return f"{e(m)} [{e(lo)}, {e(hi)}]" if not math.isnan(lo) else e(m)


def signed(m, lo, hi):
    return f"{m:+.3g} [{lo:+.3g}, {hi:+.3g}]"


class Report:
    def __init__(self, rows, threshold, secondary):
        self.rows = rows
        self.best = select_restarts(rows)
        self.threshold, self.secondary = threshold, secondary
        self.families = sorted({r["family"] for r in rows})
        self.ks = sorted({r["k"] for r in rows})
        self.seeds = sorted({r["seed"] for r in rows})

    def heads(self, fam, k, model):
        return sorted({h for (f, kk, m, h, _) in self.best if (f, kk, m) == (fam, k, model)})

    def cell(self, fam, k, model, h):
        """seed -> selected row."""
        want = (fam, k, model, h)
        return {key[4]: r for key, r in self.best.items() if key[:4] == want}

    def header(self, raw, plan):
        restarts = sorted({r["restart"] for r in self.rows})
        wall = sum(r["wall_s"] for r in self.rows)
        slow = self.paused()
        print(f"# Theorem 3 directly: `{os.path.basename(raw)}`\n")
        print(f"Plan `{plan or '(not given)'}`; {len(self.rows)} runs: families "
              f"{', '.join(self.families)}, k {self.ks}, seeds {self.seeds}, "
              f"{len(restarts)} restart(s) per (cell, seed), the lower final train loss kept. "
              f"Training wall time, summed over runs: {wall:.0f} s ({wall / 60:.1f} min)"
              + (f"; without the {len(slow)} run(s) over 20 × their cell's median (the process "
                 f"was paused, not computing), {wall - sum(slow):.0f} s" if slow else "") + ". "
              f"Residual: held-out relative residual ‖Ŷ − Y‖_F / ‖Y‖_F on 1024 fresh X. "
              f"Threshold {self.threshold:g} (secondary {self.secondary:g}).\n")

    def paused(self):
        """Wall seconds of the runs that took over 20 x the median of their cell."""
        cells = {}
        for r in self.rows:
            cells.setdefault((r["family"], r["k"], r["model"], r["heads"]), []).append(r["wall_s"])
        out = []
        for walls in cells.values():
            median = sorted(walls)[(len(walls) - 1) // 2]
            out += [w for w in walls if w > 20 * median]
        return out

    def params(self):
        print("## Parameters per (k, model, H)\n")
        print("| k | model | " + " | ".join(f"H {h}" for h in range(1, 17)
                                            if any(r["heads"] == h for r in self.rows)) + " |")
        hs = [h for h in range(1, 17) if any(r["heads"] == h for r in self.rows)]
        print("| --- | --- |" + " ---: |" * len(hs))
        for k in self.ks:
            for model in ("mha", "iha"):
                counts = {r["heads"]: r["params"] for r in self.rows
                          if r["k"] == k and r["model"] == model}
                print(f"| {k} | {model} | " + " | ".join(str(counts.get(h, "")) for h in hs)
                      + " |")
        print()

    def residuals(self, fam, k):
        print(f"### {fam}, k = {k}\n")
        print("| H | MHA residual, mean [95 % CI] | MHA floor (EY, H) | MHA / floor | "
              "IHA residual, mean [95 % CI] | IHA floor (rank H²) | IHA / floor | seeds |")
        print("| ---: | --- | --- | --- | --- | --- | --- | ---: |")
        hs = sorted(set(self.heads(fam, k, "mha")) | set(self.heads(fam, k, "iha")))
        for h in hs:
            parts = []
            n = 0
            for model in ("mha", "iha"):
                c = self.cell(fam, k, model, h)
                if not c:
                    parts += ["not run", "", ""]
                    continue
                n = len(c)
                res = [r["heldout_residual"] for r in c.values()]
                pop = [r["population_residual"] for r in c.values()]
                floor = [r["ey_bound_rank"] for r in c.values()]
                fm = sum(floor) / len(floor)
                ratio = ("—" if fm < 1e-12 else
                         f"{sum(x / f for x, f in zip(pop, floor)) / len(pop):.3g}")
                parts += [ci(*mean_ci(res)), e(fm), ratio]
            print(f"| {h} | " + " | ".join(parts) + f" | {n} |")
        print()

    def smallest(self, fam, k, model, thr):
        per_seed = {}
        for s in self.seeds:
            hit = [h for h in self.heads(fam, k, model)
                   if s in self.cell(fam, k, model, h)
                   and self.cell(fam, k, model, h)[s]["heldout_residual"] < thr]
            per_seed[s] = min(hit) if hit else None
        every = [h for h in self.heads(fam, k, model)
                 if len(self.cell(fam, k, model, h)) == len(self.seeds)
                 and all(r["heldout_residual"] < thr
                         for r in self.cell(fam, k, model, h).values())]
        floor = [h for h in self.heads(fam, k, model)
                 if all(r["ey_bound_rank"] < thr for r in self.cell(fam, k, model, h).values())]
        return per_seed, (min(every) if every else None), (min(floor) if floor else None)

    def reading(self, thr):
        print(f"## Smallest H with held-out residual < {thr:g}\n")
        print("Per seed (seeds " + ", ".join(map(str, self.seeds)) + "); \"all\": the smallest H "
              "at which every seed is below; \"none\": no H of the grid. Theory: MHA k heads "
              "(Theorem 1), IHA ⌈√k⌉ (the construction); \"floor\": the smallest H of the grid "
              "whose Eckart–Young floor (MHA: rank H; IHA: rank H²) is below the threshold on "
              "every seed — no trained model of that H can do better.\n")
        print("| family | k | model | per seed | all seeds | floor allows from | theory |")
        print("| --- | ---: | --- | --- | ---: | ---: | ---: |")
        for fam in self.families:
            for k in self.ks:
                for model in ("mha", "iha"):
                    per_seed, every, floor = self.smallest(fam, k, model, thr)
                    seeds = ", ".join("none" if v is None else str(v) for v in per_seed.values())
                    theory = k if model == "mha" else math.ceil(math.sqrt(k))
                    show = lambda v: "none" if v is None else str(v)  # noqa: E731
                    print(f"| {fam} | {k} | {model} | {seeds} | {show(every)} | {show(floor)} | "
                          f"{theory} |")
        print()

    def comparisons(self):
        keys, stats = [], []
        for fam in self.families:
            for k in self.ks:
                for h in self.heads(fam, k, "iha"):
                    if h < 2 or h not in self.heads(fam, k, "mha"):
                        continue
                    a, b = self.cell(fam, k, "mha", h), self.cell(fam, k, "iha", h)
                    seeds = sorted(set(a) & set(b))
                    d = [b[s]["heldout_residual"] - a[s]["heldout_residual"] for s in seeds]
                    if len(d) < 2:
                        continue  # no interval from one seed
                    keys.append((fam, k, h, len(seeds)))
                    stats.append(paired_t(d))
        adj = holm([s[3] for s in stats])
        print(f"## IHA − MHA at equal H, paired by seed (Holm over {len(keys)} comparisons)\n")
        print("Held-out relative residual; negative: IHA lower. \"Lower\"/\"higher\" only where "
              "the Holm-adjusted p < 0.05; otherwise no significant difference.\n")
        print("| family | k | H | n | IHA − MHA [95 % CI] | p | Holm p | reading |")
        print("| --- | ---: | ---: | ---: | --- | ---: | ---: | --- |")
        for (fam, k, h, n), (m, lo, hi, p), pa in zip(keys, stats, adj):
            word = "no significant difference"
            if pa < 0.05:
                word = "IHA lower" if m < 0 else "IHA higher"
            print(f"| {fam} | {k} | {h} | {n} | {signed(m, lo, hi)} | {p:.2g} | {pa:.2g} | "
                  f"{word} |")
        print()

    def checks(self):
        worst = max(abs(r["heldout_residual"] / r["population_residual"] - 1)
                    for r in self.rows if r["population_residual"] > 1e-9)
        stopped = sum(1 for r in self.rows if r["train_residual"] < 1e-6)
        print("## Checks\n")
        print(f"- Held-out (1024 draws) against the exact population residual: largest relative "
              f"gap {worst:.3g} over runs with population residual > 1e-9.")
        print(f"- Runs stopped early at train residual < 1e-6: {stopped} of {len(self.rows)}.")
        below = [r for r in self.best.values()
                 if r["population_residual"] < r["ey_bound_rank"] * (1 - 1e-6)]
        print(f"- Selected runs below their Eckart–Young floor (population residual): "
              f"{len(below)} (must be 0).")
        for fam in self.families:
            for model in ("mha", "iha"):
                walls = [r["wall_s"] for r in self.rows
                         if r["family"] == fam and r["model"] == model]
                print(f"- {fam}/{model}: {len(walls)} runs, {sum(walls):.0f} s in all.")
        print()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("raw")
    ap.add_argument("--plan", default=None)
    ap.add_argument("--threshold", type=float, default=None)
    ap.add_argument("--secondary", type=float, default=None)
    a = ap.parse_args()
    thr, sec = plan_thresholds(a.plan) if a.plan else (None, None)
    thr = a.threshold if a.threshold is not None else (thr if thr is not None else 1e-2)
    sec = a.secondary if a.secondary is not None else (sec if sec is not None else 1e-3)
    rep = Report(read_rows(a.raw), thr, sec)
    rep.header(a.raw, a.plan)
    rep.params()
    print("## Held-out relative residual against H\n")
    print("Mean over seeds with its 95 % t interval; floor: the Eckart–Young residual of the "
          "model's rank cap (mean over seeds); / floor: the mean of the exact population "
          "residual ÷ floor (1 = the best the model class allows; — where the floor is 0; the held-out "
          "residual, a 1024-draw estimate, can sit a percent below the floor).\n")
    for fam in rep.families:
        for k in rep.ks:
            rep.residuals(fam, k)
    rep.reading(thr)
    rep.reading(sec)
    rep.comparisons()
    rep.checks()


if __name__ == "__main__":
    main()

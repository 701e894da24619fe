#!/usr/bin/env python3
"""Paired comparison of two cells that live in different sweeps, from their exported CSVs (the
coordinator does the same with `loom sweep report ID --baseline SWEEP_ID/CELL`; this script works
offline and checks it independently): cell B of one sweep's raw CSV against baseline cell A of
another's, paired by seed (the same seed gives the same data order in every sweep,
docs/sweeps.md). Prints the statistics a sweep report gives, computed the same way:

  - a per-seed value column (e.g. mean_accuracy, select mean's value, or accuracy, the final one):
    n, the mean difference B - A with its 95% paired-t interval and two-sided p, and a 95%
    percentile bootstrap interval (10000 resamples, fixed seed);
  - with --curves and --threshold: steps until held-out accuracy >= X per seed, which cell got
    there first (seeds that never got there are censored), and the two-sided exact sign test.

usage: compare_across.py A.raw.csv:CELL B.raw.csv:CELL [--column mean_accuracy]
                         [--curves A.curves.csv B.curves.csv --threshold 0.8]
"""
import argparse
import csv
import math
import random


def incomplete_beta(a, b, x):
    """The regularized incomplete beta I_x(a, b), by Lentz's continued fraction (on the side of
    x where it converges fast)."""
    if x <= 0 or x >= 1:
        return max(0.0, min(1.0, x))
    if x > (a + 1) / (a + b + 2):
        return 1 - incomplete_beta(b, a, 1 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) +
                     b * math.log(1 - x)) / a
    f, c, d = 1.0, 1.0, 0.0
    for i in range(400):
        m = i // 2
        if i == 0:
            num = 1.0
        elif i % 2 == 0:
            num = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        else:
            num = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        d = 1 + num * d
        d = 1 / (d if abs(d) > 1e-300 else 1e-300)
        c = 1 + num / (c if abs(c) > 1e-300 else 1e-300)
        f *= c * d
        if abs(1 - c * d) < 1e-15:
            break
    return front * (f - 1)


def t_cdf(x, df):
    """P(T <= x) for Student's t with df degrees of freedom."""
    tail = incomplete_beta(df / 2.0, 0.5, df / (df + x * x))  # P(|T| > |x|)
    return 1 - tail / 2 if x >= 0 else tail / 2


def t_quantile(p, df):
    lo, hi = 0.0, 1000.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def read_cell(spec):
    path, cell = spec.rsplit(":", 1)
    rows = [r for r in csv.DictReader(open(path)) if r["cell"] == cell]
    if not rows:
        raise SystemExit(f"{path}: no rows of cell {cell!r}")
    return path, cell, {int(r["seed"]): r for r in rows}


def paired(a, b, column):
    for rows in (a, b):
        if column not in next(iter(rows.values())):
            raise SystemExit(f"--column {column}: not a column of the raw CSV (export_sweep.py writes "
                             "accuracy, exact_match, eval_loss and their mean_ forms)")
    seeds = sorted(s for s in a if s in b and a[s][column] != "" and b[s][column] != "")
    d = [float(b[s][column]) - float(a[s][column]) for s in seeds]
    n = len(d)
    if n < 2:
        raise SystemExit(f"{column}: {n} paired seeds, need 2")
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    half = t_quantile(0.975, n - 1) * sd / math.sqrt(n)
    p = 2 * (1 - t_cdf(abs(mean) / (sd / math.sqrt(n)), n - 1)) if sd > 0 else (0.0 if mean else 1.0)
    rng = random.Random(1)
    boots = sorted(sum(rng.choice(d) for _ in range(n)) / n for _ in range(10000))
    return seeds, d, mean, (mean - half, mean + half), (boots[249], boots[9749]), p


def first_reach(curves_path, cell, threshold, until=None):
    """seed -> the first step whose held-out accuracy >= threshold (None: censored); until: only
    the evaluations up to that step."""
    out = {}
    for r in csv.DictReader(open(curves_path)):
        if r["cell"] != cell or (until is not None and int(r["step"]) > until):
            continue
        seed, step = int(r["seed"]), int(r["step"])
        out.setdefault(seed, None)
        if float(r["accuracy"]) >= threshold and (out[seed] is None or step < out[seed]):
            out[seed] = step
    return out


def mean_ci(xs):
    """Mean and 95 % t interval (nan bounds for fewer than 2 values)."""
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return m, float("nan"), float("nan")
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    half = t_quantile(0.975, n - 1) * sd / math.sqrt(n)
    return m, m - half, m + half


def paired_t(d):
    """Mean, 95 % interval and two-sided p of paired differences d."""
    n = len(d)
    m, lo, hi = mean_ci(d)
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / (n - 1)) if n > 1 else 0.0
    if sd == 0:
        p = 0.0 if m != 0 else 1.0
    else:
        p = 2 * (1 - t_cdf(abs(m) / (sd / math.sqrt(n)), n - 1))
    return m, lo, hi, p


def order(sa, sb, only_one=False):
    """Seeds on which b reached a level first / later / at the same step / neither (seed -> step,
    None: never). only_one: count only seeds where at most one of them reached it."""
    first = later = ties = unordered = 0
    for s in sorted(set(sa) & set(sb)):
        x, y = sa[s], sb[s]
        if only_one and x is not None and y is not None:
            continue
        if x is None and y is None:
            unordered += 1
        elif y is not None and (x is None or y < x):
            first += 1
        elif x is not None and (y is None or x < y):
            later += 1
        else:
            ties += 1
    return first, later, ties, unordered


def sign_p(k, n):
    """Two-sided exact sign test: k of n seeds one way."""
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(0, min(k, n - k) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("baseline")
    ap.add_argument("other")
    ap.add_argument("--column", default="mean_accuracy")
    ap.add_argument("--curves", nargs=2, default=None)
    ap.add_argument("--threshold", type=float, default=None)
    a = ap.parse_args()
    pa, ca, ra = read_cell(a.baseline)
    pb, cb, rb = read_cell(a.other)
    seeds, d, mean, ci, boot, p = paired(ra, rb, a.column)
    print(f"{cb} ({pb}) - {ca} ({pa}), {a.column}, paired by seed {seeds}:")
    print(f"  per seed: {', '.join(f'{x:+.4f}' for x in d)}")
    print(f"  n {len(d)}  mean diff {mean:+.4f}  95% paired t [{ci[0]:+.4f}, {ci[1]:+.4f}]  "
          f"95% bootstrap [{boot[0]:+.4f}, {boot[1]:+.4f}]  p {p:.3g}")
    if a.curves and a.threshold is not None:
        sa, sb = first_reach(a.curves[0], ca, a.threshold), first_reach(a.curves[1], cb, a.threshold)
        first, later, ties, unordered = order(sa, sb)
        print(f"  steps until accuracy >= {a.threshold}: {cb} {[sb.get(s) for s in seeds]}, "
              f"{ca} {[sa.get(s) for s in seeds]}")
        print(f"  {cb} first {first}, later {later}, ties {ties}, unordered {unordered}; "
              f"sign p {sign_p(first, first + later):.3g}")


if __name__ == "__main__":
    main()

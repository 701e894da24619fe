#!/usr/bin/env python3
"""Does a paired difference change between two settings? From two sweeps' raw CSVs (one per
setting, e.g. context 256 and 512): per seed, cell - baseline within each sweep (paired by seed,
as a sweep report pairs them), then the difference of those differences' means between the two
sweeps with Welch's 95% t interval and two-sided p, and a 95% percentile bootstrap interval
(10000 resamples of each sweep's differences, fixed seed). Welch, not paired: two settings draw
different data, so a seed does not pair across them.

usage: compare_settings.py A.raw.csv B.raw.csv --baseline mha --cell hybrid-iha-p2
                           [--column accuracy] [--scale 100]
"""
import argparse
import math
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_across import paired, read_cell, t_cdf, t_quantile  # noqa: E402


def welch(a, b):
    """mean(b) - mean(a), Welch's 95% interval and p (Welch-Satterthwaite degrees of freedom)."""
    na, nb = len(a), len(b)
    ma, mb = sum(a) / na, sum(b) / nb
    va = sum((x - ma) ** 2 for x in a) / (na - 1)
    vb = sum((x - mb) ** 2 for x in b) / (nb - 1)
    se2 = va / na + vb / nb
    diff = mb - ma
    if se2 == 0:
        return diff, (diff, diff), 0.0 if diff else 1.0, float("inf")
    df = se2 ** 2 / ((va / na) ** 2 / (na - 1) + (vb / nb) ** 2 / (nb - 1))
    half = t_quantile(0.975, df) * math.sqrt(se2)
    p = 2 * (1 - t_cdf(abs(diff) / math.sqrt(se2), df))
    return diff, (diff - half, diff + half), p, df


def bootstrap(a, b):
    rng = random.Random(1)
    mean = lambda xs: sum(xs) / len(xs)
    boots = sorted(mean([rng.choice(b) for _ in b]) - mean([rng.choice(a) for _ in a])
                   for _ in range(10000))
    return boots[249], boots[9749]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("setting_a")
    ap.add_argument("setting_b")
    ap.add_argument("--baseline", required=True)
    ap.add_argument("--cell", required=True)
    ap.add_argument("--column", default="accuracy")
    ap.add_argument("--scale", type=float, default=1.0)
    a = ap.parse_args()
    diffs = []
    for path in (a.setting_a, a.setting_b):
        _, _, base = read_cell(f"{path}:{a.baseline}")
        _, _, other = read_cell(f"{path}:{a.cell}")
        seeds, d, mean, ci, _, p = paired(base, other, a.column)
        d = [x * a.scale for x in d]
        diffs.append(d)
        print(f"{path}: {a.cell} - {a.baseline}, {a.column}, seeds {seeds}: "
              f"{', '.join(f'{x:+.2f}' for x in d)}; mean {mean * a.scale:+.2f} "
              f"[{ci[0] * a.scale:+.2f}, {ci[1] * a.scale:+.2f}], p {p:.3g}")
    diff, ci, p, df = welch(*diffs)
    lo, hi = bootstrap(*diffs)
    print(f"second - first: {diff:+.2f}  95% Welch t [{ci[0]:+.2f}, {ci[1]:+.2f}] (df {df:.1f})  "
          f"95% bootstrap [{lo:+.2f}, {hi:+.2f}]  p {p:.3g}")


if __name__ == "__main__":
    main()

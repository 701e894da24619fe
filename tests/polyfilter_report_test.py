#!/usr/bin/env python3
"""experiments/polyfilter/report_polyfilter.py on a hand-made raw CSV: the restart kept is the
one with the lower train loss, the smallest-H reading per seed and for all seeds, and the paired
IHA - MHA interval and Holm-adjusted p against values worked out by hand (Student's t table).
Standard library only."""
import csv
import math
import os
import re
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "experiments", "polyfilter", "report_polyfilter.py")
HEADER = ("family,k,model,heads,pseudo,params,seed,restart,steps,train_loss,train_residual,"
          "heldout_residual,population_residual,ey_bound_heads,ey_bound_rank,rank_cap,wall_s")
T_975_DF2 = 4.3027  # two-sided 95 % critical value of Student's t, 2 degrees of freedom


def row(model, heads, seed, restart, train_loss, residual, floor=0.0):
    return dict(family="orth", k=4, model=model, heads=heads, pseudo=heads if model == "iha" else 1,
                params=100, seed=seed, restart=restart, steps=10, train_loss=train_loss,
                train_residual=residual, heldout_residual=residual, population_residual=residual,
                ey_bound_heads=floor, ey_bound_rank=floor, rank_cap=heads, wall_s=1.0)


class PolyfilterReportTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.raw = os.path.join(self.dir.name, "t.raw.csv")
        # IHA reaches 1e-3 at H = 2 on every seed; MHA only at H = 4 (seed 3 never, on restart 0,
        # which has the lower train loss: restart 1's tiny residual must not be picked).
        mha2, iha2 = [0.5, 0.6, 0.7], [1e-4, 2e-4, 3e-4]
        rows = []
        for i, seed in enumerate((1, 2, 3)):
            rows.append(row("mha", 2, seed, 0, 1.0, mha2[i], floor=0.4))
            rows.append(row("iha", 2, seed, 0, 1.0, iha2[i]))
            rows.append(row("mha", 4, seed, 0, 0.1, 2e-2 if seed == 3 else 1e-4))
            rows.append(row("mha", 4, seed, 1, 0.2, 1e-9))  # higher train loss: not kept
            rows.append(row("iha", 4, seed, 0, 0.1, 5e-4))
        with open(self.raw, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=HEADER.split(","))
            w.writeheader()
            w.writerows(rows)
        self.mha2, self.iha2 = mha2, iha2

    def tearDown(self):
        self.dir.cleanup()

    def report(self, *args):
        out = subprocess.run([sys.executable, SCRIPT, self.raw, *args], capture_output=True,
                             text=True, timeout=60)
        self.assertEqual(out.returncode, 0, out.stderr)
        return out.stdout

    def test_smallest_heads_per_seed_and_all_seeds(self):
        text = self.report("--threshold", "1e-3", "--secondary", "1e-1")
        section = text.split("## Smallest H with held-out residual < 0.001")[1].split("##")[0]
        self.assertIn("| orth | 4 | mha | 4, 4, none | none | 4 | 4 |", section)
        self.assertIn("| orth | 4 | iha | 2, 2, 2 | 2 | 2 | 2 |", section)

    def test_paired_interval_and_holm(self):
        text = self.report("--threshold", "1e-3")
        d = [b - a for a, b in zip(self.mha2, self.iha2)]
        mean = sum(d) / 3
        sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 2)
        half = T_975_DF2 * sd / math.sqrt(3)
        m = re.search(r"\| orth \| 4 \| 2 \| 3 \| ([-+.\de]+) \[([-+.\de]+), ([-+.\de]+)\] \| "
                      r"([.\de-]+) \| ([.\de-]+) \|", text)
        self.assertIsNotNone(m, text)
        self.assertAlmostEqual(float(m.group(1)), mean, delta=1e-3 * abs(mean))
        self.assertAlmostEqual(float(m.group(2)), mean - half, delta=2e-3 * half)
        self.assertAlmostEqual(float(m.group(3)), mean + half, delta=2e-3 * half)
        # H = 4: differences 4e-4, 4e-4, -1.95e-2; two comparisons, so Holm doubles the smaller p.
        p2, holm2 = float(m.group(4)), float(m.group(5))
        m4 = re.search(r"\| orth \| 4 \| 4 \| 3 \| [^|]+ \| ([.\de-]+) \| ([.\de-]+) \|", text)
        p4, holm4 = float(m4.group(1)), float(m4.group(2))
        lo, hi = sorted([(p2, "2"), (p4, "4")])
        adj_lo = min(1.0, 2 * lo[0])
        adj_hi = max(adj_lo, hi[0])
        got = {"2": holm2, "4": holm4}
        self.assertAlmostEqual(got[lo[1]], adj_lo, delta=0.05 * adj_lo)
        self.assertAlmostEqual(got[hi[1]], adj_hi, delta=0.05 * adj_hi)

    def test_plan_thresholds_are_read(self):
        plan = os.path.join(self.dir.name, "p.yaml")
        with open(plan, "w") as f:
            f.write("report: {threshold: 1.0e-1, secondary_threshold: 1.0e-5}\n")
        text = self.report("--plan", plan)
        self.assertIn("## Smallest H with held-out residual < 0.1", text)
        self.assertIn("## Smallest H with held-out residual < 1e-05", text)


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/env python3
"""The offline analysis scripts behind docs/results.md (experiments/compare_across.py and
compare_settings.py), run as a reader runs them on raw CSVs, against an independent computation:
numpy for means, standard errors and Welch's degrees of freedom, and printed t tables for the
quantiles. Refusals (an unknown cell or column) must name what is wrong."""
import csv
import math
import os
import re
import subprocess
import sys
import tempfile
import unittest

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = os.path.join(ROOT, "experiments")
sys.path.insert(0, EXPERIMENTS)
import compare_across  # noqa: E402

# Two-sided 95% critical values of Student's t (any statistics table).
T_TABLE = {1: 12.7062, 4: 2.7764, 9: 2.2622, 30: 2.0423}
NUM = r"([-+]?\d+\.\d+)"


def write_raw(path, base, other, column="accuracy"):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["cell", "seed", "state", column])
        for seed, (x, y) in enumerate(zip(base, other), start=1):
            w.writerow(["mha", seed, "succeeded", repr(x)])
            w.writerow(["iha-p2", seed, "succeeded", repr(y)])


def run(script, *args):
    return subprocess.run([sys.executable, os.path.join(EXPERIMENTS, script), *args],
                          capture_output=True, text=True, timeout=60)


class AnalysisTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        rng = np.random.default_rng(7)
        self.a_base, self.a_other = rng.uniform(0.3, 0.5, 5), rng.uniform(0.3, 0.6, 5)
        self.b_base, self.b_other = rng.uniform(0.3, 0.5, 6), rng.uniform(0.5, 0.9, 6)
        self.a = os.path.join(self.dir.name, "a.raw.csv")
        self.b = os.path.join(self.dir.name, "b.raw.csv")
        write_raw(self.a, self.a_base, self.a_other)
        write_raw(self.b, self.b_base, self.b_other)

    def tearDown(self):
        self.dir.cleanup()

    def test_t_quantiles_match_the_table(self):
        for df, t in T_TABLE.items():
            self.assertAlmostEqual(compare_across.t_quantile(0.975, df), t, places=3, msg=df)

    def test_paired_difference_matches_numpy(self):
        out = run("compare_across.py", self.a + ":mha", self.a + ":iha-p2", "--column", "accuracy")
        self.assertEqual(out.returncode, 0, out.stderr)
        m = re.search(rf"mean diff {NUM}\s+95% paired t \[{NUM}, {NUM}\].*p {NUM}", out.stdout)
        self.assertIsNotNone(m, out.stdout)
        d = self.a_other - self.a_base
        half = T_TABLE[4] * d.std(ddof=1) / math.sqrt(5)
        self.assertAlmostEqual(float(m.group(1)), d.mean(), places=3)
        self.assertAlmostEqual(float(m.group(2)), d.mean() - half, places=3)
        self.assertAlmostEqual(float(m.group(3)), d.mean() + half, places=3)

    def test_welch_difference_between_settings_matches_numpy(self):
        out = run("compare_settings.py", self.a, self.b, "--baseline", "mha", "--cell", "iha-p2",
                  "--scale", "100")
        self.assertEqual(out.returncode, 0, out.stderr)
        m = re.search(rf"second - first: {NUM}\s+95% Welch t \[{NUM}, {NUM}\] \(df {NUM}\)"
                      rf".*bootstrap \[{NUM}, {NUM}\]\s+p {NUM}", out.stdout)
        self.assertIsNotNone(m, out.stdout)
        da = 100 * (self.a_other - self.a_base)
        db = 100 * (self.b_other - self.b_base)
        va, vb = da.var(ddof=1) / len(da), db.var(ddof=1) / len(db)
        df = (va + vb) ** 2 / (va ** 2 / (len(da) - 1) + vb ** 2 / (len(db) - 1))
        diff, se = db.mean() - da.mean(), math.sqrt(va + vb)
        half = compare_across.t_quantile(0.975, df) * se
        self.assertAlmostEqual(float(m.group(1)), diff, delta=0.01)
        self.assertAlmostEqual(float(m.group(2)), diff - half, delta=0.01)
        self.assertAlmostEqual(float(m.group(3)), diff + half, delta=0.01)
        self.assertAlmostEqual(float(m.group(4)), df, delta=0.05)
        # The settings were drawn 25+ points apart: both intervals exclude 0 and p is small.
        self.assertGreater(float(m.group(2)), 0)
        self.assertGreater(float(m.group(5)), 0)
        self.assertLess(float(m.group(7)), 0.05)

    def test_refusals_name_what_is_wrong(self):
        out = run("compare_settings.py", self.a, self.b, "--baseline", "mha", "--cell", "nope")
        self.assertNotEqual(out.returncode, 0)
        self.assertIn("'nope'", out.stderr)
        out = run("compare_settings.py", self.a, self.b, "--baseline", "mha", "--cell", "iha-p2",
                  "--column", "speed")
        self.assertNotEqual(out.returncode, 0)
        self.assertIn("--column speed", out.stderr)


if __name__ == "__main__":
    unittest.main()

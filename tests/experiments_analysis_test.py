#!/usr/bin/env python3
"""The offline analysis scripts behind docs/results.md (experiments/compare_across.py,
compare_settings.py and adjust_pvalues.py), run as a reader runs them on raw CSVs, against an
independent computation: numpy for means, standard errors and Welch's degrees of freedom, printed
t tables for the quantiles, and Holm / Benjamini-Hochberg adjustments worked out by hand.
Refusals (an unknown cell, column or file) must name what is wrong."""
import csv
import json
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
sys.path.insert(0, os.path.join(EXPERIMENTS, "khop"))
import adjust_pvalues  # noqa: E402
import compare_across  # noqa: E402
import report_confirm  # noqa: E402

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


class AdjustmentTest(unittest.TestCase):
    """Holm (step-down, family-wise error) and Benjamini-Hochberg (false discovery rate)."""

    def test_holm_and_bh_by_hand(self):
        # Sorted: 0.005, 0.01, 0.03, 0.04 (m = 4).
        # Holm: 4 x 0.005 = 0.02; 3 x 0.01 = 0.03; 2 x 0.03 = 0.06; 1 x 0.04 = 0.04 -> running
        # maximum 0.06. BH: 0.005 x 4/1 = 0.02; 0.01 x 4/2 = 0.02; 0.03 x 4/3 = 0.04;
        # 0.04 x 4/4 = 0.04; running minimum from the top changes nothing.
        p = [0.01, 0.04, 0.03, 0.005]
        for got, want in zip(adjust_pvalues.holm(p), [0.03, 0.06, 0.06, 0.02]):
            self.assertAlmostEqual(got, want, places=12)
        for got, want in zip(adjust_pvalues.bh(p), [0.02, 0.04, 0.04, 0.02]):
            self.assertAlmostEqual(got, want, places=12)
        # A running maximum that binds for Holm and a running minimum that binds for BH:
        # sorted 0.01, 0.011, 0.2: Holm 0.03, max(0.022, 0.03) = 0.03, 0.2;
        # BH 0.01 x 3 = 0.03, 0.011 x 3/2 = 0.0165 -> the first becomes min(0.03, 0.0165), 0.2.
        for got, want in zip(adjust_pvalues.holm([0.2, 0.011, 0.01]), [0.2, 0.03, 0.03]):
            self.assertAlmostEqual(got, want, places=12)
        for got, want in zip(adjust_pvalues.bh([0.2, 0.011, 0.01]), [0.2, 0.0165, 0.0165]):
            self.assertAlmostEqual(got, want, places=12)
        self.assertEqual(adjust_pvalues.holm([]), [])
        self.assertEqual(adjust_pvalues.holm([0.3]), [0.3])

    def test_monotone_capped_and_ordered(self):
        rng = np.random.default_rng(11)
        for m in (1, 2, 5, 21, 60):
            p = np.concatenate([rng.uniform(0, 0.05, m // 2), rng.uniform(0, 1, m - m // 2)])
            if m >= 2:
                p[-2:] = [0.9, 0.8]  # 2 x 0.8 > 1: the cap at 1 is reached
            rng.shuffle(p)
            holm = np.array(adjust_pvalues.holm(list(p)))
            bh = np.array(adjust_pvalues.bh(list(p)))
            order = np.argsort(p, kind="stable")
            self.assertTrue(np.all(np.diff(holm[order]) >= 0), m)   # never decreases in p's order
            self.assertTrue(np.all(np.diff(bh[order]) >= 0), m)
            self.assertTrue(np.all(holm <= 1) and np.all(bh <= 1), m)
            self.assertTrue(np.all(holm >= p - 1e-15) and np.all(bh >= p - 1e-15), m)
            self.assertTrue(np.all(bh <= holm + 1e-15), m)           # BH never stricter than Holm
            # Holm by its definition, written independently: the largest (m - j) p_(j) over the
            # ranks j up to i, capped at 1.
            s = p[order]
            want = [min(1.0, max((m - j) * s[j] for j in range(i + 1))) for i in range(m)]
            np.testing.assert_allclose(holm[order], want, rtol=1e-12)
            if m >= 2:
                self.assertEqual(holm.max(), 1.0)


class FamilyFileTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        rng = np.random.default_rng(3)
        self.base, self.other = rng.uniform(0.3, 0.5, 6), rng.uniform(0.4, 0.8, 6)
        write_raw(os.path.join(self.dir.name, "a.raw.csv"), self.base, self.other)
        with open(os.path.join(self.dir.name, "a.curves.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["cell", "seed", "job", "step", "eval_loss", "accuracy", "exact_match"])
            # iha-p2 reaches 0.8 first on seeds 1-4, mha on seed 5, neither on seed 6.
            reach = {1: (1000, 500), 2: (None, 500), 3: (1500, 1000), 4: (None, 1500),
                     5: (500, 1500), 6: (None, None)}
            for seed, steps in reach.items():
                for cell, at in zip(("mha", "iha-p2"), steps):
                    for step in (0, 500, 1000, 1500):
                        acc = 0.9 if at is not None and step >= at else 0.5
                        w.writerow([cell, seed, "j", step, 1.0, acc, 0])

    def tearDown(self):
        self.dir.cleanup()

    def family(self, comparisons, members=None):
        doc = {"comparisons": comparisons,
               "families": [{"id": "f", "name": "F", "contains": "c.", "why": "w.",
                             "members": members or [c["id"] for c in comparisons]}]}
        path = os.path.join(self.dir.name, "families.json")
        with open(path, "w") as f:
            json.dump(doc, f)
        return path

    @staticmethod
    def comp(cid, source, **kw):
        return dict({"id": cid, "label": cid, "measure": "accuracy", "kind": "primary",
                     "source": source}, **kw)

    def test_recomputes_adjusts_and_writes(self):
        t = self.comp("t", {"test": "paired_t", "baseline": "a.raw.csv:mha",
                            "other": "a.raw.csv:iha-p2", "column": "accuracy", "scale": 100})
        sign = self.comp("sign", {"test": "sign", "baseline": "a.curves.csv:mha",
                                  "other": "a.curves.csv:iha-p2", "threshold": 0.8})
        path = self.family([t, sign])
        out_json = os.path.join(self.dir.name, "out.json")
        out_md = os.path.join(self.dir.name, "out.md")
        r = run("adjust_pvalues.py", path, "--json", out_json, "--markdown", out_md)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(out_json) as f:
            out = json.load(f)
        rows = {x["id"]: dict(x, result=out["comparisons"][x["id"]]["result"])
                for x in out["families"][0]["rows"]}
        d = self.other - self.base
        t_stat = d.mean() / (d.std(ddof=1) / math.sqrt(6))
        p_t = compare_across.paired({s: {"v": repr(x)} for s, x in enumerate(self.base)},
                                    {s: {"v": repr(x)} for s, x in enumerate(self.other)}, "v")[5]
        self.assertAlmostEqual(rows["t"]["p"], p_t, places=12)
        self.assertAlmostEqual(rows["t"]["p"], 2 * (1 - compare_across.t_cdf(abs(t_stat), 5)), places=9)
        self.assertAlmostEqual(rows["t"]["result"]["mean"], 100 * d.mean(), places=9)
        # first 4 (seeds 1-4), later 1 (seed 5), unordered 1 (seed 6): two-sided sign p = 6/16.
        res = rows["sign"]["result"]
        self.assertEqual((res["first"], res["later"], res["ties"], res["unordered"]), (4, 1, 0, 1))
        self.assertAlmostEqual(rows["sign"]["p"], 0.375, places=12)
        ps = [rows["t"]["p"], rows["sign"]["p"]]
        for key, fn in (("holm", adjust_pvalues.holm), ("bh", adjust_pvalues.bh)):
            for cid, want in zip(("t", "sign"), fn(ps)):
                self.assertAlmostEqual(rows[cid][key], want, places=12)
        with open(out_md) as f:
            md = f.read()
        self.assertIn("| `sign` |", md)
        self.assertIn("Holm p", md)

    def test_check_against_a_report(self):
        src = {"test": "paired_t", "baseline": "a.raw.csv:mha", "other": "a.raw.csv:iha-p2",
               "column": "accuracy"}
        report = os.path.join(self.dir.name, "r.json")
        with open(report, "w") as f:
            json.dump({"differences": [{"cell": "iha-p2", "p_value": 0.5}]}, f)
        path = self.family([self.comp("t", src, check={"file": "r.json",
                                                        "path": "differences[cell=iha-p2].p_value"})])
        r = run("adjust_pvalues.py", path)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("comparison 't'", r.stderr)
        self.assertIn("r.json says 0.5", r.stderr)
        path = self.family([self.comp("rep", {"test": "report", "file": "r.json",
                                              "path": "differences[cell=iha-p2].p_value"})])
        r = run("adjust_pvalues.py", path)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("| 0.50 |", r.stdout)

    def test_refusals_name_what_is_wrong(self):
        good = {"test": "paired_t", "baseline": "a.raw.csv:mha", "other": "a.raw.csv:iha-p2",
                "column": "accuracy"}
        cases = [
            (dict(good, column="speed"), ["comparison 'x'", "'speed'", "a.raw.csv"]),
            (dict(good, other="a.raw.csv:nope"), ["comparison 'x'", "'nope'", "a.raw.csv"]),
            (dict(good, baseline="missing.raw.csv:mha"), ["comparison 'x'", "'missing.raw.csv'"]),
            ({"test": "sign", "baseline": "a.curves.csv:mha", "other": "a.curves.csv:nope",
              "threshold": 0.8}, ["'nope'", "a.curves.csv"]),
            (dict(good, test="anova"), ["'anova'"]),
        ]
        for source, needles in cases:
            r = run("adjust_pvalues.py", self.family([self.comp("x", source)]))
            self.assertNotEqual(r.returncode, 0, source)
            for n in needles:
                self.assertIn(n, r.stderr, source)
        r = run("adjust_pvalues.py", self.family([self.comp("x", good)], members=["x", "y"]))
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("'y'", r.stderr)


class CommittedFamiliesTest(unittest.TestCase):
    """experiments/families.json recomputes from the committed CSVs (every report check passes) and
    docs/results-families.md is its current output."""

    def test_committed_tables_are_current(self):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "families.md")
            r = run("adjust_pvalues.py", os.path.join(EXPERIMENTS, "families.json"),
                    "--markdown", out)
            self.assertEqual(r.returncode, 0, r.stderr)
            with open(out) as f, open(os.path.join(ROOT, "docs", "results-families.md")) as g:
                self.assertEqual(f.read(), g.read(), "regenerate docs/results-families.md "
                                 "(the command is at the top of docs/results.md)")


class KhopControlsTest(unittest.TestCase):
    """experiments/khop/report_controls.py on synthetic curves: the selection rule, MHA's lr 1e-3
    constant read from mha-2x's first 12 000 steps, and the primary paired t against numpy; and
    adjust_pvalues.py's "until" reading the same curves to the same p (checked against the
    script's JSON, as experiments/families.json does)."""

    def setUp(self):
        rng = np.random.default_rng(3)
        steps = list(range(0, 12001, 500))
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)
        self.paths = [os.path.join(self.dir.name, n) for n in ("mha.curves.csv", "iha.curves.csv")]
        level = {"lr3e-4": 0.2, "lr1e-3": 0.3, "lr3e-3": 0.25}
        self.means = {}
        for path, model, bonus in ((self.paths[0], "mha", 0.0), (self.paths[1], "iha", 0.4)):
            with open(path, "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["cell", "seed", "job", "step", "eval_loss", "accuracy", "exact_match"])
                for lr, base in level.items():
                    for sched in ("const", "cos"):
                        self.write_cell(w, rng, steps, model, lr, sched, base + bonus)

    def write_cell(self, w, rng, steps, model, lr, sched, level):
        cell = f"{model}-{lr}-{sched}"
        if (model, lr, sched) == ("mha", "lr1e-3", "const"):
            cell = "mha-2x"
        for seed in range(7, 12):
            accs = level + rng.uniform(0, 0.1, len(steps))
            points = list(zip(steps, accs))
            if cell == "mha-2x":  # the second 12 000 steps must not count
                points += [(12000 + s, 0.99) for s in steps[1:]]
            for step, a in points:
                w.writerow([cell, seed, "j", step, 0, repr(float(a)), 0])
            self.means[(model, lr, sched, seed)] = float(np.mean(accs[1:]))

    def test_selection_and_primary_measure(self):
        report = os.path.join(self.dir.name, "controls.json")
        out = run("khop/report_controls.py", *self.paths, "--json", report)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("selected MHA: lr1e-3-const", out.stdout)
        self.assertIn("selected IHA: lr1e-3-", out.stdout)
        chosen = re.search(r"selected IHA: (lr1e-3-\w+)", out.stdout).group(1).split("-")[-1]
        diff = [100 * (self.means[("iha", "lr1e-3", chosen, s)] - self.means[("mha", "lr1e-3", "const", s)])
                for s in range(7, 12)]
        row = next(line for line in out.stdout.splitlines() if line.startswith("| 1."))
        self.assertIn(f"{np.mean(diff):+.2f}", row)
        self.assertIn("MHA at 24 000 steps: 5 of 5 seeds reached 80 %", out.stdout)
        with open(report) as f:
            doc = json.load(f)
        self.assertEqual(doc["selected"], {"mha": "lr1e-3-const", "iha": f"lr1e-3-{chosen}"})
        self.assertEqual([m["id"] for m in doc["measures"]], ["mean", "final", "reach80", "twice"])
        self.assertAlmostEqual(doc["measures"][0]["estimate"], np.mean(diff), places=9)
        self.assertEqual(doc["measures"][3]["mha_2x_reached_80"], 5)
        self.assert_families_agree(chosen, doc)

    def assert_families_agree(self, chosen, doc):
        """The primary and the 80 % measure through adjust_pvalues.py, mha-2x read up to 12 000."""
        def comp(cid, source):
            return {"id": cid, "label": cid, "measure": cid, "kind": "primary", "source": source,
                    "check": {"file": "controls.json", "path": f"measures[id={cid}].p"}}
        pair = {"baseline": "mha.curves.csv:mha-2x", "other": f"iha.curves.csv:iha-lr1e-3-{chosen}"}
        comps = [comp("mean", dict(pair, test="paired_t", column="accuracy", until=12000,
                                   baseline=pair["baseline"] + "@mean",
                                   other=pair["other"] + "@mean")),
                 comp("reach80", dict(pair, test="sign", threshold=0.8, until=12000))]
        path = os.path.join(self.dir.name, "families.json")
        for until, ok in ((12000, True), (None, False)):
            for c in comps:
                c["source"]["until"] = until
            with open(path, "w") as f:
                json.dump({"comparisons": comps, "families": [
                    {"id": "f", "name": "F", "contains": "c", "why": "w",
                     "members": ["mean", "reach80"]}]}, f)
            r = run("adjust_pvalues.py", path, "--json", os.path.join(self.dir.name, "adj.json"))
            if ok:
                self.assertEqual(r.returncode, 0, r.stderr)
            else:  # reading mha-2x's second 12 000 steps too changes the p: the check refuses
                self.assertNotEqual(r.returncode, 0)
                self.assertIn("controls.json says", r.stderr)


def t_two_sided_p(t, df):
    """Student's t two-sided p by the closed forms of Abramowitz & Stegun 26.7.3 (odd df) and
    26.7.4 (even df): independent of compare_across's continued fraction (no scipy here)."""
    try:
        from scipy import stats
        return float(2 * stats.t.sf(abs(t), df))
    except ImportError:
        pass
    th = math.atan(abs(t) / math.sqrt(df))
    c2 = math.cos(th) ** 2
    k, term, total = (1, math.cos(th), 0.0) if df % 2 else (0, 1.0, 0.0)
    while k <= df - 2:
        total += term
        term *= c2 * (k + 1) / (k + 2)
        k += 2
    inside = 2 / math.pi * (th + math.sin(th) * total) if df % 2 else math.sin(th) * total
    return 1 - inside


def holm_by_definition(p):
    """The largest (m - j) p_(j) over the ranks j up to each p's own, capped at 1."""
    m, order = len(p), sorted(range(len(p)), key=lambda i: p[i])
    out = [0.0] * m
    for rank, i in enumerate(order):
        out[i] = min(1.0, max((m - j) * p[order[j]] for j in range(rank + 1)))
    return out


def signflip_brute(d):
    """Every one of the 2^n sign assignments, in chunks (2^20 x 20 at once is 160 MB)."""
    d = np.asarray(d, dtype=float)
    n, obs, hits = len(d), abs(d.sum()), 0
    for start in range(0, 2 ** n, 2 ** 16):
        idx = np.arange(start, min(start + 2 ** 16, 2 ** n))
        signs = 1 - 2 * ((idx[:, None] >> np.arange(n)) & 1)
        hits += int(np.sum(np.abs(signs @ d) >= obs - 1e-9))
    return hits / 2 ** n


class KhopConfirmTest(unittest.TestCase):
    """experiments/khop/report_confirm.py (issue 76's pre-registered confirmation) on synthetic
    curves with known answers: the primary paired t against a closed-form t distribution, the
    sign test and McNemar counts by hand, the sign-flip test by hand and by brute force, Holm over
    the four secondaries, and the refusal to run without every seed."""

    STEPS = list(range(0, 12001, 500))
    # seed -> (IHA's first step at 80 %, MHA's): None never. By hand, for S2 (sign test):
    # IHA first on 17-28 (12), MHA first on 29, 30 and 32 (3), tie on 31, neither on 33-36:
    # p = 2 (C(15,0) + C(15,1) + C(15,2) + C(15,3)) / 2^15 = 2 x 576 / 32768 = 0.03515625.
    # S3 (McNemar): only IHA reached on 17-28 (12), only MHA on 32 (1):
    # p = 2 (C(13,0) + C(13,1)) / 2^13 = 28 / 8192 = 0.00341796875.
    REACH = {**{s: (4000, None) for s in range(17, 29)},
             29: (6000, 3000), 30: (6000, 3000), 31: (5000, 5000), 32: (None, 8000),
             **{s: (None, None) for s in range(33, 37)}}

    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)
        self.path = os.path.join(self.dir.name, "confirm.curves.csv")
        rng = np.random.default_rng(5)
        self.curves = {}
        for seed, reach in self.REACH.items():
            for cell, at in zip((report_confirm.IHA, report_confirm.MHA), reach):
                low = rng.uniform(0.25, 0.40, len(self.STEPS))
                high = rng.uniform(0.85, 0.99, len(self.STEPS))
                above = np.array(self.STEPS) >= (at if at is not None else math.inf)
                self.curves[(cell, seed)] = np.where(above, high, low)
        self.write(self.curves)

    def write(self, curves, skip=lambda cell, seed, step: False):
        with open(self.path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["cell", "seed", "job", "step", "eval_loss", "accuracy", "exact_match"])
            for (cell, seed), accs in curves.items():
                for step, a in zip(self.STEPS, accs):
                    if not skip(cell, seed, step):
                        w.writerow([cell, seed, "j", step, 1.0, repr(float(a)), 0])

    def diffs(self, column):
        """IHA - MHA in points per seed: column 'mean' (steps 500-12 000) or 'final'."""
        pick = (lambda a: np.mean(a[1:])) if column == "mean" else (lambda a: a[-1])
        return np.array([100 * (pick(self.curves[(report_confirm.IHA, s)]) -
                                pick(self.curves[(report_confirm.MHA, s)])) for s in self.REACH])

    def report(self, *args):
        out = os.path.join(self.dir.name, "confirm.json")
        r = run("khop/report_confirm.py", self.path, "--json", out, *args)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(out) as f:
            return r.stdout, {m["id"]: m for m in json.load(f)["measures"]}, out

    def test_primary_and_secondaries_against_known_answers(self):
        stdout, m, _ = self.report()
        for mid, column in (("mean", "mean"), ("final", "final")):
            d = self.diffs(column)
            t = d.mean() / (d.std(ddof=1) / math.sqrt(len(d)))
            self.assertEqual(m[mid]["n"], 20)
            self.assertAlmostEqual(m[mid]["estimate"], d.mean(), places=9)
            self.assertAlmostEqual(m[mid]["p"], t_two_sided_p(t, 19), places=9)
        self.assertEqual((m["reach80"]["first"], m["reach80"]["later"], m["reach80"]["ties"],
                          m["reach80"]["unordered"]), (12, 3, 1, 4))
        self.assertAlmostEqual(m["reach80"]["p"], 0.03515625, places=12)
        self.assertEqual((m["seeds80"]["iha_reached"], m["seeds80"]["mha_reached"],
                          m["seeds80"]["only_iha"], m["seeds80"]["only_mha"]), (15, 4, 12, 1))
        self.assertAlmostEqual(m["seeds80"]["p"], 0.00341796875, places=12)
        self.assertAlmostEqual(m["signflip"]["p"], signflip_brute(self.diffs("mean")), places=12)
        self.assertEqual(m["signflip"]["assignments"], 2 ** 20)
        # Holm over the four secondaries only: the primary stands alone.
        ids = ["final", "reach80", "seeds80", "signflip"]
        for mid, want in zip(ids, holm_by_definition([m[i]["p"] for i in ids])):
            self.assertAlmostEqual(m[mid]["holm"], want, places=12)
        self.assertNotIn("holm", m["mean"])
        self.assertIn(f"{self.diffs('mean').mean():+.2f}", stdout)
        self.assertNotIn("INCOMPLETE", stdout)

    def test_adjust_pvalues_checks_the_json(self):
        """The sources experiments/families.json will use, each checked against the JSON."""
        self.report()
        cells = {"baseline": f"confirm.curves.csv:{report_confirm.MHA}",
                 "other": f"confirm.curves.csv:{report_confirm.IHA}"}
        at = lambda suffix: {k: v + suffix for k, v in cells.items()}
        sources = {"mean": dict(at("@mean"), test="paired_t", column="accuracy", scale=100),
                   "final": dict(at("@12000"), test="paired_t", column="accuracy", scale=100),
                   "reach80": dict(cells, test="sign", threshold=0.8),
                   "seeds80": dict(cells, test="sign", threshold=0.8, only_one=True),
                   "signflip": {"test": "report", "file": "confirm.json",
                                "path": "measures[id=signflip].p"}}
        comps = [{"id": k, "label": k, "measure": k, "kind": "secondary", "source": src,
                  "check": {"file": "confirm.json", "path": f"measures[id={k}].p"}}
                 for k, src in sources.items()]
        path = os.path.join(self.dir.name, "families.json")
        with open(path, "w") as f:
            family = {"id": "f", "name": "F", "contains": "c", "why": "w", "members": list(sources)}
            json.dump({"comparisons": comps, "families": [family]}, f)
        r = run("adjust_pvalues.py", path)
        self.assertEqual(r.returncode, 0, r.stderr)

    def test_signflip_by_hand(self):
        # d = 2, 3, 4, 5, -1: |sum| 13 of a total 15; flipping a set F of magnitudes gives
        # 15 - 2 F, and |15 - 2 F| >= 13 needs F <= 1 or F >= 14: {}, {1} and their
        # complements, 4 of 32 -> 0.125.
        self.assertEqual(report_confirm.signflip_count([2, 3, 4, 5, -1]), (4, 32))
        # d = 1, 2, 3, 4, -5: |15 - 2 F| >= 5 needs F <= 5 (10 subsets: {}, five singletons,
        # {1,2}, {1,3}, {1,4}, {2,3}) or F >= 10 (their complements): 20 of 32 -> 0.625.
        self.assertAlmostEqual(report_confirm.signflip_p([1, 2, 3, 4, -5]), 0.625, places=12)
        # All one way: only the observed signs and their negation, 2 of 32.
        self.assertAlmostEqual(report_confirm.signflip_p([1, 1, 1, 1, 1]), 2 / 32, places=12)
        # Float ties: 0.1, 0.2, -0.3, 0.4 has |sum| 0.4; F <= 0.3 or F >= 0.7 of the total 1.0:
        # {}, {.1}, {.2}, {.3}, {.1,.2} and complements, 10 of 16. In floats 0.1 + 0.2 > 0.3,
        # so without the tolerance two of the ties would be lost (8 of 16).
        self.assertEqual(report_confirm.signflip_count([0.1, 0.2, -0.3, 0.4]), (10, 16))
        self.assertEqual(report_confirm.signflip_p([0.0, 0.0]), 1.0)
        rng = np.random.default_rng(9)
        for n in (1, 2, 7, 12):
            for d in (rng.normal(0.5, 1, n), rng.integers(-3, 4, n).astype(float)):
                self.assertAlmostEqual(report_confirm.signflip_p(list(d)), signflip_brute(d),
                                       places=12, msg=list(d))

    def test_signflip_through_the_script(self):
        # Five seeds, MHA flat at 30 %, IHA flat at 30 % + d: the differences of the means are
        # 2, 3, 4, 5, -1 points (up to float rounding, which the tolerance absorbs): p 4/32.
        curves = {}
        for seed, d in zip(range(17, 22), (2, 3, 4, 5, -1)):
            curves[(report_confirm.MHA, seed)] = np.full(len(self.STEPS), 0.30)
            curves[(report_confirm.IHA, seed)] = np.full(len(self.STEPS), 0.30 + d / 100)
        self.write(curves)
        stdout, m, _ = self.report("--allow-incomplete")
        self.assertEqual((m["signflip"]["extreme"], m["signflip"]["assignments"]), (4, 32))
        self.assertAlmostEqual(m["signflip"]["p"], 0.125, places=12)
        self.assertIn("INCOMPLETE", stdout)

    def test_refuses_a_missing_or_unfinished_seed(self):
        gone = lambda cell, seed, step: ((cell, seed) == (report_confirm.MHA, 25) or
                                         ((cell, seed) == (report_confirm.IHA, 30) and step > 6000))
        self.write(self.curves, skip=gone)
        r = run("khop/report_confirm.py", self.path)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn(f"{report_confirm.MHA} seed 25", r.stderr)
        self.assertIn(f"{report_confirm.IHA} seed 30", r.stderr)
        self.assertIn("--allow-incomplete", r.stderr)
        stdout, m, out = self.report("--allow-incomplete")
        self.assertTrue(stdout.startswith("# INCOMPLETE"), stdout)
        self.assertIn("no verdict", stdout)
        with open(out) as f:
            doc = json.load(f)
        self.assertTrue(doc["incomplete"])
        self.assertEqual(doc["seeds"], [s for s in range(17, 37) if s not in (25, 30)])
        self.assertEqual(m["mean"]["n"], 18)

    def test_refuses_a_seed_or_cell_not_registered(self):
        for cell, seed in ((report_confirm.IHA, 7), ("mha-2x", 17)):
            extra = {**self.curves, (cell, seed): self.curves[(report_confirm.IHA, 17)]}
            self.write(extra)
            r = run("khop/report_confirm.py", self.path, "--allow-incomplete")
            self.assertNotEqual(r.returncode, 0)
            self.assertIn("[7]" if seed == 7 else "mha-2x", r.stderr)


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/env python3
"""Multiple-comparison adjustment of docs/results.md's p-values over named families.

A family file (JSON; experiments/families.json) lists every comparison once -- a row id, a label,
the measure, whether it is primary, secondary or post hoc, and where its p comes from -- and the
families, each a name, what it contains, why it is a family, and its members (comparison ids; a
comparison may belong to more than one family). Every p is recomputed from the committed raw
per-job CSVs (results/*.raw.csv) or learning curves (results/*.curves.csv) with the functions of
compare_across.py and compare_settings.py, so it is the number the sweep report printed; a p that
only a report has is read from the report JSON by a path. No p is typed in by hand. A comparison
may also name a report JSON value to check against: the recomputed p must agree with it.

Within each family: Holm's step-down adjustment (controls the family-wise error rate) and the
Benjamini-Hochberg q (controls the false discovery rate), both computed here in a few lines of
plain Python (no numpy needed; tests/experiments_analysis_test.py checks them).

Sources ("source" of a comparison; paths relative to the family file's folder):

  paired_t   baseline, other: "FILE:CELL" or a list of them (seeds pooled over the files);
             column. A curves CSV may be read at one step, "FILE:CELL@STEP", or averaged over the
             evaluations after step 0, "FILE:CELL@mean" (what export_sweep.py's mean_ columns are).
             The paired t of compare_across.py (two-sided p, 95% t interval, bootstrap).
  sign       baseline, other as above; either threshold (curves: the first step at which the
             column reaches it; never = censored) or column (a raw CSV column of steps, e.g.
             solved_step; empty = censored). Exact two-sided sign test of first against later,
             ties and unordered seeds left out (compare_across.sign_p). only_one: true counts only
             seeds where exactly one of the two reached it. pairs: a list of {baseline, other}
             pools several comparisons' seeds.
  reach_t    as sign; paired t of the steps over the seeds where both reached the threshold.
  welch      first, second: {file, baseline, cell}; column. Per seed cell - baseline within each
             file, then Welch's t of the difference of the two means (compare_settings.welch).
  report     file (a report JSON), path ("differences[cell=iha-p2].p_value"): the p as printed.
  Any source may carry digits (decimals of the estimate in the tables; default 2) and scale (a
  factor on the estimate, e.g. 100 for accuracy in points; the p does not depend on it). A
  paired_t, sign or reach_t source may carry until (a step): "@mean" and thresholds read only the
  evaluations up to it, so a run longer than the compared budget is read at that budget.

usage: adjust_pvalues.py FAMILIES.json [--markdown OUT.md] [--json OUT.json] [--family ID ...]
With neither output option the markdown goes to stdout.
"""
import argparse
import csv
import json
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_across import first_reach, order, paired, sign_p  # noqa: E402
from compare_settings import welch  # noqa: E402

KINDS = ("primary", "secondary", "post hoc")


class FamilyError(Exception):
    pass


# ---------------------------------------------------------------- the adjustments

def holm(p):
    """Holm's step-down adjusted p-values, in the input order: sorted ascending, the i-th smallest
    (0-based) is multiplied by m - i, a running maximum keeps them non-decreasing, capped at 1."""
    m = len(p)
    order = sorted(range(m), key=lambda i: p[i])
    out, run = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        run = max(run, min(1.0, (m - rank) * float(p[i])))
        out[i] = run
    return out


def bh(p):
    """Benjamini-Hochberg q-values, in the input order: sorted ascending, the i-th smallest
    (1-based) is multiplied by m / i, a running minimum from the largest keeps them
    non-decreasing, capped at 1."""
    m = len(p)
    order = sorted(range(m), key=lambda i: p[i])
    out, run = [0.0] * m, 1.0
    for rank in range(m - 1, -1, -1):
        i = order[rank]
        run = min(run, float(p[i]) * m / (rank + 1))
        out[i] = run
    return out


# ---------------------------------------------------------------- reading the CSVs

class Tables:
    """CSV files read once, relative to the family file's folder."""

    def __init__(self, root):
        self.root = root
        self.cache = {}

    def rows(self, where, path):
        full = os.path.join(self.root, path)
        if full not in self.cache:
            if not os.path.exists(full):
                raise FamilyError(f"{where}: no such file {path!r}")
            with open(full, newline="") as f:
                reader = csv.DictReader(f)
                self.cache[full] = (reader.fieldnames or [], list(reader))
        return self.cache[full]

    def cell(self, where, spec, column, until=None):
        """seed -> value of column for one "FILE:CELL[@STEP|@mean]" (a list: pooled, no seed twice);
        until: "@mean" averages the evaluations up to that step only."""
        if isinstance(spec, list):
            out = {}
            for s in spec:
                for seed, v in self.cell(where, s, column, until).items():
                    if seed in out:
                        raise FamilyError(f"{where}: seed {seed} twice in the pooled {spec}")
                    out[seed] = v
            return out
        if ":" not in spec:
            raise FamilyError(f"{where}: {spec!r} is not FILE:CELL")
        path, cell = spec.rsplit(":", 1)
        at = None
        if "@" in cell:
            cell, at = cell.split("@", 1)
        fields, rows = self.rows(where, path)
        if column not in fields:
            raise FamilyError(f"{where}: column {column!r} is not a column of {path} "
                              f"(it has {', '.join(fields)})")
        rows = [r for r in rows if r["cell"] == cell]
        if not rows:
            cells = sorted({r["cell"] for r in self.rows(where, path)[1]})
            raise FamilyError(f"{where}: no cell {cell!r} in {path} (cells: {', '.join(cells)})")
        out = {}
        if at is None:
            for r in rows:
                if int(r["seed"]) in out:
                    raise FamilyError(f"{where}: seed {r['seed']} twice in {path}:{cell}; "
                                      "a curves CSV needs @STEP or @mean")
                out[int(r["seed"])] = r[column]
        elif at == "mean":
            by_seed = {}
            for r in rows:
                if 0 < int(r["step"]) <= (until or math.inf) and r[column] != "":
                    by_seed.setdefault(int(r["seed"]), []).append(float(r[column]))
            out = {s: repr(sum(v) / len(v)) for s, v in by_seed.items()}
        else:
            try:
                step = int(at)
            except ValueError:
                raise FamilyError(f"{where}: {spec!r}: @{at} is neither a step nor 'mean'")
            for r in rows:
                if int(r["step"]) == step:
                    if int(r["seed"]) in out and out[int(r["seed"])] != r[column]:
                        raise FamilyError(f"{where}: {path}:{cell} has two values at step {step} "
                                          f"for seed {r['seed']}")
                    out[int(r["seed"])] = r[column]
            if not out:
                raise FamilyError(f"{where}: {path}:{cell} has no evaluation at step {step}")
        return out

    def reach(self, where, spec, threshold, column, until=None):
        """seed -> first step at threshold (None: censored), from curves (threshold; until: the
        evaluations up to that step only) or a raw column of steps (threshold None)."""
        if isinstance(spec, list):
            out = {}
            for s in spec:
                part = self.reach(where, s, threshold, column, until)
                if set(part) & set(out):
                    raise FamilyError(f"{where}: a seed twice in the pooled {spec}")
                out.update(part)
            return out
        if threshold is None:
            if until is not None:
                raise FamilyError(f"{where}: until needs a threshold on a curves CSV")
            values = self.cell(where, spec, column)
            return {s: (int(float(v)) if v != "" else None) for s, v in values.items()}
        if column not in (None, "accuracy"):
            raise FamilyError(f"{where}: a threshold is read on the accuracy column of a curves CSV")
        self.cell(where, spec + "@mean", "accuracy")  # the file, the cell and the column exist
        path, cell = spec.rsplit(":", 1)
        return first_reach(os.path.join(self.root, path), cell, threshold, until)


def as_rows(values):
    """seed -> value as the {seed: {"v": value}} compare_across.paired takes."""
    return {s: {"v": v if isinstance(v, str) else repr(v)} for s, v in values.items()}


def t_of(where, base, other):
    seeds = sorted(s for s in base if s in other and base[s] != "" and other[s] != "")
    if len(seeds) < 2:
        raise FamilyError(f"{where}: {len(seeds)} paired seeds, need 2")
    try:
        return paired(as_rows({s: base[s] for s in seeds}), as_rows({s: other[s] for s in seeds}), "v")
    except SystemExit as e:
        raise FamilyError(f"{where}: {e}")


def json_path(where, doc, path):
    cur = doc
    for part in re.findall(r"[^.\[\]]+(?:\[[^\]]*\])?", path):
        m = re.fullmatch(r"([^\[]+)(?:\[([^=\]]+)=([^\]]*)\])?", part)
        key, sel_k, sel_v = m.group(1), m.group(2), m.group(3)
        if not isinstance(cur, dict) or key not in cur:
            raise FamilyError(f"{where}: {key!r} not found on the path {path!r}")
        cur = cur[key]
        if sel_k is not None:
            hits = [x for x in cur if isinstance(x, dict) and str(x.get(sel_k)) == sel_v]
            if len(hits) != 1:
                raise FamilyError(f"{where}: {len(hits)} entries with {sel_k}={sel_v} on the path "
                                  f"{path!r}")
            cur = hits[0]
    return cur


def evaluate(where, src, tables):
    """-> dict with p and the estimate it belongs to."""
    test = src.get("test")
    scale = float(src.get("scale", 1.0))
    until = src.get("until")
    if until is not None and (not isinstance(until, int) or until <= 0):
        raise FamilyError(f"{where}: until must be a positive step, not {until!r}")
    if test == "paired_t":
        column = src.get("column")
        if not column:
            raise FamilyError(f"{where}: paired_t needs a column")
        base = tables.cell(where, src["baseline"], column, until)
        other = tables.cell(where, src["other"], column, until)
        seeds, d, mean, ci, boot, p = t_of(where, base, other)
        return {"p": p, "test": "paired t", "n": len(seeds), "seeds": seeds,
                "mean": mean * scale, "ci": [ci[0] * scale, ci[1] * scale],
                "bootstrap": [boot[0] * scale, boot[1] * scale]}
    if test in ("sign", "reach_t"):
        threshold = src.get("threshold")
        column = src.get("column")
        if threshold is None and column is None:
            raise FamilyError(f"{where}: {test} needs a threshold (curves) or a column (raw steps)")
        pairs = src.get("pairs") or [{"baseline": src.get("baseline"), "other": src.get("other")}]
        sa, sb = {}, {}
        counts = [0, 0, 0, 0]
        for i, pr in enumerate(pairs):
            a = tables.reach(where, pr["baseline"], threshold, column, until)
            b = tables.reach(where, pr["other"], threshold, column, until)
            c = order(a, b, src.get("only_one", False))
            counts = [x + y for x, y in zip(counts, c)]
            sa.update({(i, s): v for s, v in a.items()})
            sb.update({(i, s): v for s, v in b.items()})
        first, later, ties, unordered = counts
        if test == "sign":
            return {"p": sign_p(first, first + later), "test": "sign", "first": first,
                    "later": later, "ties": ties, "unordered": unordered}
        both = {k: (sa[k], sb[k]) for k in sa if k in sb and sa[k] is not None and sb[k] is not None}
        seeds, d, mean, ci, boot, p = t_of(where, {k: repr(v[0]) for k, v in both.items()},
                                           {k: repr(v[1]) for k, v in both.items()})
        return {"p": p, "test": "paired t (both reached)", "n": len(seeds), "mean": mean,
                "ci": list(ci), "bootstrap": list(boot), "digits": 0}
    if test == "welch":
        column = src.get("column")
        diffs = []
        for key in ("first", "second"):
            s = src.get(key) or {}
            base = tables.cell(where, f"{s.get('file')}:{s.get('baseline')}", column)
            other = tables.cell(where, f"{s.get('file')}:{s.get('cell')}", column)
            _, d, _, _, _, _ = t_of(where, base, other)
            diffs.append([x * scale for x in d])
        diff, ci, p, df = welch(*diffs)
        return {"p": p, "test": "Welch t", "mean": diff, "ci": list(ci), "df": df,
                "n": [len(diffs[0]), len(diffs[1])]}
    if test == "report":
        path = os.path.join(tables.root, src.get("file", ""))
        if not os.path.exists(path):
            raise FamilyError(f"{where}: no such file {src.get('file')!r}")
        return {"p": float(json_path(where, json.load(open(path)), src.get("path", ""))),
                "test": "from report", "report": src.get("file")}
    raise FamilyError(f"{where}: unknown test {test!r} (paired_t, sign, reach_t, welch, report)")


# ---------------------------------------------------------------- the family file

def load(path):
    try:
        doc = json.load(open(path))
    except (OSError, ValueError) as e:
        raise FamilyError(f"{path}: {e}")
    root = os.path.dirname(os.path.abspath(path))
    tables = Tables(root)
    comps = {}
    for c in doc.get("comparisons", []):
        cid = c.get("id")
        where = f"comparison {cid!r}"
        if not cid or cid in comps:
            raise FamilyError(f"{where}: missing or repeated id")
        for key in ("label", "measure", "kind", "source"):
            if key not in c:
                raise FamilyError(f"{where}: no {key!r}")
        if c["kind"] not in KINDS:
            raise FamilyError(f"{where}: kind {c['kind']!r} is not one of {', '.join(KINDS)}")
        r = evaluate(where, c["source"], tables)
        if "digits" in c["source"]:
            r["digits"] = int(c["source"]["digits"])
        check = c.get("check")
        if check:
            want = evaluate(where + " (check)", dict(check, test="report"), tables)["p"]
            if not math.isclose(r["p"], want, rel_tol=1e-4, abs_tol=1e-9):
                raise FamilyError(f"{where}: recomputed p {r['p']:.6g} but {check['file']} says "
                                  f"{want:.6g}")
            r["checked_against"] = check["file"]
        comps[cid] = dict(c, result=r)
    families = []
    for f in doc.get("families", []):
        where = f"family {f.get('id')!r}"
        for key in ("id", "name", "contains", "why", "members"):
            if key not in f:
                raise FamilyError(f"{where}: no {key!r}")
        missing = [m for m in f["members"] if m not in comps]
        if missing:
            raise FamilyError(f"{where}: unknown comparison {', '.join(map(repr, missing))}")
        if len(set(f["members"])) != len(f["members"]):
            raise FamilyError(f"{where}: a member twice")
        p = [comps[m]["result"]["p"] for m in f["members"]]
        hp, bq = holm(p), bh(p)
        alpha = float(doc.get("alpha", 0.05))
        rows = [{"id": m, "label": comps[m]["label"], "measure": comps[m]["measure"],
                 "kind": comps[m]["kind"], "result": comps[m]["result"], "p": pi,
                 "holm": float(h), "bh": float(q), "holm_survives": bool(h < alpha),
                 "bh_survives": bool(q < alpha)}
                for m, pi, h, q in zip(f["members"], p, hp, bq)]
        families.append(dict({k: f[k] for k in ("id", "name", "contains", "why")},
                             kind=f.get("kind", ""), alpha=alpha, m=len(rows), rows=rows,
                             survive_holm=[r["id"] for r in rows if r["holm_survives"]],
                             survive_bh=[r["id"] for r in rows if r["bh_survives"]]))
    return doc, comps, families


# ---------------------------------------------------------------- output

def fmt_p(p):
    if p >= 0.9995:
        return "1"
    return f"{p:#.2g}".replace("e-0", "e-")


def num(x, digits=2):
    s = f"{x:+.{digits}f}"
    return s.replace("-", "−")


def estimate(r):
    t = r["test"]
    digits = r.get("digits", 2)
    if t == "sign":
        return (f"first {r['first']}, later {r['later']}, ties {r['ties']}, "
                f"unordered {r['unordered']}")
    if t in ("paired t", "paired t (both reached)", "Welch t"):
        s = f"{num(r['mean'], digits)} [{num(r['ci'][0], digits)}, {num(r['ci'][1], digits)}]"
        if t == "Welch t":
            s += f", df {r['df']:.1f}"
        return s
    return "(report)"


def markdown(families):
    out = []
    for f in families:
        out.append(f"### {f['name']} ({f['m']} comparisons)\n")
        out.append(f"*Contains:* {f['contains']} *Why a family:* {f['why']}\n")
        out.append("| row | comparison | measure | kind | test | estimate | raw p | Holm p | BH q "
                   "| at 0.05 |")
        out.append("| --- | --- | --- | --- | --- | --- | ---: | ---: | ---: | --- |")
        for r in f["rows"]:
            at = ("Holm and BH" if r["holm_survives"] else
                  "BH only" if r["bh_survives"] else "neither")
            n = r["result"].get("n")
            test = r["result"]["test"] + (f", n {n}" if isinstance(n, int) else "")
            out.append(f"| `{r['id']}` | {r['label']} | {r['measure']} | {r['kind']} | {test} | "
                       f"{estimate(r['result'])} | {fmt_p(r['p'])} | {fmt_p(r['holm'])} | "
                       f"{fmt_p(r['bh'])} | {at} |")
        surv = ", ".join(f"`{i}`" for i in f["survive_holm"]) or "none"
        out.append(f"\nSurvive Holm at {f['alpha']}: {len(f['survive_holm'])} of {f['m']} "
                   f"({surv}); BH q < {f['alpha']}: {len(f['survive_bh'])}.\n")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("families")
    ap.add_argument("--markdown", help="write the tables here (default: stdout)")
    ap.add_argument("--json", help="write every comparison and family here")
    ap.add_argument("--family", nargs="*", help="only these family ids")
    a = ap.parse_args(argv)
    try:
        doc, comps, families = load(a.families)
    except FamilyError as e:
        print(f"adjust_pvalues.py: {e}", file=sys.stderr)
        return 2
    if a.family:
        unknown = set(a.family) - {f["id"] for f in families}
        if unknown:
            print(f"adjust_pvalues.py: no family {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        families = [f for f in families if f["id"] in a.family]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    name = os.path.relpath(os.path.abspath(a.families), repo)
    head = (f"<!-- written by `python3 experiments/adjust_pvalues.py {name} --markdown ...` "
            "(the full command is at the top of docs/results.md); do not edit by hand -->\n\n")
    md = head + markdown(families)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(md)
    if a.json:
        with open(a.json, "w") as f:
            slim = [dict(f, rows=[{k: r[k] for k in ("id", "p", "holm", "bh", "holm_survives",
                                                     "bh_survives")} for r in f["rows"]])
                    for f in families]
            json.dump({"families": slim,
                       "comparisons": {k: {"label": v["label"], "measure": v["measure"],
                                           "kind": v["kind"], "source": v["source"],
                                           "result": v["result"]} for k, v in comps.items()}},
                      f, indent=1)
            f.write("\n")
    if not a.markdown and not a.json:
        print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

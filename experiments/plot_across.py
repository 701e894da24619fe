#!/usr/bin/env python3
"""One measure against a setting that varies across sweeps (accuracy against hops, say), from the
committed reports of those sweeps (`loom sweep report ID --format json`, one per setting).

    experiments/plot_across.py --x hops --out docs/results/khop-vs-hops.png \
        2=khop-simple-hops2-heads2.report-mean.json 3=... 4=...

Prints a Markdown table (per setting and cell: n, mean and 95% interval; per setting the paired
difference of each cell against the report's baseline, its 95% paired-t interval and p, as the
report computed them) and, with --out, draws each cell's mean with its 95% interval against the
setting (gnuplot, PNG). --scale 100 prints and plots fractions as percentages.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile


def load(arg):
    x, sep, path = arg.partition("=")
    if not sep:
        sys.exit(f"expected X=REPORT.json, got {arg!r}")
    try:
        value = float(x)
    except ValueError:
        sys.exit(f"{arg!r}: the setting before '=' must be a number")
    with open(path) as f:
        return value, json.load(f)


def fmt(v, scale):
    return f"{v * scale:.2f}"


def table(points, scale, x_name):
    print(f"| {x_name} | cell | n | mean | 95% CI |")
    print("| ---: | --- | ---: | ---: | --- |")
    for x, r in points:
        for c in r["cells"]:
            lo, hi = c.get("ci_low", 0.0), c.get("ci_high", 0.0)
            print(f"| {x:g} | {c['cell']} | {c.get('n', 0)} | {fmt(c.get('mean', 0.0), scale)} | "
                  f"[{fmt(lo, scale)}, {fmt(hi, scale)}] |")
    print()
    print(f"| {x_name} | cell − baseline | n | mean diff | 95% paired t | p |")
    print("| ---: | --- | ---: | ---: | --- | ---: |")
    for x, r in points:
        for d in r.get("differences", []):
            print(f"| {x:g} | {d['cell']} − {d['baseline']} | {d.get('n', 0)} | "
                  f"{fmt(d.get('mean', 0.0), scale)} | [{fmt(d.get('t_low', 0.0), scale)}, "
                  f"{fmt(d.get('t_high', 0.0), scale)}] | {d.get('p_value', 1.0):.2g} |")


def plot(points, scale, x_name, out, title):
    cells = []
    for _, r in points:
        cells += [c["cell"] for c in r["cells"] if c["cell"] not in cells]
    metric = points[0][1].get("metric", "eval_loss")
    select = points[0][1].get("select", "final")
    with tempfile.TemporaryDirectory() as tmp:
        plots = []
        xs = [x for x, _ in points]
        width = 0.04 * (max(xs) - min(xs) or 1)  # cells side by side at one setting
        for i, name in enumerate(cells):
            data = os.path.join(tmp, f"cell-{i}.dat")
            with open(data, "w") as f:
                for x, r in points:
                    for c in r["cells"]:
                        if c["cell"] == name and c.get("n", 0) > 0:
                            shift = (i - (len(cells) - 1) / 2) * width
                            f.write(f"{x + shift} {c['mean'] * scale} {c.get('ci_low', 0) * scale} "
                                    f"{c.get('ci_high', 0) * scale}\n")
            safe = name.replace("'", "")
            plots.append(f"'{data}' using 1:2:3:4 with yerrorlines lw 2 pt 7 lc {i % 8 + 1} title '{safe}'")
        heading = title or f"{metric} ({select}) against {x_name}"
        tics = ", ".join(f'"{x:g}" {x}' for x in xs)
        script = "\n".join([
            "set terminal pngcairo size 900,600 font 'sans,10' noenhanced", f"set output '{out}'",
            f"set title '{heading} (mean, 95% interval)'", "set grid", "set key outside right",
            f"set xlabel '{x_name}'", f"set ylabel '{metric}'", f"set xtics ({tics})",
            f"set offsets {2 * width}, {2 * width}, 0, 0", "plot " + ", ".join(plots), ""])
        subprocess.run(["gnuplot"], input=script, text=True, check=True)
    print(f"\nwrote {out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", help="X=REPORT.json, one per setting")
    ap.add_argument("--x", default="setting", help="what the setting is (axis label)")
    ap.add_argument("--out", help="PNG to draw")
    ap.add_argument("--title", default="")
    ap.add_argument("--scale", type=float, default=1.0)
    args = ap.parse_args()
    points = sorted((load(a) for a in args.reports), key=lambda p: p[0])
    table(points, args.scale, args.x)
    if args.out:
        plot(points, args.scale, args.x, args.out, args.title)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Markdown tables of a sweep report (the JSON of `loom sweep report ID --format json`), as
docs/results.md shows them: per cell n, mean, sd and 95% t interval; per cell against the
baseline the paired difference with its 95% paired-t and bootstrap intervals and p-value. A
`select: reach` report (steps until a threshold) gets its own tables: reached and censored
seeds per cell, and per seed which cell reached the threshold first, with the sign test.

usage: report_table.py REPORT.json [--scale 100]   (scale: 100 prints fractions as percent)
"""
import json
import sys


def reach_tables(r):
    f = lambda x: f"{float(x or 0):.0f}"
    op = "<=" if r["metric"] == "eval_loss" else ">="
    print(f"steps until {r['metric']} {op} {r['threshold']}, 95% intervals"
          f"{'' if r.get('complete') else ' [partial]'}\n")
    print("| cell | reached | censored | mean step | sd | 95% CI |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for c in r["cells"]:
        stats = (f"{f(c.get('mean'))} | {f(c.get('sd'))} | [{f(c.get('ci_low'))}, {f(c.get('ci_high'))}]"
                 if c.get("n", 0) else "— | — | —")
        print(f"| {c['cell']} | {c.get('n', 0)} | {c.get('censored', 0)} | {stats} |")
    if not r.get("differences"):
        return
    print(f"\n| cell vs {r['differences'][0]['baseline']} | first | later | ties | unordered | "
          "sign p | both reached | mean diff (steps) | 95% paired t | p |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for d in r["differences"]:
        n = int(d.get("n", 0))
        t = (f"{f(d.get('mean'))} | [{f(d.get('t_low'))}, {f(d.get('t_high'))}] | "
             f"{float(d.get('p_value', 1)):.3g}" if n >= 2 else "— | — | —")
        print(f"| {d['cell']} | {d.get('first', 0)} | {d.get('later', 0)} | {d.get('ties', 0)} | "
              f"{d.get('unordered', 0)} | {float(d.get('sign_p_value', 1)):.3g} | {n} | {t} |")


def main():
    path = sys.argv[1]
    scale = float(sys.argv[sys.argv.index("--scale") + 1]) if "--scale" in sys.argv else 1.0
    r = json.load(open(path))
    if r.get("select") == "reach":
        return reach_tables(r)
    f = lambda x: f"{scale * float(x or 0):.2f}"
    at = f", at length {r['length']}" if int(r.get("length", 0)) else ""
    print(f"{r['metric']} ({r['select']}{at}), 95% intervals{'' if r.get('complete') else ' [partial]'}\n")
    print("| cell | n | mean | sd | 95% CI |")
    print("| --- | ---: | ---: | ---: | --- |")
    for c in r["cells"]:
        print(f"| {c['cell']} | {c.get('n', 0)} | {f(c.get('mean'))} | {f(c.get('sd'))} | "
              f"[{f(c.get('ci_low'))}, {f(c.get('ci_high'))}] |")
    print(f"\n| cell − {r['cells'][0]['cell'] if not r.get('differences') else r['differences'][0]['baseline']} "
          "| n | mean diff | 95% paired t | 95% bootstrap | p | reading |")
    print("| --- | ---: | ---: | --- | --- | ---: | --- |")
    for d in r.get("differences", []):
        p = float(d.get("p_value", 1))
        if int(d.get("n", 0)) < 2:
            sig = "too few seeds"
        elif p >= 0.05:
            sig = "no significant difference"
        else:
            sig = "higher" if float(d.get("mean", 0)) > 0 else "lower"
        print(f"| {d['cell']} | {d.get('n', 0)} | {f(d.get('mean'))} | [{f(d.get('t_low'))}, "
              f"{f(d.get('t_high'))}] | [{f(d.get('boot_low'))}, {f(d.get('boot_high'))}] | "
              f"{p:.3g} | {sig} |")


if __name__ == "__main__":
    main()

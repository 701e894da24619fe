#!/usr/bin/env python3
"""Sweeps end to end through `loom up` (a real coordinator, worker agent and trainer ranks):
`loom sweep submit` expands 2 cells x 3 seeds into jobs that run and pair by seed (the same seed
gives every cell the same initial weights and data, a different seed different ones); the report
(`loom sweep report`, `GET /v1/sweeps/{id}/report`) is checked against this script's own
computation of the same statistics from the raw per-job results (Student t from numerical
integration of its density, not the coordinator's incomplete-beta code; the exact bootstrap
distribution of the mean for three seeds); partial reports while a sweep runs; cancelling a sweep
cancels its jobs; a sweep of 200 jobs on 2 slots loses none; a report against another sweep's
cell; a report that merges another sweep's seeds in. The curves (`loom sweep curves`,
`GET /v1/sweeps/{id}/curves`: per cell and step the mean and interval over seeds, per step the
paired difference) are checked against the same independent computation at every step. A sweep
of reasoning-SFT jobs is reported by pass@1, maj@k and answered, paired by seed and by problem,
against a computation from the trainer's per-problem details files. experiments/export_sweep.py
(the source of docs/results.md's raw CSVs) writes what the API has, and `loom sweep expand`
(offline) gives the specs the coordinator made. Every process is stopped at the end.
"""
import argparse
import csv as csv_module
import functools
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loom_testlib import Api, free_port, kill_all, wait_for  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROCS = []


def t_pdf(x, df):
    return math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi) * \
        (1 + x * x / df) ** (-(df + 1) / 2)


def t_cdf(x, df):
    """P(T <= x) by Simpson's rule on the density over [0, |x|] (an independent route to the
    coordinator's continued-fraction incomplete beta)."""
    n = 20000
    a, b = 0.0, abs(x)
    h = (b - a) / n
    s = t_pdf(a, df) + t_pdf(b, df) + sum((4 if i % 2 else 2) * t_pdf(a + i * h, df) for i in range(1, n))
    half = s * h / 3
    return 0.5 + half if x >= 0 else 0.5 - half


@functools.lru_cache(maxsize=None)  # 0.6 s of Simpson's rule per call; a few (p, df) recur
def t_quantile(p, df):
    lo, hi = 0.0, 100.0
    for _ in range(60):
        mid = (lo + hi) / 2
        (lo, hi) = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def mean(x):
    return sum(x) / len(x)


def sd(x):
    m = mean(x)
    return math.sqrt(sum((v - m) ** 2 for v in x) / (len(x) - 1))


def t_interval(x):
    half = t_quantile(0.975, len(x) - 1) * sd(x) / math.sqrt(len(x))
    return mean(x) - half, mean(x) + half


def exact_bootstrap_interval(x):
    """The 2.5% and 97.5% quantiles of the bootstrap distribution of the mean, enumerated exactly
    (n^n equally likely resamples): the smallest mean whose cumulative probability reaches q,
    which is what the coordinator's 10000-resample percentiles estimate."""
    means = sorted(mean(c) for c in itertools.product(x, repeat=len(x)))

    def at(q):
        return means[max(0, math.ceil(q * len(means)) - 1)]
    return at(0.025), at(0.975)


def close(a, b, tol, what):
    assert abs(a - b) <= tol * max(1.0, abs(b)), f"{what}: {a} vs {b} (tolerance {tol})"


class Up:
    def __init__(self, args, tmp):
        self.args, self.tmp = args, tmp
        self.port = free_port()
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "XDG_CONFIG_HOME": os.path.join(tmp, "xdg"),
                    "LOOM_COORDINATOR": f"http://127.0.0.1:{self.port}"}
        self.env.pop("LOOM_TOKEN", None)
        self.proc = subprocess.Popen([args.loom, "up", "--workers", "1", "--slots", "2", "--port", str(self.port),
                                      "--data-dir", os.path.join(tmp, "up")], env=self.env,
                                     stdout=open(os.path.join(tmp, "up.log"), "w"), stderr=subprocess.STDOUT)
        PROCS.append(self.proc)
        token_file = self.token_file = os.path.join(tmp, "xdg", "loom", f"local-{self.port}.token")
        wait_for("loom up's token", lambda: os.path.exists(token_file) and open(token_file).read().strip(), 30)
        self.api = Api(self.port, open(token_file).read().strip())
        wait_for("a live worker", lambda: any(w["state"] == "alive" for w in self.api.workers()), 30)

    def loom(self, *argv):
        r = subprocess.run([self.args.loom, *argv], env=self.env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"loom {' '.join(argv)}: {r.returncode}\n{r.stdout}\n{r.stderr}"
        return r.stdout

    def wait_sweep(self, sweep_id, timeout=600):
        return wait_for(f"{sweep_id} to finish", lambda: (lambda s: s["state"] != "running" and s)(
            self.api.ok("GET", f"/v1/sweeps/{sweep_id}")), timeout, interval=1)


def write(tmp, name, text):
    path = os.path.join(tmp, name)
    with open(path, "w") as f:
        f.write(text)
    return path


SWEEP = """name: lr-pairs
base:
  spec:
    preset: micro
    steps: {steps}
    micro_batch: 4
    seq_len: 32
    threads: 1
    data: {{corpus_bytes: 65536}}
    eval: {{interval: 10, batches: 2}}
grid:
  optimizer.lr: [0.001, 0.003]
seeds: {seeds}
metric: eval_loss
request_id: {request_id}
"""


def is_default(v):
    return v in (0, "0", "", False, None) or (isinstance(v, list) and not v) or \
        (isinstance(v, dict) and all(is_default(x) for x in v.values()))


def same_spec(printed, served, where):
    """`printed` (defaults left out) and `served` (every field, defaults included) are one spec."""
    if isinstance(served, dict):
        assert isinstance(printed, dict) and set(printed) <= set(served), (where, printed, served)
        for k, v in served.items():
            if k in printed:
                same_spec(printed[k], v, f"{where}.{k}")
            else:
                assert is_default(v), (f"{where}.{k}", v)
    elif isinstance(served, list):
        assert isinstance(printed, list) and len(printed) == len(served), (where, printed, served)
        for i, (a, b) in enumerate(zip(printed, served)):
            same_spec(a, b, f"{where}[{i}]")
    else:
        assert str(printed) == str(served) or float(printed) == float(served), (where, printed, served)


def check_export_and_expand(up, sweep, path, raw, tmp):
    """experiments/export_sweep.py (the source of docs/results.md's raw CSVs) writes each job's
    final held-out loss as the API has it and every held-out evaluation in order; `loom sweep
    expand` on the file gives exactly the specs the coordinator made (every field it prints has
    the submitted request's value; the request's other fields are at their defaults)."""
    out, curves = os.path.join(tmp, "export.raw.csv"), os.path.join(tmp, "export.curves.csv")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "export_sweep.py"),
                        "--coordinator", f"http://127.0.0.1:{up.port}", "--token-file", up.token_file,
                        "--sweep", sweep["id"], "--out", out, "--curves", curves],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = list(csv_module.DictReader(open(out)))
    assert sorted((row["cell"], int(row["seed"])) for row in rows) == \
        sorted((c, s) for c in raw for s in raw[c]), rows
    for row in rows:
        assert row["state"] == "succeeded" and int(row["steps_run"]) == 30 and int(row["step"]) == 30, row
        assert float(row["eval_loss"]) == raw[row["cell"]][int(row["seed"])], (row, raw)
    points = list(csv_module.DictReader(open(curves)))
    for row in rows:
        mine = [p for p in points if p["job"] == row["job"]]
        assert [int(p["step"]) for p in mine] == [0, 10, 20, 30], mine
        assert float(mine[-1]["eval_loss"]) == float(row["eval_loss"]), (mine, row)
    jobs = json.loads(up.loom("sweep", "expand", path))
    assert len(jobs) == len(sweep["jobs"]), jobs
    for sj in sweep["jobs"]:
        [mine] = [j for j in jobs if j["cell"] == sj["cell"] and int(j["seed"]) == int(sj["seed"])]
        same_spec(mine["spec"], up.api.job(sj["job_id"])["request"]["spec"], "spec")
    print(f"ok: export_sweep.py wrote {len(rows)} jobs and {len(points)} evaluations as the API has "
          f"them; loom sweep expand made the coordinator's {len(jobs)} specs offline")


def test_report_matches_raw_results(up, tmp):
    path = write(tmp, "sweep.yaml", SWEEP.format(steps=30, seeds="[1, 2, 3]", request_id="pairs-1"))
    created = json.loads(up.loom("sweep", "submit", path, "--json"))
    assert created["created"] and created["jobs"] == 6, created
    again = json.loads(up.loom("sweep", "submit", path, "--json"))  # the same request id
    assert again["id"] == created["id"] and not again.get("created"), again
    sweep = up.wait_sweep(created["id"])
    assert sweep["state"] == "finished" and sweep["job_states"] == {"succeeded": 6}, sweep
    report = json.loads(up.loom("sweep", "report", sweep["id"], "--format", "json"))
    api_report = up.api.ok("GET", f"/v1/sweeps/{sweep['id']}/report")
    # The CLI prints what the API serves, every field included.
    assert report == api_report, (report, api_report)
    # The raw results: each job's final held-out loss, and its step-0 loss (before any update).
    raw, step0, best_accuracy = {}, {}, {}
    for j in sweep["jobs"]:
        job = up.api.job(j["job_id"])
        assert job["sweep_id"] == sweep["id"] and job["sweep_cell"] == j["cell"], job
        assert int(job["spec"]["seed"]) == int(j["seed"]) == int(job["sweep_seed"]), job["spec"]
        evals = sorted(job["evals"], key=lambda e: int(e.get("step", 0)))
        raw.setdefault(j["cell"], {})[int(j["seed"])] = evals[-1]["eval_loss"]
        step0.setdefault(j["cell"], {})[int(j["seed"])] = evals[0]["eval_loss"]
        best = min(evals, key=lambda e: e["eval_loss"])  # select: best
        best_accuracy.setdefault(j["cell"], {})[int(j["seed"])] = best.get("accuracy", 0.0)
    cells = sweep["cells"]
    assert cells == ["optimizer.lr=0.001", "optimizer.lr=0.003"], cells
    # Pairing: the same seed starts from the same weights on the same data in both cells (the lr
    # cannot act before the first update), different seeds from different ones.
    for seed in (1, 2, 3):
        assert step0[cells[0]][seed] == step0[cells[1]][seed], (seed, step0)
    assert len({step0[cells[0]][s] for s in (1, 2, 3)}) == 3, step0
    for c in report["cells"]:
        x = [raw[c["cell"]][s] for s in sorted(raw[c["cell"]])]
        assert c["n"] == 3 and not c.get("pending"), c
        close(c["mean"], mean(x), 1e-12, f"{c['cell']} mean")
        close(c.get("sd", 0.0), sd(x), 1e-9, f"{c['cell']} sd")
        lo, hi = t_interval(x)
        close(c["ci_low"], lo, 1e-6, f"{c['cell']} CI low")
        close(c["ci_high"], hi, 1e-6, f"{c['cell']} CI high")
    [d] = report["differences"]
    assert d["baseline"] == cells[0] and d["cell"] == cells[1] and d["n"] == 3, d
    diffs = [raw[cells[1]][s] - raw[cells[0]][s] for s in (1, 2, 3)]
    close(d["mean"], mean(diffs), 1e-12, "paired mean")
    lo, hi = t_interval(diffs)
    close(d["t_low"], lo, 1e-6, "paired t low")
    close(d["t_high"], hi, 1e-6, "paired t high")
    tstat = mean(diffs) / (sd(diffs) / math.sqrt(3))
    close(d["p_value"], 2 * (1 - t_cdf(abs(tstat), 2)), 1e-5, "paired p")
    blo, bhi = exact_bootstrap_interval(diffs)
    spread = max(diffs) - min(diffs)
    # 10000 resamples of a 27-point distribution: the estimated 2.5% / 97.5% points equal the
    # exact quantiles (here the extremes, each 1/27 likely) unless fewer than 250 of the 10000
    # resamples fall on them (probability below 1e-9).
    close(d["boot_low"], blo, 0.02 * spread, "bootstrap low")
    close(d["boot_high"], bhi, 0.02 * spread, "bootstrap high")
    # Another metric and selection than the sweep's own (eval_loss, final), from the same jobs.
    other = up.api.ok("GET", f"/v1/sweeps/{sweep['id']}/report?metric=accuracy&select=best")
    assert other["metric"] == "accuracy" and other["select"] == "best", other
    for c in other["cells"]:
        x = [best_accuracy[c["cell"]][s] for s in sorted(best_accuracy[c["cell"]])]
        close(c["mean"], mean(x), 1e-12, f"{c['cell']} best-by-loss accuracy mean")
    cli_other = json.loads(up.loom("sweep", "report", sweep["id"], "--metric", "accuracy",
                                   "--select", "best", "--format", "json"))
    assert cli_other == other, (cli_other, other)
    assert up.api.ok("GET", f"/v1/sweeps/{sweep['id']}")["spec"].get("metric") == "eval_loss"
    for query, field in (("metric=perplexity", "metric"), ("select=median", "select"),
                         ("metrics=accuracy", "metrics")):
        status, body, text = up.api.request("GET", f"/v1/sweeps/{sweep['id']}/report?{query}")
        assert status == 400 and field in body["error"]["message"], (query, status, text)
        violations = [v for d in body["error"]["details"] for v in d.get("fieldViolations", [])]
        assert [v["field"] for v in violations] == [field], (query, body)
    check_export_and_expand(up, sweep, path, raw, tmp)
    check_reach_report(up, sweep)
    check_mean_report(up, sweep)
    check_curves(up, sweep, report)
    # The other formats and the plot.
    csv = up.loom("sweep", "report", sweep["id"], "--format", "csv").splitlines()
    assert csv[0].startswith("kind,cell,baseline,n,mean") and len(csv) == 4, csv
    table = up.loom("sweep", "report", sweep["id"])
    assert "paired difference vs optimizer.lr=0.001" in table and "bootstrap" in table, table
    png = os.path.join(tmp, "sweep.png")
    up.loom("sweep", "report", sweep["id"], "--plot", png)
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    print(f"ok: {sweep['id']}: 2 cells x 3 seeds paired by seed; report = independent computation "
          f"(mean diff {d['mean']:.4f}, t [{d['t_low']:.4f}, {d['t_high']:.4f}], p {d['p_value']:.2g})")
    return sweep, raw


def sign_test_p(wins, losses):
    n, k = wins + losses, min(wins, losses)
    return 1.0 if n == 0 else min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)


def check_reach_report(up, sweep):
    """select reach (steps until eval_loss <= a level) against the same from the jobs' evals."""
    held = {}  # cell -> seed -> [(step, loss)] of held-out evaluations
    for j in sweep["jobs"]:
        evals = [e for e in up.api.job(j["job_id"])["evals"]
                 if e.get("kind", "") in ("", "heldout", "validation")]
        held.setdefault(j["cell"], {})[int(j["seed"])] = sorted(
            (int(e.get("step", 0)), e["eval_loss"]) for e in evals)
    # The median of the jobs' best losses: the jobs whose best is above it never reach it.
    bests = sorted(min(loss for _, loss in v) for c in held.values() for v in c.values())
    level = bests[len(bests) // 2]
    def outcome(evals):  # (step, censored)
        reached = [step for step, loss in evals if loss <= level]
        return (reached[0], False) if reached else (evals[-1][0], True)
    r = up.api.ok("GET", f"/v1/sweeps/{sweep['id']}/report?select=reach&threshold={level!r}")
    assert r["select"] == "reach" and r["threshold"] == level, r
    cells = sweep["cells"]
    out = {c: {s: outcome(v) for s, v in held[c].items()} for c in cells}
    assert any(c for o in out.values() for _, c in o.values()), "no job was censored"
    for c in r["cells"]:
        steps = [st for st, cen in out[c["cell"]].values() if not cen]
        assert c.get("n", 0) == len(steps), (c, out)
        assert c.get("censored", 0) == 3 - len(steps), (c, out)
        if steps:
            close(c["mean"], mean(steps), 1e-9, f"{c['cell']} mean steps to the level")
        for v in c["values"]:
            assert (int(v["step"]), v.get("censored", False)) == out[c["cell"]][int(v["seed"])], v
    [d] = r["differences"]
    counts = {"first": 0, "later": 0, "ties": 0, "unordered": 0}
    diffs = []
    for seed in (1, 2, 3):
        (cs, cc), (bs, bc) = out[cells[1]][seed], out[cells[0]][seed]
        if not cc and not bc:
            diffs.append(cs - bs)
            counts["first" if cs < bs else "later" if cs > bs else "ties"] += 1
        elif not cc and cs <= bs:
            counts["first"] += 1
        elif not bc and bs <= cs:
            counts["later"] += 1
        else:
            counts["unordered"] += 1
    for k, v in counts.items():
        assert d.get(k, 0) == v, (k, d, out)
    assert d.get("n", 0) == len(diffs), (d, out)
    if diffs:
        close(d["mean"], mean(diffs), 1e-9, "paired steps difference")
    close(d["sign_p_value"], sign_test_p(counts["first"], counts["later"]), 1e-12, "sign test p")
    table = up.loom("sweep", "report", sweep["id"], "--select", "reach", "--threshold", repr(level))
    assert "steps until eval_loss <=" in table and "sign p" in table, table
    for query in ("select=reach", "select=reach&threshold=-1", "select=reach&threshold=abc",
                  "select=reach&length=80&threshold=1"):
        status, body, text = up.api.request("GET", f"/v1/sweeps/{sweep['id']}/report?{query}")
        field = "length" if "length" in query else "threshold"
        assert status == 400 and field in body["error"]["message"], (query, status, text)
    print(f"ok: {sweep['id']}: steps until eval loss <= {level:.4f} = independent computation "
          f"({counts})")


def check_mean_report(up, sweep):
    """select mean (the metric over the held-out evaluations after step 0) against the same
    from the jobs' evals, for eval_loss and accuracy, through the API and the CLI."""
    for metric in ("eval_loss", "accuracy"):
        curve = {}  # cell -> seed -> mean over the evaluations after step 0
        for j in sweep["jobs"]:
            evals = [e for e in up.api.job(j["job_id"])["evals"]
                     if e.get("kind", "") in ("", "heldout", "validation")
                     and int(e.get("step", 0)) > 0]
            assert len(evals) == 3, evals  # steps 10, 20, 30
            curve.setdefault(j["cell"], {})[int(j["seed"])] = mean([e.get(metric, 0.0) for e in evals])
        r = up.api.ok("GET", f"/v1/sweeps/{sweep['id']}/report?select=mean&metric={metric}")
        assert r["select"] == "mean" and r["metric"] == metric, r
        cells = sweep["cells"]
        for c in r["cells"]:
            x = [curve[c["cell"]][s] for s in (1, 2, 3)]
            assert c["n"] == 3, c
            close(c.get("mean", 0.0), mean(x), 1e-9, f"{c['cell']} select mean {metric}")
            close(c.get("sd", 0.0), sd(x), 1e-9, f"{c['cell']} select mean {metric} sd")
        [d] = r["differences"]
        diffs = [curve[cells[1]][s] - curve[cells[0]][s] for s in (1, 2, 3)]
        close(d.get("mean", 0.0), mean(diffs), 1e-9, f"select mean {metric} paired difference")
        lo, hi = t_interval(diffs)
        close(d.get("t_low", 0.0), lo, 1e-6, f"select mean {metric} paired t low")
        cli = json.loads(up.loom("sweep", "report", sweep["id"], "--select", "mean", "--metric",
                                 metric, "--format", "json"))
        assert cli == r, (cli, r)
    status, body, text = up.api.request("GET", f"/v1/sweeps/{sweep['id']}/report?select=mean&length=80")
    assert status == 400 and "length" in body["error"]["message"], (status, text)
    print(f"ok: {sweep['id']}: select mean (the held-out curve after step 0) = independent computation")


SPLITS_SWEEP = """name: early-stopping
base:
  spec:
    preset: micro
    steps: 400
    micro_batch: 32
    seq_len: 100
    threads: 1
    optimizer: {lr: 0.03, min_lr: 0.03, warmup_steps: 1}
    model: {d_model: 32, n_layers: 1, n_heads: 4, vocab_size: 2, max_seq_len: 100, mode: encoder,
            num_classes: 1, grid_max_rows: 10, grid_max_cols: 10, tie_embeddings: false, rope_theta: 0}
    data: {source: task, task: relation_binary, splits: {train: 128, validation: 32, test: 32}}
    eval: {patience: 2}
grid:
  optimizer.lr: [0.03]
seeds: [1, 2]
metric: accuracy
select: test
request_id: splits-1
"""


def test_select_test_early_stopping(up, tmp):
    """data.splits through the agent: validation and test evaluations arrive with their kind, the
    jobs stop early, and select test reports the test metric at the best validation epoch."""
    path = write(tmp, "splits.yaml", SPLITS_SWEEP)
    sweep = up.wait_sweep(json.loads(up.loom("sweep", "submit", path, "--json"))["id"])
    assert sweep["state"] == "finished" and sweep["job_states"] == {"succeeded": 2}, sweep
    values = []
    for j in sweep["jobs"]:
        job = up.api.job(j["job_id"])
        evals = sorted(job["evals"], key=lambda e: int(e.get("step", 0)))
        kinds = {e.get("kind", "") for e in evals}
        assert kinds == {"validation", "test"}, kinds
        validations = [e for e in evals if e.get("kind") == "validation" and int(e.get("step", 0)) > 0]
        tests = [e for e in evals if e.get("kind") == "test"]
        best = min(validations, key=lambda e: e.get("eval_loss", 0))
        assert int(tests[-1]["step"]) == int(best["step"]), (tests[-1], best)
        last = int(validations[-1]["step"])
        assert last < 400 and last == int(best["step"]) + 2 * 4, (last, best)  # patience 2, 4 steps/epoch
        values.append(tests[-1].get("accuracy", 0))
    report = up.api.ok("GET", f"/v1/sweeps/{sweep['id']}/report")
    [c] = report["cells"]
    assert c["n"] == 2, c
    close(c["mean"], mean(values), 1e-12, "select test mean")
    print(f"ok: {sweep['id']}: early stopping through the agent, select test = test accuracy at the "
          f"best validation epoch ({values})")


LENGTHS_SWEEP = """name: needle-lengths
base:
  spec:
    preset: micro
    steps: 12
    micro_batch: 4
    seq_len: 200
    threads: 1
    model: {max_seq_len: 256}
    data: {source: task, task: needle, task_options: {needles: 1, queries: 1}}
    eval: {interval: 6, batches: 2, lengths: [80, 120]}
grid:
  optimizer.lr: [0.003]
seeds: [1, 2]
metric: eval_loss
request_id: lengths-1
"""


def test_report_at_an_eval_length(up, tmp):
    """eval.lengths evaluations arrive with kind length and their length; a plain report ignores
    them (they come last, at the final step), ?length= / --length reads only that length's."""
    path = write(tmp, "lengths.yaml", LENGTHS_SWEEP)
    sweep = up.wait_sweep(json.loads(up.loom("sweep", "submit", path, "--json"))["id"])
    assert sweep["job_states"] == {"succeeded": 2}, sweep
    final, at = [], {80: [], 120: []}  # 0, 1 and 3 filler sentences at 80, 120 and 200 bytes
    for j in sorted(sweep["jobs"], key=lambda j: int(j["seed"])):
        evals = up.api.job(j["job_id"])["evals"]
        held_out = [e for e in evals if e.get("kind", "") == ""]
        final.append(max(held_out, key=lambda e: int(e.get("step", 0)))["eval_loss"])
        for length in at:
            [e] = [e for e in evals if e.get("kind") == "length" and int(e["length"]) == length]
            assert int(e["step"]) == 12, e
            at[length].append(e["eval_loss"])
    assert len({tuple(final), tuple(at[80]), tuple(at[120])}) == 3, (final, at)
    plain = up.api.ok("GET", f"/v1/sweeps/{sweep['id']}/report")
    close(plain["cells"][0]["mean"], mean(final), 1e-12, "training-length mean")
    for length, values in at.items():
        r = up.api.ok("GET", f"/v1/sweeps/{sweep['id']}/report?length={length}")
        assert int(r["length"]) == length and r["cells"][0]["n"] == 2, r
        close(r["cells"][0]["mean"], mean(values), 1e-12, f"length {length} mean")
    cli = json.loads(up.loom("sweep", "report", sweep["id"], "--length", "120", "--format", "json"))
    close(cli["cells"][0]["mean"], mean(at[120]), 1e-12, "CLI --length mean")
    for query, field in (("length=-1", "length"), ("length=80&select=test", "length")):
        status, body, text = up.api.request("GET", f"/v1/sweeps/{sweep['id']}/report?{query}")
        assert status == 400 and field in body["error"]["message"], (query, status, text)
    print(f"ok: {sweep['id']}: reports at the training length and at eval.lengths 80 and 120 match the "
          "jobs' own evaluations")


def test_partial_report_and_cancel(up, tmp):
    path = write(tmp, "long.yaml", SWEEP.format(steps=100000, seeds="[1, 2]", request_id="long-1"))
    sweep_id = json.loads(up.loom("sweep", "submit", path, "--json"))["id"]
    wait_for("two running jobs", lambda: up.api.ok("GET", f"/v1/sweeps/{sweep_id}")["job_states"]
             .get("running", 0) == 2, 60)
    report = up.api.ok("GET", f"/v1/sweeps/{sweep_id}/report")
    assert not report.get("complete") and sum(c.get("pending", 0) for c in report["cells"]) == 4, report
    curves = up.api.ok("GET", f"/v1/sweeps/{sweep_id}/curves")
    assert not curves.get("complete") and len(curves["differences"]) == 1, curves
    cancelled = json.loads(up.loom("sweep", "cancel", sweep_id, "--json"))
    assert cancelled["state"] == "cancelled" and cancelled["job_states"] == {"cancelled": 4}, cancelled
    for j in cancelled["jobs"]:
        assert up.api.job(j["job_id"])["state"] == "cancelled"
    status, parsed, _ = up.api.request("GET", "/v1/sweeps/sweep-424242")
    assert status == 404 and "not found" in parsed["error"]["message"], parsed
    bad = write(tmp, "bad.yaml", SWEEP.format(steps=10, seeds="[1, 1]", request_id="bad-1"))
    r = subprocess.run([up.args.loom, "sweep", "submit", bad], env=up.env, capture_output=True, text=True)
    assert r.returncode == 4 and "seeds" in r.stderr, (r.returncode, r.stderr)  # refused by the coordinator
    print(f"ok: {sweep_id}: partial report while running (4 pending), cancel stopped all 4 jobs; "
          "bad sweeps refused naming the field")


def test_two_hundred_jobs(up, tmp):
    text = SWEEP.format(steps=2, seeds=json.dumps(list(range(1, 101))), request_id="many-1")
    text = text.replace("eval: {interval: 10, batches: 2}", "eval: {batches: 1}")
    path = write(tmp, "many.yaml", text)
    started = time.time()
    created = json.loads(up.loom("sweep", "submit", path, "--json"))
    assert created["jobs"] == 200, created
    mid = wait_for("some finished jobs", lambda: (lambda r: sum(c["n"] for c in r["cells"]) >= 10 and r)(
        up.api.ok("GET", f"/v1/sweeps/{created['id']}/report")), 600, interval=1)
    assert not mid["complete"], "expected a partial report"
    sweep = up.wait_sweep(created["id"], timeout=900)
    assert sweep["job_states"] == {"succeeded": 200}, sweep["job_states"]
    report = up.api.ok("GET", f"/v1/sweeps/{created['id']}/report")
    assert report["complete"] and [c["n"] for c in report["cells"]] == [100, 100], report["cells"]
    assert report["differences"][0]["n"] == 100
    ids = {j["job_id"] for j in sweep["jobs"]}
    assert len(ids) == 200
    print(f"ok: {created['id']}: 200 jobs on 2 slots all ran and reported ({time.time() - started:.0f} s)")
    return sweep

def held_out_curves(up, sweep, metric="eval_loss"):
    """cell -> seed -> step -> metric: each job's held-out evaluations, the latest attempt's."""
    out = {}
    for j in sweep["jobs"]:
        latest = {}
        for e in up.api.job(j["job_id"])["evals"]:
            if e.get("kind", "") not in ("", "heldout", "validation"):
                continue
            step = int(e.get("step", 0))
            if step not in latest or e.get("attempt", 0) >= latest[step].get("attempt", 0):
                latest[step] = e
        out.setdefault(j["cell"], {})[int(j["seed"])] = {k: e.get(metric, 0.0) for k, e in latest.items()}
    return out


def check_point(p, x, paired, what):
    assert p["n"] == len(x), (what, p, x)
    close(p["mean"], mean(x), 1e-12, f"{what} mean")
    close(p.get("sd", 0.0), sd(x), 1e-9, f"{what} sd")
    lo, hi = t_interval(x)
    close(p["ci_low"], lo, 1e-6, f"{what} low")
    close(p["ci_high"], hi, 1e-6, f"{what} high")
    if paired:
        tstat = mean(x) / (sd(x) / math.sqrt(len(x)))
        close(p.get("p_value", 0.0), 2 * (1 - t_cdf(abs(tstat), len(x) - 1)), 1e-5, f"{what} p")


def check_curves(up, sweep, report):
    """The curves at every evaluation step against this script's computation from the jobs'
    evaluations; their last step is the report (select final); the CLI prints what the API serves."""
    raw = held_out_curves(up, sweep)
    curves = up.api.ok("GET", f"/v1/sweeps/{sweep['id']}/curves")
    assert curves["complete"] and curves["baseline"] == sweep["cells"][0], curves
    steps = sorted(raw[sweep["cells"][0]][1])
    assert steps == [0, 10, 20, 30], steps
    for c in curves["cells"]:
        assert [int(p["step"]) for p in c["points"]] == steps and c["seeds"] == 3, c
        for p in c["points"]:
            x = [raw[c["cell"]][s][int(p["step"])] for s in (1, 2, 3)]
            check_point(p, x, False, f"{c['cell']} at {p['step']}")
    [d] = curves["differences"]
    base = sweep["cells"][0]
    for p in d["points"][1:]:  # step 0: the same weights, so every difference is 0
        x = [raw[d["cell"]][s][int(p["step"])] - raw[base][s][int(p["step"])] for s in (1, 2, 3)]
        check_point(p, x, True, f"difference at {p['step']}")
    assert d["points"][0]["n"] == 3 and not d["points"][0].get("mean"), d["points"][0]
    last, r = d["points"][-1], report["differences"][0]
    assert (last["mean"], last["ci_low"], last["ci_high"]) == (r["mean"], r["t_low"], r["t_high"]), (last, r)
    cli = json.loads(up.loom("sweep", "curves", sweep["id"], "--format", "json"))
    assert cli == curves, (cli, curves)
    csv = up.loom("sweep", "curves", sweep["id"], "--format", "csv").splitlines()
    assert csv[0] == "kind,cell,baseline,step,n,mean,sd,low,high,p_value" and len(csv) == 1 + 3 * len(steps), csv
    table = up.loom("sweep", "curves", sweep["id"])
    assert f"eval_loss - {base} by step, paired by seed" in table, table
    png = os.path.join(up.tmp, "curves.png")
    up.loom("sweep", "curves", sweep["id"], "--metric", "accuracy", "--plot", png)
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    accuracy = up.api.ok("GET", f"/v1/sweeps/{sweep['id']}/curves?metric=accuracy")
    raw_accuracy = held_out_curves(up, sweep, "accuracy")
    p = accuracy["cells"][1]["points"][-1]
    check_point(p, [raw_accuracy[sweep["cells"][1]][s][30] for s in (1, 2, 3)], False, "accuracy at 30")
    for query, field in (("metric=perplexity", "metric"), ("select=best", "select"),
                         ("baseline=nope", "baseline")):
        status, body, text = up.api.request("GET", f"/v1/sweeps/{sweep['id']}/curves?{query}")
        assert status == 400 and body["error"]["message"].startswith(field), (query, status, text)
    print(f"ok: {sweep['id']}: curves at steps {steps} = independent computation per step; the last "
          "step is the report")


REASONING_SWEEP = """name: sft-pairs
base:
  spec:
    kind: sft
    preset: micro
    model: {vocab_size: 260}
    micro_batch: 8
    seq_len: 128
    threads: 1
    optimizer: {lr: 0.003, warmup_steps: 10}
    data: {source: chat, task: arithmetic, task_options: {count: "1000", ops: "1"}}
    reasoning_eval: {problems: 12, samples: 3, generation: {max_new_tokens: 160}}
grid:
  steps: [150, 400]
seeds: [1, 2, 3]
metric: pass@1
request_id: sft-pairs-1
"""


def problem_scores(details_path, metric):
    """Per problem, from the trainer's details file: the fraction of correct samples (pass@1),
    whether the majority answer was right (maj@k), or the fraction with an answer (answered)."""
    with open(details_path) as f:
        problems = json.load(f)["details"]
    if metric == "maj@k":
        return [1.0 if p["majority_correct"] else 0.0 for p in problems]
    if metric == "answered":
        return [sum(a is not None for a in p["answers"]) / len(p["answers"]) for p in problems]
    return [p["correct"] / len(p["answers"]) for p in problems]


def test_reasoning_metrics(up, tmp):
    """metric pass@1 | maj@k | answered: each job's value is its reasoning evaluation's; cells are
    paired by seed and, as the problems are the same, by problem (per problem the difference
    averaged over seeds, paired t over problems), as computed here from the details files."""
    path = write(tmp, "sft-sweep.yaml", REASONING_SWEEP)
    sweep = up.wait_sweep(json.loads(up.loom("sweep", "submit", path, "--json"))["id"])
    assert sweep["job_states"] == {"succeeded": 6}, sweep
    details = {}
    for j in sweep["jobs"]:
        [e] = [e for e in up.api.job(j["job_id"])["evals"] if e.get("kind") == "reasoning"]
        assert int(e["problems"]) == 12 and e["samples"] == 3 and len(e["problem_correct"]) == 12, e
        details.setdefault(j["cell"], {})[int(j["seed"])] = (e, e["details"])
    base, cell = sweep["cells"]
    varied = False
    for metric, field in (("pass@1", "pass_at_1"), ("maj@k", "maj_at_k"), ("answered", "answered")):
        r = up.api.ok("GET", f"/v1/sweeps/{sweep['id']}/report?metric={metric.replace('@', '%40')}")
        scores = {c: {s: problem_scores(d[1], metric) for s, d in details[c].items()} for c in details}
        for c in r["cells"]:
            x = [mean(scores[c["cell"]][s]) for s in (1, 2, 3)]
            for s in (1, 2, 3):  # the job's summary is the mean of its per-problem scores
                close(details[c["cell"]][s][0].get(field, 0.0), x[s - 1], 1e-9, f"{metric} seed {s}")
            close(c.get("mean", 0.0), mean(x), 1e-12, f"{c['cell']} {metric} mean")
        [d] = r["differences"]
        per_seed = [mean(scores[cell][s]) - mean(scores[base][s]) for s in (1, 2, 3)]
        close(d.get("mean", 0.0), mean(per_seed), 1e-12, f"{metric} paired mean")
        per_problem = [mean([scores[cell][s][i] - scores[base][s][i] for s in (1, 2, 3)]) for i in range(12)]
        assert d["problems"] == 12, d
        close(d.get("problem_mean", 0.0), mean(per_problem), 1e-12, f"{metric} mean over problems")
        varied |= sd(per_problem) > 0
        if sd(per_problem) > 0:
            lo, hi = t_interval(per_problem)
            close(d["problem_t_low"], lo, 1e-6, f"{metric} problem t low")
            close(d["problem_t_high"], hi, 1e-6, f"{metric} problem t high")
            tstat = mean(per_problem) / (sd(per_problem) / math.sqrt(12))
            close(d["problem_p_value"], 2 * (1 - t_cdf(abs(tstat), 11)), 1e-5, f"{metric} problem p")
    # 150 steps of SFT answer about 90 % of samples and get almost none right; 400 steps answer
    # all and get some right: the per-problem scores vary, so the comparisons above are not of zeros.
    assert varied, "every per-problem difference was constant: the test compared nothing"
    table = up.loom("sweep", "report", sweep["id"], "--metric", "maj@k")
    assert "paired by problem" in table, table
    for query, field in (("metric=pass%401&select=best", "select"), ("metric=maj%40k&length=64", "length")):
        status, body, text = up.api.request("GET", f"/v1/sweeps/{sweep['id']}/report?{query}")
        assert status == 400 and body["error"]["message"].startswith(field), (query, status, text)
    print(f"ok: {sweep['id']}: pass@1, maj@k and answered paired by seed and by 12 problems = the "
          "details files' computation")


def final_losses(up, sweep, cell):
    """seed -> the job's last held-out eval loss, for one cell of a sweep."""
    out = {}
    for j in sweep["jobs"]:
        if j["cell"] == cell:
            evals = sorted(up.api.job(j["job_id"])["evals"], key=lambda e: int(e.get("step", 0)))
            out[int(j["seed"])] = evals[-1]["eval_loss"]
    return out


def test_baseline_from_another_sweep(up, tmp, pairs, pairs_raw, many):
    """A report against another sweep's cell (?baseline=SWEEP_ID/CELL, --baseline): the cell joins
    the report with all its seeds, and each of this sweep's cells is paired with it over the
    seeds both have (here 1-3 of the 100), as computed here from the jobs' own evaluations."""
    name = "optimizer.lr=0.001"
    baseline = f"{many['id']}/{name}"
    other = final_losses(up, many, name)
    r = up.api.ok("GET", f"/v1/sweeps/{pairs['id']}/report?baseline={baseline.replace('=', '%3D')}")
    assert r["baseline"] == baseline and [c["cell"] for c in r["cells"]] == pairs["cells"] + [baseline], r
    foreign = r["cells"][-1]
    assert foreign["sweep_id"] == many["id"] and foreign["n"] == 100, foreign
    # The two sweeps' jobs differ in steps and evaluation, and so in the resolved optimizer (its
    # schedule is fitted to the steps; one cell's lr differs too): the report says so.
    expected = [f"cell '{c}' and the baseline '{baseline}' differ in more than the model: "
                "optimizer, steps, eval" for c in pairs["cells"]]
    assert r.get("warnings") == expected, (r.get("warnings"), expected)
    close(foreign["mean"], mean([other[s] for s in sorted(other)]), 1e-12, "baseline cell mean")
    for d in r["differences"]:
        diffs = [pairs_raw[d["cell"]][s] - other[s] for s in (1, 2, 3)]
        assert d["baseline"] == baseline and d["n"] == 3, d
        close(d["mean"], mean(diffs), 1e-12, f"{d['cell']} - baseline mean")
        lo, hi = t_interval(diffs)
        close(d["t_low"], lo, 1e-6, f"{d['cell']} - baseline t low")
        close(d["t_high"], hi, 1e-6, f"{d['cell']} - baseline t high")
    cli = json.loads(up.loom("sweep", "report", pairs["id"], "--baseline", baseline, "--format", "json"))
    assert cli == r, (cli, r)
    curves = up.api.ok("GET", f"/v1/sweeps/{pairs['id']}/curves?baseline={baseline.replace('=', '%3D')}")
    assert curves["cells"][-1]["sweep_id"] == many["id"] and curves.get("warnings") == expected, curves
    # Paired only at the steps where both the cell's and the baseline's job of a seed evaluated.
    base_steps = {int(e.get("step", 0)) for j in many["jobs"] if j["cell"] == name and int(j["seed"]) <= 3
                  for e in up.api.job(j["job_id"])["evals"]}
    for d in curves["differences"]:
        assert [int(p["step"]) for p in d["points"]] == sorted(base_steps & {0, 10, 20, 30}), (d, base_steps)
    png = os.path.join(tmp, "across.png")
    up.loom("sweep", "report", pairs["id"], "--baseline", baseline, "--plot", png)
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    for bad in ("optimizer.lr%3D0.5", "sweep-424242%2Fx", f"{many['id']}%2Fnope"):
        status, body, text = up.api.request("GET", f"/v1/sweeps/{pairs['id']}/report?baseline={bad}")
        assert status == 400 and body["error"]["message"].startswith("baseline: "), (bad, status, text)
    print(f"ok: {pairs['id']} against {baseline}: paired over seeds 1-3 as computed from the jobs")


def test_merge_more_seeds(up, tmp, pairs, pairs_raw, many):
    """A replication on new seeds reported with the first run (?merge=SWEEP_ID, --merge): the second
    sweep's jobs join the same-named cells, so each cell and the paired difference are over the
    five seeds of both, as computed here from the jobs' own evaluations."""
    path = write(tmp, "more.yaml", SWEEP.format(steps=30, seeds="[4, 5]", request_id="pairs-2"))
    more = up.wait_sweep(json.loads(up.loom("sweep", "submit", path, "--json"))["id"])
    assert more["job_states"] == {"succeeded": 4}, more
    raw = {c: {**pairs_raw[c], **final_losses(up, more, c)} for c in pairs["cells"]}
    r = up.api.ok("GET", f"/v1/sweeps/{pairs['id']}/report?merge={more['id']}")
    assert r["merged_sweeps"] == [more["id"]] and not r.get("warnings"), r
    for c in r["cells"]:
        x = [raw[c["cell"]][s] for s in (1, 2, 3, 4, 5)]
        assert c["n"] == 5 and sorted(int(v["seed"]) for v in c["values"]) == [1, 2, 3, 4, 5], c
        close(c["mean"], mean(x), 1e-12, f"merged {c['cell']} mean")
        close(c["sd"], sd(x), 1e-9, f"pooled {c['cell']} sd")
    [d] = r["differences"]
    diffs = [raw[d["cell"]][s] - raw[d["baseline"]][s] for s in (1, 2, 3, 4, 5)]
    assert d["n"] == 5, d
    close(d["mean"], mean(diffs), 1e-12, "pooled paired mean")
    lo, hi = t_interval(diffs)
    close(d["t_low"], lo, 1e-6, "pooled paired t low")
    close(d["t_high"], hi, 1e-6, "pooled paired t high")
    cli = json.loads(up.loom("sweep", "report", pairs["id"], "--merge", more["id"], "--format", "json"))
    assert cli == r, (cli, r)
    curves = up.api.ok("GET", f"/v1/sweeps/{pairs['id']}/curves?merge={more['id']}")
    last = curves["differences"][0]["points"][-1]
    assert curves["merged_sweeps"] == [more["id"]] and last["n"] == 5, curves
    check_point(last, diffs, True, "merged difference at the last step")
    table = up.loom("sweep", "report", pairs["id"], "--merge", more["id"])
    assert f"sweep {pairs['id']} + {more['id']}:" in table, table
    png = os.path.join(tmp, "merged.png")
    up.loom("sweep", "report", pairs["id"], "--merge", more["id"], "--plot", png)
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # The 100-seed sweep repeats seeds 1-3; the reported sweep cannot merge itself.
    for bad, says in ((many["id"], "has seed 1, which the cell has already"),
                      (pairs["id"], "is the reported sweep"),
                      (f"{more['id']},{more['id']}", "is listed twice"),
                      ("x" * 1100, "longer than 1024 characters")):
        status, body, text = up.api.request("GET", f"/v1/sweeps/{pairs['id']}/report?merge={bad}")
        assert status == 400 and body["error"]["message"].startswith("merge: ") and \
            says in body["error"]["message"], (bad, status, text)
    print(f"ok: {pairs['id']} merged with {more['id']}: 5 seeds per cell as computed from the jobs")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loom", required=True)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="loom-sweep-")
    up = None
    try:
        up = Up(args, tmp)
        pairs, pairs_raw = test_report_matches_raw_results(up, tmp)
        test_select_test_early_stopping(up, tmp)
        test_report_at_an_eval_length(up, tmp)
        test_reasoning_metrics(up, tmp)
        test_partial_report_and_cancel(up, tmp)
        many = test_two_hundred_jobs(up, tmp)
        test_baseline_from_another_sweep(up, tmp, pairs, pairs_raw, many)
        test_merge_more_seeds(up, tmp, pairs, pairs_raw, many)
    except BaseException:
        p = os.path.join(tmp, "up.log")
        if os.path.exists(p):
            sys.stderr.write("--- up.log (tail) ---\n" + open(p, errors="replace").read()[-4000:] + "\n")
        raise
    finally:
        if up is not None and up.proc.poll() is None:
            up.proc.send_signal(signal.SIGINT)
            try:
                up.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        kill_all(PROCS)
    subprocess.run(["rm", "-rf", tmp])
    print("sweeps: all checks passed")


if __name__ == "__main__":
    main()

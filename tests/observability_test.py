#!/usr/bin/env python3
"""Observability and deployment files, checked with the real tools and live services.

Static: promtool check config / check rules / test rules on deploy/prometheus; systemd-analyze
verify on the units (ExecStart pointed at this build); the Kubernetes manifests parse and carry
the required fields; the Slurm script passes bash -n and shellcheck.

Live: `loom up` (coordinator + worker agent) runs a training job; a real `prometheus` started
with the shipped deploy/prometheus config (scrape and evaluation interval shortened to 1 s, the
only edit) discovers both through file_sd, finds up == 1 for every target and a positive
tokens/s series for the job, and loads the alert rules. Every metric name used in a dashboard
panel or an alert is exposed by the running services; promtool check metrics passes on every
/metrics endpoint; `loom plot` writes a PNG of the job's curves. Every process is stopped on exit.
"""
import argparse
import glob
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loom_testlib import free_port, kill_all, wait_for  # noqa: E402

PROCS = []


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)
    assert r.returncode == 0, f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r


def check_alerts_name_jobs(path):
    """Every alert on a per-job series (loom_coordinator_job_*, loom_train_*) keeps job_id (no
    `by (...)` without it, no `without (job_id)`) and names the job in its summary
    (loom-alerts-test.yml checks the label on the alerts that fire)."""
    with open(path) as f:
        rules = [r for g in yaml.safe_load(f)["groups"] for r in g["rules"]]
    per_job = [r for r in rules if re.search(r"\bloom_(coordinator_job_|train_)", r["expr"])]
    assert {"LoomJobFailed", "LoomJobNoProgress", "LoomRepeatedNanSkips",
            "LoomCheckpointsStalled"} <= {r["alert"] for r in per_job}, [r["alert"] for r in per_job]
    for r in per_job:
        assert "{{ $labels.job_id }}" in r["annotations"]["summary"], r
        for labels in re.findall(r"\bby\s*\(([^)]*)\)", r["expr"]):
            assert "job_id" in labels, f"{r['alert']}: by ({labels}) drops job_id"
        assert not re.search(r"\bwithout\s*\([^)]*job_id", r["expr"]), r
    print(f"ok: {len(per_job)} job-level alerts carry job_id")


def check_static(src, tmp, bin_dir):
    prom = os.path.join(src, "deploy", "prometheus")
    run(["promtool", "check", "config", os.path.join(prom, "prometheus.yml")])
    run(["promtool", "check", "config", os.path.join(prom, "prometheus-static.yml")])
    run(["promtool", "check", "rules", os.path.join(prom, "rules", "loom-alerts.yml")])
    r = run(["promtool", "test", "rules", "loom-alerts-test.yml"], cwd=os.path.join(prom, "rules"))
    assert "SUCCESS" in r.stdout, r.stdout
    check_alerts_name_jobs(os.path.join(prom, "rules", "loom-alerts.yml"))
    # systemd: the units as shipped, with ExecStart at this build's binaries (verify checks that
    # the executables exist).
    units = os.path.join(tmp, "units")
    os.makedirs(units)
    for path in glob.glob(os.path.join(src, "deploy", "systemd", "*.service")):
        with open(path) as f:
            text = f.read().replace("/usr/local/bin/", bin_dir + "/")
        with open(os.path.join(units, os.path.basename(path)), "w") as f:
            f.write(text)
    r = subprocess.run(["systemd-analyze", "verify", *sorted(glob.glob(os.path.join(units, "*.service")))],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "loom" not in r.stderr, r.stdout + r.stderr
    # Hardening: systemd's own exposure score of each shipped unit, at most 4.0 ("OK").
    for path in sorted(glob.glob(os.path.join(src, "deploy", "systemd", "*.service"))):
        r = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager", path],
                           capture_output=True, text=True, timeout=120, cwd=tmp)
        m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", r.stdout + r.stderr)
        assert m and float(m.group(1)) <= 4.0, f"{path}: {m and m.group(0)}\n{r.stdout[-3000:]}"
    # Kubernetes: every document parses and has what the cluster needs.
    with open(os.path.join(src, "deploy", "kubernetes", "loom.yaml")) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    kinds = {}
    for d in docs:
        assert {"apiVersion", "kind", "metadata"} <= set(d), d
        assert d["metadata"].get("name"), d
        kinds.setdefault(d["kind"], []).append(d)
    for kind in ["StatefulSet", "DaemonSet", "Service", "ServiceMonitor", "PersistentVolumeClaim"]:
        assert kind in kinds, f"no {kind} in deploy/kubernetes/loom.yaml"
    sts = kinds["StatefulSet"][0]
    assert sts["spec"]["replicas"] == 1 and sts["spec"]["volumeClaimTemplates"], sts
    mounts = {m["mountPath"] for m in sts["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--data-dir") + 1] in mounts, "RocksDB state must live on the volume"
    ds = kinds["DaemonSet"][0]["spec"]["template"]["spec"]["containers"][0]
    assert ds["resources"]["limits"]["nvidia.com/gpu"] >= 1, ds
    for d in docs:  # selectors match their pod templates
        if d["kind"] in ("StatefulSet", "DaemonSet"):
            sel = d["spec"]["selector"]["matchLabels"]
            assert sel.items() <= d["spec"]["template"]["metadata"]["labels"].items(), d["metadata"]["name"]
    check_workloads(src, [d for d in docs if d["kind"] in ("StatefulSet", "DaemonSet")])
    # Its object-store variant: no shared claim; the store's settings from a Secret, on both.
    with open(os.path.join(src, "deploy", "kubernetes", "loom-object-store.yaml")) as f:
        s3_docs = [d for d in yaml.safe_load_all(f) if d]
    assert "PersistentVolumeClaim" not in {d["kind"] for d in s3_docs}
    for d in s3_docs:
        if d["kind"] in ("StatefulSet", "DaemonSet"):
            c = d["spec"]["template"]["spec"]["containers"][0]
            assert {"secretRef": {"name": "loom-s3"}} in c.get("envFrom", []), d["metadata"]["name"]
    sts3 = next(d for d in s3_docs if d["kind"] == "StatefulSet")
    assert "--checkpoint-store" in sts3["spec"]["template"]["spec"]["containers"][0]["args"]
    check_workloads(src, [d for d in s3_docs if d["kind"] in ("StatefulSet", "DaemonSet")])
    # Slurm.
    script = os.path.join(src, "deploy", "slurm", "loom-workers.sbatch")
    run(["bash", "-n", script])
    run(["shellcheck", script])
    with open(script) as f:
        text = f.read()
    lead = int(re.search(r"^#SBATCH --signal=B:TERM@(\d+)$", text, re.M).group(1))
    grace_ms = int(re.search(r"--term-grace-ms (\d+)", text).group(1))
    assert grace_ms < lead * 1000, "ranks must be able to checkpoint before the walltime"
    print("ok: promtool config/rules/tests, systemd-analyze verify, Kubernetes fields, Slurm bash -n + shellcheck")


def check_workloads(src, workloads):
    """Every pod runs the Dockerfile's image as its non-root user, read-only, without
    capabilities, with startup/readiness/liveness probes on a declared port and resource
    requests (never BestEffort); GPU workers tolerate the GPU taint and give the agent's rank
    shutdown (--term-grace-ms) time to finish within the pod's grace period."""
    with open(os.path.join(src, "Dockerfile")) as f:
        dockerfile = f.read()
    assert re.search(r"^FROM debian:12 AS build$", dockerfile, re.M), "the build stage is Debian 12"
    assert "scripts/install-deps" in dockerfile and "scripts/runtime-packages" in dockerfile
    user = re.findall(r"^USER (\d+):(\d+)$", dockerfile, re.M)
    assert user and user[-1][0] != "0", f"the image must run as a non-root uid: {user}"
    tag = re.search(r"docker build -t (\S+)", dockerfile).group(1)
    for w in workloads:
        name, pod = w["metadata"]["name"], w["spec"]["template"]["spec"]
        psc = pod["securityContext"]
        assert psc["runAsNonRoot"] and str(psc["runAsUser"]) == user[-1][0], (name, psc)
        assert psc["seccompProfile"]["type"] == "RuntimeDefault", (name, psc)
        for c in pod["containers"]:
            assert c["image"] == tag, f"{name}: image {c['image']}, the Dockerfile builds {tag}"
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] and sc["allowPrivilegeEscalation"] is False, (name, sc)
            assert sc["capabilities"]["drop"] == ["ALL"], (name, sc)
            ports = {p["containerPort"] for p in c["ports"]}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert c[probe]["httpGet"]["path"] == "/healthz" and c[probe]["httpGet"]["port"] in ports, \
                    (name, probe, c.get(probe))
            req = c["resources"]["requests"]
            assert req.get("cpu") and req.get("memory") and c["resources"]["limits"].get("memory"), (name, req)
            mounts = {m["mountPath"] for m in c["volumeMounts"]}
            assert "/tmp" in mounts, f"{name}: a writable /tmp on a read-only root filesystem"
        if w["kind"] == "DaemonSet":
            assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"]), (name, pod.get("tolerations"))
            grace_ms = int(re.search(r"--term-grace-ms (\d+)", " ".join(pod["containers"][0]["args"])).group(1))
            assert grace_ms < pod["terminationGracePeriodSeconds"] * 1000, (grace_ms, pod["terminationGracePeriodSeconds"])


def used_metric_names(src):
    """Metric names referenced by every dashboard panel and every alert rule."""
    exprs = []
    for path in glob.glob(os.path.join(src, "deploy", "grafana", "dashboards", "*.json")):
        with open(path) as f:
            dash = json.load(f)
        for panel in dash["panels"]:
            exprs += [t["expr"] for t in panel["targets"]]
        for var in dash["templating"]["list"]:
            if var.get("type") == "query":
                exprs.append(var["definition"])
    with open(os.path.join(src, "deploy", "prometheus", "rules", "loom-alerts.yml")) as f:
        for group in yaml.safe_load(f)["groups"]:
            exprs += [r["expr"] for r in group["rules"]]
    names = set()
    for e in exprs:
        names |= set(re.findall(r"\b(loom_[a-z0-9_]+)", e))
    assert len(exprs) > 30 and len(names) > 25, (len(exprs), names)
    return names


def scrape(url, token=None):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read().decode()


def exposed(text):
    """name -> type from the # TYPE lines, plus which names carry samples."""
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    sampled = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0)
            for suffix in ("_bucket", "_sum", "_count"):
                if name.endswith(suffix) and types.get(name[: -len(suffix)]) == "histogram":
                    name = name[: -len(suffix)]
            sampled.add(name)
    return types, sampled


def prom_query(port, q):
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": q})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]["result"]


def operator_scrape_job(src, targets_dir):
    """The scrape job the Prometheus Operator generates from deploy/kubernetes' ServiceMonitor:
    honor_labels from the endpoints (default false) and, on every target, the labels its
    relabelling sets (job = the Service's name, namespace, service, pod, container, endpoint)."""
    with open(os.path.join(src, "deploy", "kubernetes", "loom.yaml")) as f:
        monitor = next(d for d in yaml.safe_load_all(f) if d and d["kind"] == "ServiceMonitor")
    honor = {bool(e.get("honorLabels", False)) for e in monitor["spec"]["endpoints"]}
    assert honor == {False}, "the ServiceMonitor should not need honorLabels"
    return {"job_name": f"serviceMonitor/{monitor['metadata']['namespace']}/{monitor['metadata']['name']}/0",
            "honor_labels": False,
            "file_sd_configs": [{"files": [os.path.join(targets_dir, "*.json")], "refresh_interval": "1s"}]}


def write_operator_targets(loom_targets, operator_targets):
    """loom up's discovered targets, labelled the way the operator labels the pods' endpoints."""
    ports = {"loom-coordinator": "http", "loom-worker": "metrics"}
    for path in glob.glob(os.path.join(loom_targets, "*.json")):
        with open(path) as f:
            groups = json.load(f)
        for g in groups:
            svc = g["labels"]["service"]
            g["labels"] = {"job": svc, "namespace": "loom", "service": svc, "pod": f"{svc}-0",
                           "container": svc, "endpoint": ports[svc]}
        with open(os.path.join(operator_targets, os.path.basename(path)), "w") as f:
            json.dump(groups, f)


def check_labels(prom_port, job_id):
    """Loom's labels arrive as they are under both scrape configs: no exported_* renames."""
    series = prom_query(prom_port, '{__name__=~"loom_.+"}')
    renamed = sorted({k for s in series for k in s["metric"] if k.startswith("exported_")})
    assert not renamed, f"labels renamed by the scrape: {renamed}"
    for job in ("loom", "loom-worker"):
        tps = prom_query(prom_port, f'loom_train_tokens_per_second{{job="{job}", job_id="{job_id}"}}')
        assert tps and all(s["metric"].get("worker") and s["metric"].get("rank") == "0" for s in tps), (job, tps)
    info = prom_query(prom_port, 'loom_build_info{job="loom"}')
    assert sorted(s["metric"]["component"] for s in info) == ["coordinator", "worker"], info
    assert all(s["metric"]["commit"] and s["metric"]["version"] for s in info), info
    print(f"ok: {len(series)} series, no exported_* labels under the file_sd and the Prometheus "
          f"Operator scrape configs; job_id, worker, rank and loom_build_info present")


def check_live(args, tmp):
    src = args.source_dir
    prom_dir = os.path.join(tmp, "prometheus")
    shutil.copytree(os.path.join(src, "deploy", "prometheus"), prom_dir)
    cfg = os.path.join(prom_dir, "prometheus.yml")
    with open(cfg) as f:
        text = f.read()
    text = (text.replace("scrape_interval: 15s", "scrape_interval: 1s")
            .replace("evaluation_interval: 15s", "evaluation_interval: 1s")
            .replace("refresh_interval: 30s", "refresh_interval: 1s"))
    # Besides the shipped config (only its intervals shortened), a second scrape job of the same
    # targets as the Prometheus Operator would configure it from the ServiceMonitor.
    operator_targets = os.path.join(prom_dir, "operator-targets")
    os.makedirs(operator_targets)
    config = yaml.safe_load(text)
    config["scrape_configs"].append(operator_scrape_job(src, operator_targets))
    with open(cfg, "w") as f:
        yaml.safe_dump(config, f)
    targets = os.path.join(prom_dir, "targets")
    os.makedirs(targets)
    port = free_port()
    # loom up writes its generated user token to $XDG_CONFIG_HOME/loom/local-<port>.token (0600);
    # the CLI picks it up by itself for LOOM_COORDINATOR=http://127.0.0.1:<port>.
    xdg = os.path.join(tmp, "xdg")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOOM_COORDINATOR": f"http://127.0.0.1:{port}",
           "XDG_CONFIG_HOME": xdg}
    env.pop("LOOM_TOKEN", None)
    up = subprocess.Popen([args.loom, "up", "--workers", "1", "--slots", "2", "--port", str(port),
                           "--data-dir", os.path.join(tmp, "up"), "--prometheus-dir", targets],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    PROCS.append(up)
    wait_for("two target files", lambda: len(glob.glob(os.path.join(targets, "*.json"))) == 2, 30)
    write_operator_targets(targets, operator_targets)
    token_file = os.path.join(xdg, "loom", f"local-{port}.token")
    wait_for("loom up's token file", lambda: os.path.isfile(token_file), 30)
    with open(token_file) as f:
        token = f.read().strip()
    prom_port = free_port()
    prom = subprocess.Popen(["prometheus", f"--config.file={cfg}", f"--storage.tsdb.path={tmp}/tsdb",
                             f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "prometheus.log"), "w"))
    PROCS.append(prom)
    job = {"spec": {"preset": "micro", "steps": 600, "micro_batch": 4, "seq_len": 32, "threads": 1,
                    "data": {"corpus_bytes": 65536}, "eval": {"batches": 1, "interval": 100},
                    "checkpoint": {"interval": 100}, "metrics": {"log_every": 10}},
           "world_size": 2}
    job_file = os.path.join(tmp, "job.json")
    with open(job_file, "w") as f:
        json.dump(job, f)
    r = run([args.loom, "submit", job_file, "--json"], env=env)
    job_id = json.loads(r.stdout)["id"]

    def running():
        st = json.loads(run([args.loom, "status", job_id, "--json"], env=env).stdout)
        return st["state"] == "running" and int(st["progress"].get("step", 0)) > 20 and st
    wait_for("the job to run", running, 60)

    # Every /metrics endpoint: valid exposition, and together they expose every name in use.
    all_types, all_sampled = {}, set()
    for path in glob.glob(os.path.join(targets, "*.json")):
        with open(path) as f:
            for group in json.load(f):
                for target in group["targets"]:
                    # /metrics is open to scrapers; the coordinator's API port also takes the token.
                    text = scrape(f"http://{target}/metrics", token if target.endswith(f":{port}") else None)
                    p = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
                    assert p.returncode == 0, f"promtool check metrics {target}: {p.stdout}{p.stderr}"
                    types, sampled = exposed(text)
                    all_types.update(types)
                    all_sampled |= sampled
    used = used_metric_names(src)
    missing = sorted(n for n in used if n not in all_types and
                     not any(n == t + s for t in all_types for s in ("_bucket", "_sum", "_count")))
    assert not missing, f"dashboards/alerts use metrics no service exposes: {missing}"
    for name in ["loom_train_tokens_per_second", "loom_train_loss", "loom_coordinator_jobs",
                 "loom_coordinator_job_progress_age_seconds", "loom_worker_ranks_running"]:
        assert name in all_sampled, f"{name} has no samples"

    # Prometheus sees both targets up and the job's throughput.
    def all_up():
        res = prom_query(prom_port, 'up{job="loom"}')
        both = prom_query(prom_port, 'up == 1')
        return len(res) == 2 and len(both) == 4 and all(x["value"][1] == "1" for x in res) and res
    res = wait_for("up == 1 for both targets", all_up, 60)
    services = sorted(x["metric"]["service"] for x in res)
    assert services == ["loom-coordinator", "loom-worker"], services
    # Over a window: a fast job may end (and its series go stale) before this query runs.
    tps = wait_for("a tokens/s series", lambda: prom_query(
        prom_port, f'max_over_time(loom_train_tokens_per_second{{job="loom", job_id="{job_id}"}}[10m]) > 0'), 60)
    assert float(tps[0]["value"][1]) > 0
    check_labels(prom_port, job_id)
    with urllib.request.urlopen(f"http://127.0.0.1:{prom_port}/api/v1/rules", timeout=10) as r:
        rules = [x for g in json.load(r)["data"]["groups"] for x in g["rules"]]
    assert len(rules) == 8 and all(x["health"] == "ok" for x in rules), rules
    print(f"ok: prometheus scraped coordinator + worker (up == 1), tokens/s {float(tps[0]['value'][1]):.0f} for "
          f"{job_id}; {len(used)} dashboard/alert metric names all exposed; promtool check metrics passes")

    # loom plot: a PNG with both curves.
    wait_for("the job to finish", lambda: json.loads(run([args.loom, "status", job_id, "--json"], env=env).stdout)
             ["state"] == "succeeded", 180)
    png = os.path.join(tmp, "plot.png")
    r = run([args.loom, "plot", job_id, "--file", png], env=env)
    points = int(re.search(r"\((\d+) points\)", r.stdout).group(1))
    assert points >= 50, r.stdout  # 600 steps logged every 10
    with open(png, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", data[:32]
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1000, 700) and len(data) > 20000 and data.endswith(b"IEND\xaeB`\x82"), \
        (width, height, len(data))
    print(f"ok: loom plot wrote a {width}x{height} PNG ({len(data)} bytes, {points} points)")
    up.send_signal(signal.SIGINT)
    up.wait(timeout=30)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loom", required=True)
    ap.add_argument("--source-dir", required=True)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="loom-observability-")
    try:
        check_static(args.source_dir, tmp, os.path.dirname(os.path.abspath(args.loom)))
        check_live(args, tmp)
    except BaseException:
        log = os.path.join(tmp, "prometheus.log")
        if os.path.exists(log):
            with open(log) as f:
                sys.stderr.write("--- prometheus.log (tail) ---\n" + f.read()[-3000:] + "\n")
        raise
    finally:
        for p in PROCS:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in PROCS:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        kill_all(PROCS)
    shutil.rmtree(tmp, ignore_errors=True)
    print("observability: all checks passed")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Network partitions, for real: the coordinator and three agents each in a network namespace of
this test's own, joined by veth pairs on a bridge (iproute2). Links are cut by setting a veth
down (both directions) or by a blackhole route in one namespace (one direction only).

1. The coordinator's link cut for 30 s (default lease, 90 s) while a 2-node gang trains: every
   worker is silent at once, which the coordinator takes for its own partition; no worker is
   marked lost, the ranks train on through the cut, the job keeps attempt 1, and every agent is
   heard again within a beat and a probe (1 s) of the heal.
2. One agent's link cut for 30 s while it hosts rank 0 of a 2-node gang (lease 8 s): its rank
   stops on its lease, the worker is lost, the job resumes on the two other nodes from its newest
   checkpoint, and at no sampled instant (every 50 ms) do two attempts run. When the link
   returns the agent registers again and runs new work.
3. The subtle case, a one-way cut: the coordinator's packets to the agent hosting rank 0 are
   dropped, the agent's packets still arrive. Same outcome as 2.

Skipped (exit 77, with the reason) where the kernel or the sandbox refuses namespaces.
"""
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loom_testlib import (AttemptSampler, Service, control_plane_arg_parser, loom_trainers, proc_state,  # noqa: E402
                          rank_log_step, stop_all, wait_for)

PROCS = []
ALICE = "alice-token-0123456789abcdef"
ENROLMENT_TOKEN = "enrolment-token-0123456789abcdef"
# Ten times loss detection (3 s), and more than the agent cases' lease (8 s) + grace + a new
# attempt's start; an agent cut lasts until attempt 2 has reported where it resumed, however long.
CUT_S = 30
SKIP = 77
NODES = ("a", "b", "c")


def ip(*argv, check=True):
    r = subprocess.run(["ip", *argv], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(argv)}: {r.stderr.strip()}")
    return r


class Network:
    """A bridge in this namespace (x.x.x.1) and one namespace per node on a veth port of it
    (coordinator .10, agents .11 up). Names carry this process's id, so concurrent runs differ."""

    def __init__(self):
        tag = os.getpid() % 100000
        self.bridge = f"lmb{tag}"
        self.prefix = f"10.{200 + tag % 50}.{tag // 50 % 250}"
        self.ns, self.port, self.addr = {}, {}, {}
        self.blackholes = []
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.prefix}.1/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        self.tag = tag

    def add(self, name, index):
        ns, port, addr = f"loom{self.tag}-{name}", f"lm{self.tag}p{index}", f"{self.prefix}.{10 + index}"
        ip("netns", "add", ns)
        self.ns[name], self.port[name], self.addr[name] = ns, port, addr
        ip("link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        ip("link", "set", port, "master", self.bridge)
        ip("link", "set", port, "up")
        ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", ns, "link", "set", "lo", "up")
        return addr

    def launcher(self, name):
        return ["ip", "netns", "exec", self.ns[name]]

    def cut(self, name):
        ip("link", "set", self.port[name], "down")

    def heal(self, name):
        ip("link", "set", self.port[name], "up")

    def drop_from(self, name, to):
        """Packets from `name` to `to` are dropped (a blackhole route in name's namespace)."""
        ip("-n", self.ns[name], "route", "add", "blackhole", f"{self.addr[to]}/32")
        self.blackholes.append((name, to))

    def undrop(self, name, to):
        ip("-n", self.ns[name], "route", "del", "blackhole", f"{self.addr[to]}/32")
        self.blackholes.remove((name, to))

    def remove(self):
        for ns in self.ns.values():
            ip("netns", "del", ns, check=False)  # its veth pair goes with it
        ip("link", "del", self.bridge, check=False)


def skip_reason():
    if os.geteuid() != 0:
        return "needs root (CAP_NET_ADMIN) to create network namespaces"
    probe = f"loomprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"the kernel refuses network namespaces: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    r = subprocess.run(["ip", "link", "add", f"lmprobe{os.getpid() % 10000}", "type", "bridge"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return f"the kernel refuses bridges: {r.stderr.strip()}"
    subprocess.run(["ip", "link", "del", f"lmprobe{os.getpid() % 10000}"], capture_output=True)
    return None


def gang_job(steps=10 ** 7, world=2, pool=None):
    spec = {"preset": "micro", "steps": steps, "micro_batch": 4, "seq_len": 32, "threads": 1,
            "data": {"corpus_bytes": 65536}, "eval": {"batches": 1},
            "checkpoint": {"interval": 20, "keep_last": 3}, "metrics": {"log_every": 5}}
    return {"spec": spec, "world_size": world, "pool": pool or {"pool": "cpu"}}


class Cluster:
    """A coordinator and the three agents, each in its namespace, with the given timings."""

    def __init__(self, args, net, tmp, flags):
        os.makedirs(tmp)
        prefix = {n: net.launcher(n) for n in ("coordinator", *NODES)}
        self.net = net
        self.s = Service(args, tmp, {"alice": ALICE}, ENROLMENT_TOKEN, flags, PROCS,
                         host=net.addr["coordinator"], prefix=prefix)
        self.s.start_coordinator()
        for n in NODES:
            self.s.start_worker(n, labels=f"pool=cpu,node={n}", slots=1,
                                extra=("--gpus", "none", "--address", net.addr[n]))
        self.s.wait_alive(list(NODES))
        self.api = self.s.api

    def start_gang(self):
        """A 2-node job, running with a checkpoint: (job id, rank 0's node, the other node)."""
        job = self.api.ok("POST", "/v1/jobs", gang_job())["id"]
        j = self.api.wait(job, lambda j: j["state"] == "running" and len(j.get("checkpoints", [])) >= 2,
                          "the gang to run with two checkpoints", timeout=180)
        nodes = {}
        for p in j["placement"]:
            for r in p["ranks"]:
                nodes[int(r)] = self.s.name_of(p["worker_id"])
        return job, nodes[0], nodes[1]

    def rank_pids(self, job, attempt):
        return [t["pid"] for t in loom_trainers(self.s.tmp) if t["job"] == job and t["attempt"] == attempt]

    def heard_since(self, names, since_ms):
        """True when every named worker has an alive record heard from after since_ms."""
        r = self.s.worker_records()
        return all(n in r and r[n]["state"] == "alive" and int(r[n]["last_heartbeat_ms"]) > since_ms for n in names)


def newest_step(job):
    return max([int(c.rsplit(".", 1)[1]) for c in job.get("checkpoints", [])] or [0])


def newest_on_disk(job):
    """The newest committed checkpoint (a step directory with its manifest) in the job's
    checkpoint directory."""
    root = job["spec"]["checkpoint"]["dir"]
    steps = [int(m.group(1)) for m in (re.fullmatch(r"step-(\d+)", n) for n in os.listdir(root)) if m and
             os.path.isfile(os.path.join(root, m.group(0), "manifest.json"))]
    return max(steps or [0])


def case_coordinator_cut(args, net, tmp):
    c = Cluster(args, net, os.path.join(tmp, "coordinator-cut"), ["--heartbeat-ms", "500", "--lost-after-ms", "3000", "--lease-ms", "90000"])
    job, rank0, rank1 = c.start_gang()
    before = [t for t in loom_trainers(c.s.tmp) if t["job"] == job]
    step_before = rank_log_step(c.s.tmp, job)
    net.cut("coordinator")
    try:
        time.sleep(CUT_S)
        during = [t for t in loom_trainers(c.s.tmp) if t["job"] == job]
        step_during = rank_log_step(c.s.tmp, job)
    finally:
        net.heal("coordinator")
    healed_ms = int(time.time() * 1000)
    assert sorted(t["pid"] for t in during) == sorted(t["pid"] for t in before), \
        f"the ranks did not train on through the cut: {before} -> {during}"
    assert step_during > step_before, f"no progress during the cut: step {step_before} -> {step_during}"
    back = wait_for("every agent heard after the heal", lambda: c.heard_since(NODES, healed_ms), timeout=30,
                    interval=0.05)
    back_s = time.time() - healed_ms / 1000
    assert back_s < 1.5, f"the agents were heard again only {back_s:.2f} s after the heal (beat 0.5 s, probe 1 s)"
    j = c.api.wait(job, lambda j: int(j["progress"]["step"]) > step_during, "progress reported after the heal",
                   timeout=60)
    assert j["state"] == "running" and j["attempt"] == 1 and j["restarts"] == 0 and j.get("infra_restarts", 0) == 0, j
    lost = [w for w in c.api.workers() if w["state"] != "alive"]
    assert not lost, f"workers marked lost for the coordinator's own partition: {lost}"
    metrics = c.api.request("GET", "/metrics")[2]
    assert "loom_coordinator_workers_lost_total 0" in metrics, "a worker was marked lost"
    c.api.ok("POST", f"/v1/jobs/{job}/cancel")
    print(f"ok: coordinator's link cut {CUT_S} s (lease 90 s): no worker lost, the gang ({rank0}, {rank1}) trained "
          f"on (step {step_before} -> {step_during} during the cut), attempt 1 throughout; all agents heard "
          f"{back_s:.2f} s after the heal")
    del back


def assert_resumed_elsewhere(c, job, gone, cut_at, what):
    """After `gone` (rank 0's node) is partitioned at cut_at: its rank stops on its lease, the job
    runs attempt 2 on the two other nodes from its newest checkpoint, never two attempts alive."""
    j = c.api.wait(job, lambda j: j["attempt"] >= 2 and j["state"] == "running", "attempt 2 running", timeout=60)
    assert j["attempt"] == 2, f"{what}: attempt {j['attempt']}: {j['history']}"
    second = next(h for h in j["history"] if int(h["attempt"]) == 2)
    first = next(h for h in j["history"] if int(h["attempt"]) == 1)
    names = sorted(c.s.name_of(w) for w in second["worker_ids"])
    assert gone not in names and len(names) == 2, f"attempt 2 on {names}, {gone} partitioned"
    placed_at = int(second["start_time_ms"]) / 1000 - cut_at
    j = c.api.wait(job, lambda j: next(h for h in j["history"] if int(h["attempt"]) == 2).get("resumed_from"),
                   "attempt 2 to report where it resumed", timeout=60)
    resumed = next(h for h in j["history"] if int(h["attempt"]) == 2)["resumed_from"]
    return j, names, placed_at, resumed, first


def case_agent_cut(c, net, one_way):
    job, rank0, rank1 = c.start_gang()
    old = c.rank_pids(job, 1)
    assert len(old) == 2, old
    old_rank0 = [t["pid"] for t in loom_trainers(c.s.tmp) if t["job"] == job and t["rank"] == 0]
    sampler = AttemptSampler(c.s.tmp, job)
    newest_before = newest_step(c.api.job(job))
    what = "one-way cut (the coordinator's packets to it dropped)" if one_way else "link cut"
    if one_way:
        net.drop_from("coordinator", rank0)
    else:
        net.cut(rank0)
    cut_at = time.time()
    try:
        wait_for(f"{rank0} marked lost", lambda: any(w["name"] == rank0 and w["state"] == "lost"
                                                     for w in c.api.workers()), timeout=30, interval=0.1)
        lost_at = time.time() - cut_at
        wait_for(f"rank 0 on {rank0} to stop itself (lease)",
                 lambda: all(proc_state(p) in (None, "Z", "X") for p in old_rank0), timeout=30, interval=0.1)
        stopped_at = time.time() - cut_at
        # Attempt 1 wrote its last checkpoint (rank 0 writes them); attempt 2 has not started.
        on_disk = newest_on_disk(c.api.job(job))
        j, names, placed_at, resumed, first = assert_resumed_elsewhere(c, job, rank0, cut_at, what)
        left = CUT_S - (time.time() - cut_at)
        if left > 0:
            time.sleep(left)
    finally:
        if one_way:
            net.undrop("coordinator", rank0)
        else:
            net.heal(rank0)
    healed_ms = int(time.time() * 1000)
    wait_for(f"{rank0} registered again", lambda: c.heard_since([rank0], healed_ms), timeout=30, interval=0.05)
    back_s = time.time() - healed_ms / 1000
    sampler.finish()
    assert stopped_at <= placed_at, f"attempt 2 placed {placed_at:.1f} s in, rank 0 stopped {stopped_at:.1f} s in"
    m = re.search(r"step-(\d+)$", resumed)  # the restored checkpoint's directory, or "start"
    resumed_step = int(m.group(1)) if m else 0
    assert resumed_step == on_disk >= newest_before, \
        f"attempt 2 resumed from {resumed}: step {on_disk} was the newest on disk, {newest_before} in the catalogue"
    # New work on the node that came back.
    probe = c.api.ok("POST", "/v1/jobs", gang_job(steps=30, world=1, pool={"node": rank0}))["id"]
    done = c.api.wait_end(probe, timeout=180)
    assert done["state"] == "succeeded", done
    c.api.ok("POST", f"/v1/jobs/{job}/cancel")
    print(f"ok: {what} of {rank0} (rank 0 of {job}) for {CUT_S} s: lost {lost_at:.1f} s in, its rank stopped itself "
          f"{stopped_at:.1f} s in, attempt 2 on {names} placed {placed_at:.1f} s in from {resumed} "
          f"(the newest on disk; the catalogue had step {newest_before} at the cut), never two attempts alive in {sampler.samples} samples; "
          f"{rank0} registered again {back_s:.2f} s after the heal and ran {probe}; attempt 1 ended: "
          f"{first.get('end_reason', '')[:80]}")


def main():
    args = control_plane_arg_parser().parse_args()
    reason = skip_reason()
    if reason:
        print(f"SKIP: {reason}")
        sys.exit(SKIP)
    tmp = os.path.realpath(tempfile.mkdtemp(prefix="loom-partition-"))
    net = Network()
    try:
        net.add("coordinator", 0)
        for i, n in enumerate(NODES):
            net.add(n, i + 1)
        case_coordinator_cut(args, net, tmp)
        stop_all(PROCS, tmp)
        PROCS.clear()
        c = Cluster(args, net, os.path.join(tmp, "agent-cut"),
                    ["--heartbeat-ms", "500", "--lost-after-ms", "3000", "--lease-ms", "8000",
                     "--term-grace-ms", "1000"])
        case_agent_cut(c, net, one_way=False)
        case_agent_cut(c, net, one_way=True)
    except BaseException:
        for root, _, files in os.walk(tmp):
            for f in files:
                if f.endswith(".log") and os.path.dirname(os.path.join(root, f)).count(os.sep) <= tmp.count(os.sep) + 1:
                    with open(os.path.join(root, f), errors="replace") as fh:
                        sys.stderr.write(f"--- {os.path.join(root, f)} (tail) ---\n{fh.read()[-3000:]}\n")
        raise
    finally:
        stop_all(PROCS, tmp)
        net.remove()
    subprocess.run(["rm", "-rf", tmp])


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # ctest's timeout: clean up the namespaces
    main()

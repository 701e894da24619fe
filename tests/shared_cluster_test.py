#!/usr/bin/env python3
"""A box two people share, through `loom up --users` (one worker, 2 slots; loom up's own user is
the admin): alice and bob, each with a token.

Checks: bob's `loom cancel` of alice's job is refused (403, exit 4) and the job runs on; an
admin's quota of 2 slots holds alice's next job queued with its reason ("quota: alice uses 2 of 2
slots"), shown by the CLI, the REST API and `loom admin quota list`; an urgent job of bob's
(priority 10) preempts alice's low-priority job once --preempt-after-s has passed: alice's ranks
get SIGTERM, checkpoint and exit 76, her job is requeued with no restart counted, bob's runs and
succeeds, then alice's resumes from that checkpoint and succeeds with every logged loss and the
final weights bitwise equal to an uninterrupted run of the same spec. Every process is killed on
exit.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loom_testlib import (Api, dump_loom_up, final_tensors, free_port, stop_all, stop_loom_up,  # noqa: E402
                         wait_for)

PROCS = []
ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdef01"


def spec(steps, world, interval, priority=0, seed=7):
    return {"spec": {"preset": "micro", "steps": steps, "micro_batch": 4, "seq_len": 32, "threads": 1,
                     "seed": seed, "dist_timeout_seconds": 30, "data": {"corpus_bytes": 65536},
                     "eval": {"batches": 1, "interval": 0},
                     "checkpoint": {"interval": interval, "keep_last": 3}, "metrics": {"log_every": 1}},
            "world_size": world, "priority": priority}


class Box:
    def __init__(self, args, tmp):
        self.args, self.tmp = args, tmp
        users = os.path.join(tmp, "users")
        with open(users, "w") as f:
            f.write(f"alice {ALICE}\nbob {BOB}\n")
        self.port = free_port()
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "XDG_CONFIG_HOME": os.path.join(tmp, "xdg")}
        self.env.pop("LOOM_TOKEN", None)
        self.up = subprocess.Popen(
            [args.loom, "up", "--workers", "1", "--slots", "2", "--port", str(self.port), "--data-dir",
             os.path.join(tmp, "up"), "--users", users, "--preempt-after-s", "3", "--min-run-s", "600"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env)
        PROCS.append(self.up)
        with open_when_there(os.path.join(tmp, "up", "tokens", "user-token")) as f:
            self.admin = f.read().strip()
        self.alice, self.bob = Api(self.port, ALICE), Api(self.port, BOB)
        wait_for("loom up's worker", lambda: any(w["state"] == "alive" for w in self.workers()), timeout=60)

    def workers(self):
        status, parsed, _ = Api(self.port, ALICE).request("GET", "/v1/workers")
        return parsed.get("workers", []) if status == 200 else []

    def cli(self, token, *argv):
        env = {**self.env, "LOOM_COORDINATOR": f"http://127.0.0.1:{self.port}", "LOOM_TOKEN": token}
        return subprocess.run([self.args.loom, *argv], env=env, capture_output=True, text=True, timeout=120)

    def submit(self, api, body):
        status, parsed, text = api.request("POST", "/v1/jobs", body)
        assert status == 201, f"submit: HTTP {status}: {text}"
        return parsed["id"]


class open_when_there:
    """Opens a file once loom up has written it."""

    def __init__(self, path):
        self.path = path

    def __enter__(self):
        wait_for(self.path, lambda: os.path.exists(self.path) and os.path.getsize(self.path) > 0, timeout=30)
        self.f = open(self.path)
        return self.f

    def __exit__(self, *exc):
        self.f.close()


def test_cancel_and_quota(box):
    """bob cannot cancel alice's job; a quota of 2 slots holds her third slot's job with its reason."""
    a1 = box.submit(box.alice, spec(100000, 1, 0))
    box.alice.wait(a1, lambda j: j["state"] == "running", "alice's job to run")
    r = box.cli(BOB, "cancel", a1)
    assert r.returncode == 4 and "403" in r.stderr + r.stdout and "alice" in r.stderr + r.stdout, (r.returncode, r.stdout, r.stderr)
    r = box.cli(BOB, "update", a1, "--priority", "3")
    assert r.returncode == 4 and "403" in r.stderr + r.stdout, (r.returncode, r.stdout, r.stderr)
    r = box.cli(ALICE, "update", a1, "--priority", "-1")
    assert r.returncode == 0 and "priority -1" in r.stdout, r.stdout + r.stderr
    time.sleep(1)
    job = box.alice.job(a1)
    assert job["state"] == "running" and job["priority"] == -1, "bob's refused cancel and update changed nothing"
    assert any(e["reason"] == "priority 0 -> -1 by alice" for e in job["events"]), job["events"]
    r = box.cli(box.admin, "admin", "quota", "set", "user", "alice", "1")
    assert r.returncode == 0 and "user alice: at most 1 slots" in r.stdout, r.stdout + r.stderr
    a2 = box.submit(box.alice, spec(100000, 1, 0))
    held = box.alice.wait(a2, lambda j: j["reason"].startswith("quota:"), "the quota reason")
    assert held["state"] == "queued" and held["reason"] == "quota: alice uses 1 of 1 slots", held
    r = box.cli(ALICE, "status", a2)
    assert "quota: alice uses 1 of 1 slots" in r.stdout and "alice" in r.stdout, r.stdout
    r = box.cli(ALICE, "admin", "quota", "list")
    assert r.returncode == 0 and "alice" in r.stdout and "1/1" in r.stdout, r.stdout
    for j in (a1, a2):
        assert box.cli(ALICE, "cancel", j).returncode == 0
    for j in (a1, a2):
        box.alice.wait_end(j)
    assert box.cli(box.admin, "admin", "quota", "delete", "user", "alice").returncode == 0
    print(f"ok: bob's cancel of {a1} refused (403) and it ran on; a 1-slot quota held {a2} queued with its reason")


def losses(api, job_id):
    """step -> loss over every attempt (a resumed attempt repeats no step here: it starts after
    its checkpoint)."""
    out = {}
    for series in api.ok("GET", f"/v1/jobs/{job_id}/metrics?max_points=100000").get("series", []):
        for p in series.get("points", []):
            out.setdefault(int(p["step"]), []).append(p.get("loss", 0))
    return out


def test_preemption(box):
    """bob's urgent job preempts alice's; hers resumes bitwise-exactly and succeeds."""
    # Long enough to be running when the grace has passed: preempted near step 360 on the 2-core
    # CI machine (3 to 4 s in), where 3000 steps take about 20 s.
    steps = 3000
    low = box.submit(box.alice, spec(steps, 2, 1000))
    box.alice.wait(low, lambda j: int(j.get("progress", {}).get("step", 0)) >= 20, "alice's job to train", timeout=180)
    urgent = box.submit(box.bob, spec(20, 2, 20, priority=10, seed=3))
    job = box.alice.wait(low, lambda j: j.get("preemptions", 0) >= 1, "the preemption", timeout=120)
    assert job["state"] in ("queued", "scheduled", "running"), job
    assert job.get("restarts", 0) == 0 and job.get("infra_restarts", 0) == 0, job
    first = job["history"][0]
    assert first.get("preempted") and f"preempted for {urgent}" in first["end_reason"], first
    events = [e["reason"] for e in box.alice.job(low)["events"]]
    assert any(f"preempting for {urgent}" in e for e in events), events
    done = box.bob.wait_end(urgent, timeout=240)
    assert done["state"] == "succeeded", done
    done = box.alice.wait_end(low, timeout=600)
    assert done["state"] == "succeeded", done
    assert done["attempt"] == 2 and done.get("restarts", 0) == 0, done
    resumed = done["history"][1].get("resumed_from", "")
    assert "step-" in resumed, done["history"]
    stopped_at = int(resumed.rsplit("step-", 1)[1])
    # An uninterrupted run of the same spec: the same losses at every step, the same weights.
    reference = box.submit(box.alice, spec(steps, 2, 1000))
    assert box.alice.wait_end(reference, timeout=600)["state"] == "succeeded"
    got, want = losses(box.alice, low), losses(box.alice, reference)
    assert sorted(want) == list(range(1, steps + 1)), sorted(want)[:5]
    for step in range(1, steps + 1):
        assert got.get(step) and all(x == want[step][0] for x in got[step]), (step, got.get(step), want[step])
    a, b = final_tensors(box.alice, low, steps), final_tensors(box.alice, reference, steps)
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a), "final weights differ"
    print(f"ok: {urgent} (priority 10) preempted {low} at step {stopped_at} (exit 76, no restart counted); "
          f"{low} resumed and matched an uninterrupted run bitwise: {steps} losses, {len(a)} tensors")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loom", required=True)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="loom-shared-cluster-")
    box = None
    try:
        box = Box(args, tmp)
        test_cancel_and_quota(box)
        test_preemption(box)
        out = stop_loom_up(box.up)
        assert "loom up: stopped" in out, out[-3000:]
    except BaseException:
        dump_loom_up(box and box.up)
        raise
    finally:
        stop_all(PROCS, tmp)
    subprocess.run(["rm", "-rf", tmp])
    print("shared cluster: all checks passed")


if __name__ == "__main__":
    main()

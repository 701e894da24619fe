#!/usr/bin/env python3
"""Both sides of the lease (docs/control-plane.md, "Leases: a trade-off"), with real processes.

1. A coordinator outage costs no work: with the default lease (90 s) and default loss detection,
   the coordinator is SIGSTOPped for 60 s while a job trains. Its rank keeps training through the
   pause (its step moves on in the rank's own event log), and after SIGCONT the worker is still
   alive, the job is still on attempt 1 with no restart, and its progress goes on.
2. Fencing stays exact when the lease is longer than loss detection (lost-after 2 s, lease 6 s,
   grace 1 s): a worker's agent is SIGSTOPped; the worker is lost after ~2 s, but the job's
   attempt 2 starts only after last heartbeat + lease + grace, after the old rank stopped itself;
   at no sampled instant (every 50 ms) do two attempts of the job run.
"""
import glob
import os
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
PAUSE_S = 60


def job_body(steps, interval=50):
    spec = {"preset": "micro", "steps": steps, "micro_batch": 4, "seq_len": 32, "threads": 1,
            "data": {"corpus_bytes": 65536}, "eval": {"batches": 1},
            "checkpoint": {"interval": interval, "keep_last": 2}, "metrics": {"log_every": 5}}
    return {"spec": spec, "world_size": 1, "pool": {"pool": "cpu"}}


def case_coordinator_paused(args, tmp):
    os.makedirs(os.path.join(tmp, "a"))
    s = Service(args, os.path.join(tmp, "a"), {"alice": ALICE}, ENROLMENT_TOKEN, [], PROCS)
    s.start_coordinator()
    s.start_worker("w1", slots=1)
    s.wait_alive(["w1"])
    api = s.api
    job = api.ok("POST", "/v1/jobs", job_body(10 ** 7))["id"]
    api.wait(job, lambda j: j["state"] == "running" and int(j["progress"].get("step", 0)) > 10,
             "the job to run", timeout=120)
    before = rank_log_step(s.tmp, job)
    assert before > 0, "no step events in the rank's log"
    s.coordinator.send_signal(signal.SIGSTOP)
    try:
        time.sleep(PAUSE_S)
        during = rank_log_step(s.tmp, job)
        trainers = [t for t in loom_trainers(s.tmp) if t["job"] == job]
    finally:
        s.coordinator.send_signal(signal.SIGCONT)
    assert trainers and all(t["attempt"] == 1 for t in trainers), f"the rank did not outlive the pause: {trainers}"
    assert during > before, f"the rank made no progress during the pause: step {before} -> {during}"
    # Within a few heartbeats: the same attempt, reporting again, and the worker never lost.
    j = api.wait(job, lambda j: int(j["progress"].get("step", 0)) > during, "progress reported after the pause",
                 timeout=30)
    assert j["state"] == "running" and j["attempt"] == 1 and j["restarts"] == 0 and \
        j.get("infra_restarts", 0) == 0, j
    assert all(w["state"] == "alive" for w in api.workers()), api.workers()
    api.ok("POST", f"/v1/jobs/{job}/cancel")
    print(f"ok: coordinator SIGSTOPped {PAUSE_S} s (default lease and loss detection): the rank trained on "
          f"(step {before} -> {during} during the pause), the job kept attempt 1 with no restart, the worker "
          "stayed alive")


def case_lease_longer_than_loss(args, tmp):
    lost_ms, lease_ms, grace_ms = 2000, 6000, 1000
    os.makedirs(os.path.join(tmp, "b"))
    s = Service(args, os.path.join(tmp, "b"), {"alice": ALICE}, ENROLMENT_TOKEN,
                ["--heartbeat-ms", "250", "--lost-after-ms", str(lost_ms), "--lease-ms", str(lease_ms),
                 "--term-grace-ms", str(grace_ms)], PROCS)
    s.start_coordinator()
    s.start_worker("w1", slots=1)
    s.wait_alive(["w1"])
    api = s.api
    job = api.ok("POST", "/v1/jobs", job_body(10 ** 7, interval=20))["id"]
    j = api.wait(job, lambda j: j["state"] == "running" and int(j["progress"].get("step", 0)) > 40,
                 "the job to run with a checkpoint", timeout=120)
    s.start_worker("w2", slots=1)
    s.wait_alive(["w1", "w2"])
    old = [t for t in loom_trainers(s.tmp) if t["job"] == job]
    assert old and all(t["attempt"] == 1 for t in old), old
    sampler = AttemptSampler(s.tmp, job)
    agent = s.workers["w1"]
    t0 = time.time()
    agent.send_signal(signal.SIGSTOP)
    try:
        wait_for("w1 marked lost", lambda: any(w["name"] == "w1" and w["state"] == "lost" for w in api.workers()),
                 timeout=lost_ms / 1000 + 5, interval=0.1)
        lost_at = time.time() - t0
        wait_for("the frozen agent's rank to stop itself (lease)",
                 lambda: all(proc_state(t["pid"]) in (None, "Z", "X") for t in old),
                 timeout=lease_ms / 1000 + 5, interval=0.1)
        stopped_at = time.time() - t0
        j = api.wait(job, lambda j: j["attempt"] >= 2 and j["state"] == "running", "attempt 2", timeout=40)
    finally:
        agent.send_signal(signal.SIGCONT)
    sampler.finish()
    second = next(a for a in j["history"] if int(a["attempt"]) == 2)
    placed_at = int(second["start_time_ms"]) / 1000 - t0
    assert lost_at < lease_ms / 1000, f"w1 lost only {lost_at:.1f} s in: loss detection waited for the lease"
    assert placed_at >= (lease_ms + grace_ms) / 1000 - 0.5, \
        f"attempt 2 placed {placed_at:.1f} s in, before the old lease ({lease_ms} ms) and grace certainly passed"
    assert stopped_at <= placed_at, f"attempt 2 placed {placed_at:.1f} s in, the old rank stopped {stopped_at:.1f} s in"
    api.ok("POST", f"/v1/jobs/{job}/cancel")
    print(f"ok: lease {lease_ms} ms > lost-after {lost_ms} ms: w1 lost {lost_at:.1f} s after its agent froze, its "
          f"rank stopped itself {stopped_at:.1f} s in, attempt 2 placed {placed_at:.1f} s in (lease + grace = "
          f"{(lease_ms + grace_ms) / 1000:.0f} s); never two attempts alive")


def main():
    args = control_plane_arg_parser().parse_args()
    tmp = os.path.realpath(tempfile.mkdtemp(prefix="loom-outage-"))
    try:
        case_lease_longer_than_loss(args, tmp)
        stop_all(PROCS, tmp)
        PROCS.clear()
        case_coordinator_paused(args, tmp)
    except BaseException:
        for sub in ("a", "b"):
            for log in glob.glob(os.path.join(tmp, sub, "*.log")):
                with open(log, errors="replace") as f:
                    sys.stderr.write(f"--- {log} (tail) ---\n{f.read()[-3000:]}\n")
        raise
    finally:
        stop_all(PROCS, tmp)
    subprocess.run(["rm", "-rf", tmp])


if __name__ == "__main__":
    main()

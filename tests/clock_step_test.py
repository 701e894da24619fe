#!/usr/bin/env python3
"""An NTP step of the coordinator's wall clock, for real: loom-coordinator runs under Debian's
libfaketime with only CLOCK_REALTIME faked (FAKETIME_DONT_FAKE_MONOTONIC), its offset read from a
file the test rewrites mid-run. Stepped one hour forward, then one hour behind real time, while a
job trains on one of two workers: no worker is lost, the job keeps attempt 1 with no restart,
and the coordinator's own timestamps show each step took effect. Then the hosting agent is
SIGSTOPped: the worker is lost after --lost-after-ms of real time and the job placed again
after lease + grace of real time, not an hour late.

Skipped (exit 77, with the reason) where libfaketime is not installed.
"""
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loom_testlib import Service, control_plane_arg_parser, stop_all, wait_for  # noqa: E402

PROCS = []
ALICE = "alice-token-0123456789abcdef"
ENROLMENT_TOKEN = "enrolment-token-0123456789abcdef"
LIBFAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1"
HOUR_MS = 3600 * 1000
SKIP = 77


def job_body(steps):
    spec = {"preset": "micro", "steps": steps, "micro_batch": 4, "seq_len": 32, "threads": 1,
            "data": {"corpus_bytes": 65536}, "eval": {"batches": 1},
            "checkpoint": {"interval": 20, "keep_last": 2}, "metrics": {"log_every": 5}}
    return {"spec": spec, "world_size": 1, "pool": {"pool": "cpu"}}


def coordinator_wall_ms(api):
    """The coordinator's wall clock: the submit time it stamps on a new job (cancelled at once)."""
    probe = api.ok("POST", "/v1/jobs", {**job_body(10), "pool": {"pool": "none"}})["id"]
    api.ok("POST", f"/v1/jobs/{probe}/cancel")
    return int(api.job(probe)["submit_time_ms"])


def step_to(offset_file, seconds):
    with open(offset_file + ".new", "w") as f:
        f.write(f"{seconds:+d}s\n")
    os.replace(offset_file + ".new", offset_file)


def main():
    args = control_plane_arg_parser().parse_args()
    if not os.path.exists(LIBFAKETIME):
        print(f"SKIP: {LIBFAKETIME} is missing (Debian package faketime)")
        sys.exit(SKIP)
    tmp = os.path.realpath(tempfile.mkdtemp(prefix="loom-clock-step-"))
    offset = os.path.join(tmp, "faketime")
    step_to(offset, 0)
    fake = ["env", f"LD_PRELOAD={LIBFAKETIME}", f"FAKETIME_TIMESTAMP_FILE={offset}", "FAKETIME_NO_CACHE=1",
            "FAKETIME_DONT_FAKE_MONOTONIC=1"]
    lost_ms, lease_ms, grace_ms = 2000, 4000, 1000
    s = Service(args, tmp, {"alice": ALICE}, ENROLMENT_TOKEN,
                ["--heartbeat-ms", "250", "--lost-after-ms", str(lost_ms), "--lease-ms", str(lease_ms),
                 "--term-grace-ms", str(grace_ms)], PROCS, prefix={"coordinator": fake})
    try:
        s.start_coordinator()
        for n in ("w1", "w2"):
            s.start_worker(n, slots=1)
        s.wait_alive(["w1", "w2"])
        api = s.api
        job = api.ok("POST", "/v1/jobs", job_body(10 ** 7))["id"]
        api.wait(job, lambda j: j["state"] == "running" and j.get("checkpoints"), "the job to run", timeout=120)
        for seconds, what in ((3600, "an hour forward"), (-3600, "an hour behind real time")):
            step_to(offset, seconds)
            skew = coordinator_wall_ms(api) - time.time() * 1000
            assert abs(skew - seconds * 1000) < 60000, f"the step did not take: coordinator clock {skew:+.0f} ms"
            time.sleep(lost_ms / 1000 * 2)
            j = api.job(job)
            assert j["state"] == "running" and j["attempt"] == 1 and j["restarts"] == 0 and \
                j.get("infra_restarts", 0) == 0, f"after stepping {what}: {j['state']} attempt {j['attempt']}"
            lost = [w["name"] for w in api.workers() if w["state"] != "alive"]
            assert not lost, f"after stepping {what}: lost {lost}"
            print(f"ok: wall clock stepped {what} (coordinator skew {skew / 1000:+.0f} s): no worker lost, "
                  f"{job} on attempt 1")
        # Still behind by an hour: loss detection and the fence run on real (steady) time.
        host = s.name_of(api.job(job)["placement"][0]["worker_id"])
        agent = s.workers[host]
        t0 = time.time()
        agent.send_signal(signal.SIGSTOP)
        try:
            wait_for(f"{host} lost", lambda: any(w["name"] == host and w["state"] == "lost" for w in api.workers()),
                     timeout=lost_ms / 1000 + 10, interval=0.1)
            lost_at = time.time() - t0
            j = api.wait(job, lambda j: j["attempt"] >= 2 and j["state"] in ("scheduled", "running"),
                         "attempt 2", timeout=lease_ms / 1000 + grace_ms / 1000 + 20)
            placed_at = time.time() - t0
        finally:
            agent.send_signal(signal.SIGCONT)
        assert lost_at < lost_ms / 1000 + 3, f"{host} lost only {lost_at:.1f} s after it froze"
        assert placed_at >= (lease_ms + grace_ms) / 1000 - 0.5, f"attempt 2 placed {placed_at:.1f} s in, before the fence"
        api.ok("POST", f"/v1/jobs/{job}/cancel")
        print(f"ok: an hour behind, {host} frozen: lost {lost_at:.1f} s in, attempt 2 placed {placed_at:.1f} s in "
              f"(lease + grace {(lease_ms + grace_ms) / 1000:.0f} s)")
    except BaseException:
        s.dump_logs()
        raise
    finally:
        stop_all(PROCS, tmp)
    subprocess.run(["rm", "-rf", tmp])


if __name__ == "__main__":
    main()

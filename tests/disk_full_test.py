#!/usr/bin/env python3
"""A full disk, for real: filesystems of the test's own (tmpfs with size=) filled to the last
page by the test.

Coordinator: its data directory (RocksDB, job logs) fills while a long job and a short one run
(lease 6 s, so a lease that was not renewed would stop the ranks within the full period). For
longer than two leases: heartbeats go on, no worker is lost, the long job's rank keeps its
process and attempt 1, the short job's end is not lost; a submission is refused with 507 and a
message that says why; GET routes answer. Space returns: the coordinator resumes writes by
itself (RocksDB DB::Resume), the short job is recorded as succeeded on attempt 1, the job logs
hold every line once (a chunk cut short by the full disk was not kept), and a restarted
coordinator loads the same state.

Worker: a trainer's checkpoint directory fills between two checkpoints: the second fails with
the reason, leaves no partial step behind, the first stays the newest valid checkpoint, and a
run resumed from it once there is room reaches the end.

Skipped (exit 77, with the reason) where mounting a tmpfs is refused (not root).
"""
import errno
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loom_testlib import (Service, control_plane_arg_parser, loom_trainers, stop_all,  # noqa: E402
                          verify_checkpoint, wait_for)

PROCS = []
ALICE = "alice-token-0123456789abcdef"
ENROLMENT_TOKEN = "enrolment-token-0123456789abcdef"
SKIP = 77
LEASE_MS = 6000


def mount_tmpfs(path, mib):
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=0700", "tmpfs", path],
                       capture_output=True, text=True)
    return r.returncode == 0, r.stderr.strip()


def umount(path):
    subprocess.run(["umount", "-l", path], capture_output=True)


def fill(directory):
    """Writes a file until the filesystem refuses another byte; returns its path."""
    path = os.path.join(directory, "filler")
    with open(path, "wb", buffering=0) as f:
        for chunk in (1 << 20, 4096, 1):
            while True:
                try:
                    f.write(b"\0" * chunk)
                except OSError as e:
                    assert e.errno == errno.ENOSPC, e
                    break
    return path


def job_body(steps, pool="cpu"):
    spec = {"preset": "micro", "steps": steps, "micro_batch": 4, "seq_len": 32, "threads": 1,
            "data": {"corpus_bytes": 65536}, "eval": {"batches": 1},
            "checkpoint": {"interval": 200, "keep_last": 2}, "metrics": {"log_every": 10}}
    return {"spec": spec, "world_size": 1, "pool": {"pool": pool}, "max_restarts": 0}


def metric(api, name):
    _, _, text = api.request("GET", "/metrics")
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def step_lines(log):
    return re.findall(r"^\[rank 0\] step (\d+)/", log, re.M)


def test_coordinator(args, tmp):
    s = Service(args, tmp, {"alice": ALICE}, ENROLMENT_TOKEN,
                ["--heartbeat-ms", "250", "--lost-after-ms", "3000", "--lease-ms", str(LEASE_MS)], PROCS)
    ok, why = mount_tmpfs(s.data_dir, 24)
    if not ok:
        print(f"SKIP: cannot mount a tmpfs (root needed): {why}")
        sys.exit(SKIP)
    try:
        s.start_coordinator()
        s.start_worker("w1", slots=2)
        s.wait_alive(["w1"])
        api = s.api
        long_job = api.ok("POST", "/v1/jobs", job_body(10 ** 6))["id"]
        short_job = api.ok("POST", "/v1/jobs", job_body(800))["id"]
        for job in (long_job, short_job):
            api.wait(job, lambda j: j["state"] == "running" and int(j["progress"].get("step", 0)) > 0,
                     "the job to run", timeout=120)
        pids = {t["job"]: t["pid"] for t in loom_trainers(tmp)}
        assert set(pids) == {long_job, short_job}, pids
        filler = fill(s.data_dir)
        t0 = time.time()
        wait_for("the coordinator to see the full disk",
                 lambda: metric(api, "loom_coordinator_storage_full") == 1, timeout=20)
        # The log's last page may still hold a submission or two: then they are stored, for real.
        accepted = []
        for _ in range(200):
            status, body, text = api.request("POST", "/v1/jobs", job_body(10, pool="none"))
            if status != 201:
                break
            accepted.append(body["id"])
        assert status == 507 and "full" in body["error"]["message"], (status, text)
        while time.time() - t0 < 2.5 * LEASE_MS / 1000:
            j = api.job(long_job)
            assert j["state"] == "running" and j["attempt"] == 1, j
            assert [w["state"] for w in api.workers()] == ["alive"], api.workers()
            assert {t["job"]: t["pid"] for t in loom_trainers(tmp)}.get(long_job) == pids[long_job], \
                "the long job's rank was restarted or stopped"
            assert api.request("GET", f"/v1/jobs/{long_job}/logs")[0] == 200
            time.sleep(0.5)
        ended_while_full = short_job not in {t["job"] for t in loom_trainers(tmp)}
        print(f"ok: {2.5 * LEASE_MS / 1000:.0f} s full (lease {LEASE_MS / 1000:.0f} s): heartbeats and leases "
              f"went on, {long_job} kept its rank and attempt 1, submissions got 507 "
              f"(after {len(accepted)} that still fitted)"
              f"{'; ' + short_job + ' ended meanwhile' if ended_while_full else ''}")
        os.remove(filler)
        t1 = time.time()
        wait_for("writes to resume", lambda: api.request("POST", "/v1/jobs", job_body(10, pool="none"))[0] == 201,
                 timeout=30)
        wait_for("the storage_full gauge to fall", lambda: metric(api, "loom_coordinator_storage_full") == 0,
                 timeout=10)
        j = api.wait_end(short_job)
        assert j["state"] == "succeeded" and j["attempt"] == 1 and j["restarts"] == 0, j
        _, _, log = api.request("GET", f"/v1/jobs/{short_job}/logs")
        steps = step_lines(log)
        assert steps and len(steps) == len(set(steps)) and steps[-1] == "800", steps[-5:]
        print(f"ok: room again: writes resumed {time.time() - t1:.1f} s later by themselves; {short_job} "
              f"succeeded on attempt 1, its log holds each of {len(steps)} step lines once")
        api.ok("POST", f"/v1/jobs/{long_job}/cancel")
        api.wait_end(long_job)
        before = {j: api.job(j)["state"] for j in (long_job, short_job)}
        s.coordinator.terminate()
        s.coordinator.wait(timeout=30)
        s.start_coordinator()
        after = {j: api.job(j)["state"] for j in (long_job, short_job)}
        assert after == before == {long_job: "cancelled", short_job: "succeeded"}, (before, after)
        assert all(api.job(j)["state"] == "queued" for j in accepted), accepted
        print("ok: a restarted coordinator loads the same state")
    except BaseException:
        s.dump_logs()
        raise
    finally:
        stop_all(PROCS, tmp)
        umount(s.data_dir)


def train(args, ckpt, *extra):
    return subprocess.run(
        [args.loom_train, "train", "--preset", "micro", "--threads", "1", "--set", "micro_batch=4",
         "--set", "seq_len=32", "--checkpoint-dir", ckpt, "--checkpoint-every", "10", *extra],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_worker_checkpoint(args, tmp):
    ckpt = os.path.join(tmp, "ckpt")
    ok, why = mount_tmpfs(ckpt, 8)
    assert ok, why
    try:
        r = train(args, ckpt, "--steps", "10")
        assert r.returncode == 0, r.stderr[-2000:]
        filler = fill(ckpt)
        r = train(args, ckpt, "--steps", "20", "--resume-if-any", ckpt)
        assert r.returncode != 0 and "No space left on device" in r.stderr, (r.returncode, r.stderr[-2000:])
        left = sorted(os.listdir(ckpt))
        assert left == ["filler", "step-00000010"], left
        assert not verify_checkpoint(os.path.join(ckpt, "step-00000010"))
        os.remove(filler)
        r = train(args, ckpt, "--steps", "20", "--resume-if-any", ckpt)
        assert r.returncode == 0 and "resum" in (r.stdout + r.stderr).lower(), r.stderr[-2000:]
        assert sorted(os.listdir(ckpt)) == ["step-00000010", "step-00000020"], os.listdir(ckpt)
        assert not verify_checkpoint(os.path.join(ckpt, "step-00000020"))
        print("ok: a checkpoint on a full disk fails with the reason and leaves nothing; step 10 stayed the "
              "newest valid one and the run resumed from it once there was room")
    finally:
        umount(ckpt)


def main():
    args = control_plane_arg_parser().parse_args()
    tmp = os.path.realpath(tempfile.mkdtemp(prefix="loom-disk-full-"))
    try:
        test_coordinator(args, tmp)
        test_worker_checkpoint(args, tmp)
    finally:
        subprocess.run(["rm", "-rf", tmp])
    print("disk full: all checks passed")


if __name__ == "__main__":
    main()

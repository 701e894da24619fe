#!/usr/bin/env python3
"""Every size a user controls is bounded before anything proportional to it is built (issue 73,
item 1; docs/control-plane.md, "Input limits"). A real coordinator with the default 1 MiB body
limit; for each bounded size, the largest legal request is accepted and the smallest illegal one
is refused with a 4xx naming the field, while the coordinator's peak RSS (VmHWM) is watched.
The sweep that once drove the coordinator out of memory (57 000 listed cells crossed with a grid,
in a 1 MiB body) is refused at once without its peak RSS moving. Every process is killed on exit.
"""
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loom_testlib import (Service, control_plane_arg_parser, open_log_follow, proc_status_kib,  # noqa: E402
                          stop_all)

PROCS = []
ALICE = "alice-token-0123456789abcdef"
ENROLMENT_TOKEN = "enrolment-token-0123456789abcdef"
MIB = 1 << 20
MAX_JOBS = 1000            # coordinator/sweep_cells.h, kMaxSweepJobs
MAX_SPEC_BYTES = 32 * MIB  # kMaxSweepSpecBytes
# A refused request may cost the parse of its 1 MiB body, nothing proportional to what it asks
# for; the accepted 1000-job sweep stores 1000 jobs.
REFUSED_GROWTH_MIB = 24
ACCEPTED_GROWTH_MIB = 96


def spec(**extra):
    s = {"preset": "micro", "steps": 10, "micro_batch": 4, "seq_len": 32, "threads": 1}
    s.update(extra)
    return s


def sweep(cells=0, seeds=1, grid=None, **extra):
    body = {"base": {"spec": spec(), "pool": {"pool": "nowhere"}},
            "seeds": list(range(1, seeds + 1)), "grid": grid or {}}
    if cells:
        body["cells"] = [{"name": f"c{i}", "set": {"optimizer.lr": 0.001}} for i in range(cells)]
    body.update(extra)
    return body


class Bounded:
    def __init__(self, args, tmp):
        self.s = Service(args, tmp, {"alice": ALICE}, ENROLMENT_TOKEN,
                         ["--max-body-bytes", str(MIB), "--max-log-followers-per-user", "4"], PROCS)
        self.api = self.s.api
        self.rows = []

    def hwm_kib(self):
        return proc_status_kib(self.s.coordinator.pid, "VmHWM")

    def send(self, what, method, path, body=None, raw=None, want=200, needle="", growth_mib=0.0):
        """One request: its status must be `want` (and a refusal's message hold `needle`), and the
        coordinator's peak RSS may grow at most growth_mib. Returns the parsed answer."""
        hwm = self.hwm_kib()
        started = time.time()
        status, parsed, text = self.api.request(method, path, body, raw=raw)
        seconds = time.time() - started
        grew = (self.hwm_kib() - hwm) / 1024
        assert status == want, f"{what}: HTTP {status}, wanted {want}: {text[:600]}"
        if want >= 400:
            message = (parsed or {}).get("error", {}).get("message", "")
            assert needle in message, f"{what}: the message does not say '{needle}': {text[:600]}"
        assert grew <= growth_mib, f"{what}: the coordinator's peak RSS grew {grew:.1f} MiB (> {growth_mib})"
        assert self.s.coordinator.poll() is None, f"{what}: the coordinator exited"
        self.rows.append(f"{what}: {status} in {seconds:.2f} s, peak RSS +{grew:.1f} MiB")
        return parsed

    def pair(self, what, method, legal, illegal, needle, legal_growth=REFUSED_GROWTH_MIB):
        """The largest legal request (path, body) is answered 2xx, the smallest illegal one 400
        with a message holding `needle`."""
        self.send(f"{what}, largest legal", method, *legal, want=201 if method == "POST" else 200,
                  growth_mib=legal_growth)
        self.send(f"{what}, smallest illegal", method, *illegal, want=400, needle=needle,
                  growth_mib=REFUSED_GROWTH_MIB)

    def test_sweep_jobs(self):
        grid = {"optimizer.min_lr": [1e-5 * (i + 1) for i in range(10)]}  # 10 x 10 x 10 = 1000
        self.pair("sweep of cells x grid x seeds", "POST",
                  ("/v1/sweeps", sweep(cells=10, seeds=10, grid=grid)),
                  ("/v1/sweeps", sweep(cells=10, seeds=11, grid=grid)),
                  "cells: 10 cells x 10 grid combinations x 11 seeds is more than 1000 jobs",
                  legal_growth=ACCEPTED_GROWTH_MIB)
        self.pair("sweep of listed cells", "POST", ("/v1/sweeps", sweep(cells=MAX_JOBS)),
                  ("/v1/sweeps", sweep(cells=MAX_JOBS + 1)),
                  "1001 cells x 1 grid combinations x 1 seeds", legal_growth=ACCEPTED_GROWTH_MIB)

    def test_hostile_sweep(self):
        """The request that drove the coordinator out of memory: as many listed cells as a 1 MiB
        body holds, crossed with a 1000-value grid. Refused from its counts alone."""
        body = sweep(grid={"optimizer.min_lr": [1e-6 * (i + 1) for i in range(MAX_JOBS)]})
        compact = {"separators": (",", ":")}
        room = MIB - len(json.dumps(body, **compact)) - 16
        body["cells"] = [{"name": f"c{i}"} for i in range(room // len('{"name":"c00000"},'))]
        raw = json.dumps(body, **compact)
        assert len(raw) <= MIB and len(body["cells"]) > 50000, (len(raw), len(body["cells"]))
        n = len(body["cells"])
        started = time.time()
        self.send(f"sweep of {n} cells x a 1000-value grid, {len(raw) // 1024} KiB", "POST", "/v1/sweeps",
                  raw=raw, want=400, needle=f"cells: {n} cells x 1000 grid combinations",
                  growth_mib=REFUSED_GROWTH_MIB)
        assert time.time() - started < 5, "refusing the hostile sweep took over 5 s"

    def test_sweep_spec_bytes(self):
        # Every job stores the base spec: 1000 jobs of a 36 KB spec are over 32 MiB. (The spec
        # need not be valid: the sizes are checked first.)
        body = sweep(cells=MAX_JOBS)
        body["base"]["spec"]["model"] = {"schedule": [{"repeat": 1, "attention": {
            "plugin": "mha", "options": {f"k{j}": "v" * 4000 for j in range(9)}}}]}
        self.send("sweep specs in bytes, over 32 MiB in all", "POST", "/v1/sweeps", body, want=400,
                  needle="base.spec: 1000 jobs of up to", growth_mib=REFUSED_GROWTH_MIB)

    def test_submit(self):
        base = {"spec": spec(), "pool": {"pool": "nowhere"}}
        self.pair("labels", "POST",
                  ("/v1/jobs", {**base, "labels": {f"l{i}": "v" for i in range(16)}}),
                  ("/v1/jobs", {**base, "labels": {f"l{i}": "v" for i in range(17)}}),
                  "labels: at most 16 labels")
        self.pair("description", "POST", ("/v1/jobs", {**base, "description": "d" * 1024}),
                  ("/v1/jobs", {**base, "description": "d" * 1025}), "description")
        return self.api.ok("GET", "/v1/jobs?page_size=1")["jobs"][0]["id"]

    def test_reads(self, job_id):
        for route in ("/v1/jobs", "/v1/checkpoints", "/v1/workers", "/v1/sweeps"):
            self.pair(f"GET {route} page", "GET", (f"{route}?page_size=500", None),
                      (f"{route}?page_size=501", None), "page_size", legal_growth=ACCEPTED_GROWTH_MIB)
        self.pair("metrics points", "GET", (f"/v1/jobs/{job_id}/metrics?max_points=100000", None),
                  (f"/v1/jobs/{job_id}/metrics?max_points=100001", None), "max_points")
        sweep_id = self.api.ok("GET", "/v1/sweeps?page_size=1")["sweeps"][0]["id"]
        merge = ",".join([sweep_id] * 17)
        self.send("a report merging 17 sweeps", "GET", f"/v1/sweeps/{sweep_id}/report?merge={merge}",
                  want=400, needle="merge: at most 16 sweeps", growth_mib=REFUSED_GROWTH_MIB)

    def follow(self, job_id):
        """A ?follow=true stream held open; returns it with its status line."""
        sock, head = open_log_follow(self.s.port, job_id, ALICE)
        return sock, head.split(b"\r\n")[0].decode()

    def test_log_follows(self, job_id):
        streams = []
        try:
            for _ in range(4):
                sock, status = self.follow(job_id)
                streams.append(sock)
                assert " 200 " in status, status
            sock, status = self.follow(job_id)
            sock.close()
            assert " 429 " in status, f"a fifth ?follow=true stream: {status}"
            self.rows.append("log streams: 4 followed, the fifth 429")
        finally:
            for sock in streams:
                sock.close()


def main():
    args = control_plane_arg_parser().parse_args()
    tmp = os.path.realpath(tempfile.mkdtemp(prefix="loom-bounded-"))
    b = Bounded(args, tmp)
    started = time.time()
    try:
        b.s.start_coordinator()
        start_kib = b.hwm_kib()
        b.test_hostile_sweep()  # first: nothing else has raised the peak yet
        b.test_sweep_spec_bytes()
        b.test_sweep_jobs()
        job_id = b.test_submit()
        b.test_reads(job_id)
        b.test_log_follows(job_id)
        status, _, _ = b.api.request("GET", "/healthz", token=None)
        assert status == 200
        for row in b.rows:
            print("ok:", row)
        print(f"coordinator peak RSS {start_kib // 1024} MiB at start, {b.hwm_kib() // 1024} MiB at the end")
    except BaseException:
        print("\n".join(f"ok: {row}" for row in b.rows))
        b.s.dump_logs(["coordinator.log"])
        raise
    finally:
        stop_all(PROCS, tmp)
    subprocess.run(["rm", "-rf", tmp])
    print(f"bounded requests: all checks passed in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()

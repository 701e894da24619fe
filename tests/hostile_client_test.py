#!/usr/bin/env python3
"""Hostile clients against a real coordinator (user listener for alice and bob, agent port),
one real worker agent running real loom-train ranks, and fake workers this test registers and
drives over the agent protocol (gRPC) itself.

Every hostile request must get a 4xx with a JSON {"error": {"code", "status", "message",
"details"}} naming the problem (on the agent port: a gRPC error code with a message), and change
nothing: the job list and the checkpoint catalogue are the same before and after, and the real
worker stays alive. Cases: JSON nested at every depth 1..200 in every free-form (Struct) field
and elsewhere; strings over 4096 bytes; 1 GiB bodies (chunked, Content-Length, compressed) and
length-less POSTs answered within 2 s without the coordinator's memory growing; 40 slowloris
connections; 64 concurrent log followers (4 per user); forged heartbeats (another worker's id,
the enrolment token, an attempt placed elsewhere, a lost worker's credential); forged checkpoint
paths; client paths escaping the storage root; and `loom up`'s tokens, Host and Origin checks.
Every process is killed on exit.
"""
import gzip
import re
import json
import os
import select
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loom_testlib import (Api, Service, agent_refusal, control_plane_arg_parser, free_port, metric_family,  # noqa: E402
                          open_log_follow, proc_status_kib, stop_all, wait_for)

PROCS = []
ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdef-bob"
ENROLMENT_TOKEN = "enrolment-token-0123456789abcdef"
MAX_BODY = 262144
FOLLOWERS_PER_USER = 4
LOST_AFTER_MS = 3000
GIB = 1 << 30
MIB = 1 << 20


def micro(steps, world=1, interval=10, pool="cpu", **extra):
    spec = {"preset": "micro", "steps": steps, "micro_batch": 4, "seq_len": 32, "threads": 1,
            "dist_timeout_seconds": 30, "data": {"corpus_bytes": 65536}, "eval": {"batches": 1},
            "checkpoint": {"interval": interval, "keep_last": 2}, "metrics": {"log_every": 5}}
    spec.update(extra)
    return {"spec": spec, "world_size": world, "pool": {"pool": pool}}


def nest(depth, leaf=1):
    """depth nested objects: nest(1) == {"a": 1}, nest(2) == {"a": {"a": 1}}."""
    v = leaf
    for _ in range(depth):
        v = {"a": v}
    return v


def nest_list(arrays):
    """An object holding `arrays` nested arrays: depth arrays + 1."""
    v = 1
    for _ in range(arrays):
        v = [v]
    return {"a": v}


def error_of(what, result, want, needles):
    """Asserts a clean refusal: status in want, a JSON error object (google.rpc.Status shape)
    whose message holds one of needles."""
    if isinstance(result[0], str):  # an agent call: (gRPC code name, response, message)
        return agent_refusal(what, result, want, needles)
    status, parsed, text = result
    want = (want,) if isinstance(want, int) else tuple(want)
    needles = (needles,) if isinstance(needles, str) else tuple(needles)
    assert status in want, f"{what}: HTTP {status}, wanted {want}: {text[:400]}"
    error = parsed.get("error") if isinstance(parsed, dict) else None
    assert isinstance(error, dict) and error.get("code") == status and isinstance(error.get("message"), str) \
        and re.fullmatch(r"[A-Z_]+", error.get("status", "")) and isinstance(error.get("details"), list), \
        f"{what}: not a JSON error: {text[:400]}"
    assert any(n.lower() in error["message"].lower() for n in needles), \
        f"{what}: none of {needles} in the error '{error['message'][:400]}'"
    return error["message"]


class Hostile:
    def __init__(self, args, tmp):
        self.args, self.tmp = args, tmp
        self.s = Service(args, tmp, {"alice": ALICE, "bob": BOB}, ENROLMENT_TOKEN,
                         ["--heartbeat-ms", "250", "--lost-after-ms", str(LOST_AFTER_MS), "--term-grace-ms", "1000",
                          "--max-body-bytes", str(MAX_BODY),
                          "--max-log-followers-per-user", str(FOLLOWERS_PER_USER)], PROCS)
        self.normal_job = None  # a succeeded job with checkpoints
        self.volatile_jobs = set()  # jobs whose checkpoints may commit during a snapshot pair
        # <storage>/link -> /etc: a symlink inside the root that points outside it.
        os.symlink("/etc", os.path.join(self.s.storage, "link"))

    @property
    def api(self):
        return self.s.api

    @property
    def agent(self):
        return self.s.agent

    # --- "nothing changed" -------------------------------------------------------------------------

    def snapshot(self):
        jobs, token = [], ""
        while True:
            query = "/v1/jobs?page_size=500" + (f"&page_token={token}" if token else "")
            status, page, text = self.api.request("GET", query)
            assert status == 200 and page is not None, f"GET /v1/jobs: HTTP {status}, not valid JSON: {text[:300]}"
            jobs += [(j["id"], j["state"]) for j in page["jobs"]]
            token = page.get("next_page_token", "")
            if not token:
                break
        status, cat, text = self.api.request("GET", "/v1/checkpoints")
        assert status == 200 and cat is not None, f"GET /v1/checkpoints: HTTP {status}: {text[:300]}"
        catalogue = [(x["id"], bool(x.get("available")), x.get("damaged", ""), bool(x.get("deleted")),
                      tuple(x.get("pinned_by", []))) for x in cat["checkpoints"]
                     if x["job_id"] not in self.volatile_jobs]
        return sorted(jobs), sorted(catalogue)

    def real_worker_alive(self):
        records = self.s.worker_records()
        assert records.get("real", {}).get("state") == "alive", f"the real worker is not alive: {records.get('real')}"
        assert self.s.workers["real"].poll() is None, "the real worker exited"
        assert self.s.coordinator.poll() is None, "the coordinator exited"

    def unchanged(self, before, what):
        after = self.snapshot()
        assert after[0] == before[0], f"{what}: the job list changed: " \
            f"{sorted(set(after[0]) ^ set(before[0]))[:10]}"
        assert after[1] == before[1], f"{what}: the checkpoint catalogue changed: " \
            f"{sorted(set(after[1]) ^ set(before[1]))[:10]}"
        self.real_worker_alive()

    def refused(self, what, result, want, needles, before=None):
        before = before or self.snapshot()
        err = error_of(what, result, want, needles)
        self.unchanged(before, what)
        return err

    def submit(self, body):
        status, parsed, text = self.api.request("POST", "/v1/jobs", body)
        assert status == 201, f"submit: HTTP {status}: {text[:500]}"
        return parsed["id"]

    # --- cases -------------------------------------------------------------------------------------

    def test_paths(self):
        api = self.api
        storage = self.s.storage

        def with_spec(**kw):
            b = micro(10, pool="nowhere")
            b["spec"].update(kw)
            return b
        cases = [
            ("client checkpoint dir", with_spec(checkpoint={"dir": "jobs/job-000001/checkpoints", "interval": 5}),
             ("spec.checkpoint.dir",)),
            ("client checkpoint dir inside the root", with_spec(checkpoint={"dir": os.path.join(storage, "mine")}),
             ("spec.checkpoint.dir",)),
            ("data path ../outside", with_spec(data={"source": "shards", "path": "../outside"}),
             ("outside the storage root", "spec.data.path")),
            ("data path /etc", with_spec(data={"source": "shards", "path": "/etc"}),
             ("outside the storage root", "spec.data.path")),
            ("data path through a symlink", with_spec(data={"source": "shards", "path": "link/passwd"}),
             ("outside the storage root", "spec.data.path")),
            ("absolute data path through a symlink",
             with_spec(data={"source": "shards", "path": os.path.join(storage, "link")}),
             ("outside the storage root", "spec.data.path")),
            ("data path root/../..", with_spec(data={"source": "shards", "path": storage + "/../.."}),
             ("outside the storage root", "spec.data.path")),
            ("reasoning eval path /etc/passwd",
             {"spec": {"kind": "eval", "threads": 1, "preset": "micro", "steps": 0, "model": {"vocab_size": 260},
                       "reasoning_eval": {"source": "gsm8k", "path": "/etc/passwd"}},
              "world_size": 1, "pool": {"pool": "nowhere"}},
             ("outside the storage root", "spec.reasoning_eval.path")),
            ("reasoning eval path through a symlink",
             {"spec": {"kind": "eval", "threads": 1, "preset": "micro", "steps": 0, "model": {"vocab_size": 260},
                       "reasoning_eval": {"source": "gsm8k", "path": "link/passwd"}},
              "world_size": 1, "pool": {"pool": "nowhere"}},
             ("outside the storage root", "spec.reasoning_eval.path")),
        ]
        for what, body, needles in cases:
            self.refused(what, api.request("POST", "/v1/jobs", body), 400, needles)
        print(f"ok: {len(cases)} client paths (checkpoint dir, data and eval paths escaping the storage root "
              "by '..', absolute paths or a symlink) refused with 400")

    def test_long_strings(self):
        api = self.api
        long = "x" * 5000
        cases = []

        def add(what, mutate):
            b = micro(10, pool="nowhere")
            mutate(b)
            cases.append((what, b))
        add("spec.name", lambda b: b["spec"].update(name=long))
        add("spec.name of 2500 two-byte characters", lambda b: b["spec"].update(name="é" * 2500))
        add("pool label value", lambda b: b.update(pool={"pool": long}))
        add("pool label key", lambda b: b.update(pool={"k" * 5000: "v"}))
        add("request_id", lambda b: b.update(request_id="r" * 5000))
        add("init_from", lambda b: b.update(init_from="j" * 5000))
        add("data.path", lambda b: b["spec"].update(data={"source": "shards", "path": "p" * 5000}))
        add("Struct string value", lambda b: b["spec"].update(
            data={"source": "task", "task": "arithmetic", "task_options": {"s": long}}))
        add("Struct key", lambda b: b["spec"].update(
            data={"source": "task", "task": "arithmetic", "task_options": {"k" * 5000: 1}}))
        add("Struct string in a list", lambda b: b["spec"].update(
            model={"schedule": [{"repeat": 1, "attention": {"plugin": "mha", "options": {"l": ["y", long]}}}]}))
        add("generation stop string", lambda b: b["spec"].update(
            kind="eval", steps=0, model={"vocab_size": 260}, data=None,
            reasoning_eval={"task": "arithmetic", "generation": {"stop": [long]}}))
        for what, body in cases:
            if body["spec"].get("data", 0) is None:
                del body["spec"]["data"]
            self.refused(what, api.request("POST", "/v1/jobs", body), 400, "longer than")
        # 4096 bytes is still allowed: not refused for its length.
        b = micro(10, pool="nowhere")
        b["spec"]["name"] = "n" * 4096
        status, parsed, text = api.request("POST", "/v1/jobs", b)
        assert status == 201 or (status == 400 and "longer than" not in text), (status, text[:300])
        if status == 201:
            api.ok("POST", f"/v1/jobs/{parsed['id']}/cancel")
        print(f"ok: {len(cases)} strings over 4096 bytes (name, labels, request_id, init_from, paths, Struct "
              "keys and values) refused with 400 'longer than'; 4096 bytes accepted")

    def test_nesting(self):
        api = self.api
        fields = {
            "spec.data.task_options": (
                lambda x: {"data": {"source": "task", "task": "arithmetic", "task_options": x}},
                ["data", "task_options"]),
            "spec.data.format_options": (
                lambda x: {"kind": "sft", "model": {"vocab_size": 260},
                           "data": {"source": "chat", "format_options": x}},
                ["data", "format_options"]),
            "spec.model.schedule[0].attention.options": (
                lambda x: {"model": {"schedule": [{"repeat": 1, "attention": {"plugin": "mha", "options": x}}]}},
                ["model", "schedule", 0, "attention", "options"]),
            "spec.model.hybrid.iha_options": (
                lambda x: {"model": {"hybrid": {"iha_options": x}}}, ["model", "hybrid", "iha_options"]),
        }

        def body_with(field, value, pool="nowhere"):
            b = micro(10, pool=pool)
            b["spec"].update(fields[field][0](value))
            return b

        def get_path(obj, path):
            for k in path:
                obj = obj[k]
            return obj
        before = self.snapshot()
        accepted, refused = [], 0
        for field in fields:
            for depth in range(1, 201):
                value = nest(depth)
                status, parsed, text = api.request("POST", "/v1/jobs", body_with(field, value))
                what = f"{field} nested {depth} deep"
                if status == 201:
                    assert depth <= 9, f"{what}: accepted (free-form objects may nest 8 levels)"
                    job_id = parsed["id"]
                    accepted.append(job_id)
                    st, job, jtext = api.request("GET", f"/v1/jobs/{job_id}")
                    assert st == 200 and job is not None, f"{what}: GET {job_id}: HTTP {st}, not JSON: {jtext[:300]}"
                    assert get_path(job["request"]["spec"], fields[field][1]) == value, \
                        f"{what}: the stored request differs: {jtext[:600]}"
                    continue
                refused += 1
                if depth >= 10:
                    error_of(what, (status, parsed, text), 400, "nested deeper than")
                else:
                    err = error_of(what, (status, parsed, text), 400, "")
                    assert depth == 9 or "nested deeper than" not in err, f"{what}: refused for its depth: {err}"
            for arrays, too_deep in ((2, False), (60, True), (199, True)):
                value = nest_list(arrays)
                status, parsed, text = api.request("POST", "/v1/jobs", body_with(field, value))
                what = f"{field} holding {arrays} nested arrays"
                if too_deep:
                    error_of(what, (status, parsed, text), 400, "nested deeper than")
                elif status == 201:
                    accepted.append(parsed["id"])
                else:
                    error_of(what, (status, parsed, text), 400, "")
        # Outside the free-form fields: unknown fields holding deep objects, deep wrong types,
        # raw bodies nested far beyond any parser's comfort.
        def body_depth_rule(total):
            """Outside free-form fields only the body limit (32 levels) applies: True = must be
            refused for depth, False = must not be, None = either (near the limit)."""
            return True if total > 34 else False if total < 31 else None
        others = []
        for depth in (1, 3, 10, 31, 40, 200):
            b = micro(10, pool="nowhere")
            b["spec"]["zzz"] = nest(depth)
            others.append((f"unknown spec field nested {depth}", b, body_depth_rule(depth + 2)))
            b = micro(10, pool="nowhere")
            b["zzz"] = nest(depth)
            others.append((f"unknown top-level field nested {depth}", b, body_depth_rule(depth + 1)))
        b = micro(10, pool="nowhere")
        b["pool"] = {"pool": nest(3)}
        others.append(("pool label holding an object", b, False))
        b = micro(10, pool="nowhere")
        b["init_from"] = nest(40)
        others.append(("init_from holding 40 nested objects", b, True))
        b = micro(10, pool="nowhere")
        b["spec"]["model"] = {"schedule": [nest(40)]}
        others.append(("schedule entry holding 40 nested objects", b, True))
        b = micro(10, pool="nowhere")
        b["spec"]["eval"] = [[[[[[[[[[1]]]]]]]]]]
        others.append(("spec.eval holding 10 nested arrays", b, False))
        for what, body, too_deep in others:
            result = api.request("POST", "/v1/jobs", body)
            err = error_of(what, result, 400, "nested deeper than" if too_deep else "")
            assert too_deep is not False or "nested deeper than" not in err, f"{what}: refused for depth: {err}"
        raw_bodies = [
            ("100000 nested arrays", b"[" * 100000 + b"]" * 100000, "nested deeper than"),
            ("40000 nested objects", b'{"a":' * 40000 + b"1" + b"}" * 40000, "nested deeper than"),
            ("a spec nested 35 deep", json.dumps({"spec": nest(34)}).encode(), "nested deeper than"),
            ("200000 unclosed arrays", b"[" * 200000, ("nested deeper than", "request body")),
            ("a deep array after a valid prefix", b'{"spec": {"name": "x"}, "pool": ' + b"[" * 10000,
             ("nested deeper than", "request body")),
        ]
        for what, raw, needles in raw_bodies:
            error_of(what, api.request("POST", "/v1/jobs", raw=raw), 400, needles)
        after = self.snapshot()
        new = sorted(set(after[0]) - set(before[0]))
        assert sorted(j for j, _ in new) == sorted(accepted) and all(s == "queued" for _, s in new), \
            (new, accepted)
        assert after[1] == before[1], "the catalogue changed"
        self.real_worker_alive()
        status, listing, text = api.request("GET", "/v1/jobs?page_size=500")
        assert status == 200 and listing is not None, f"the job list is not valid JSON: {text[:300]}"
        # One accepted deep-ish job on the real worker: whatever it does, the worker survives.
        deep_job = None
        for field in ("spec.model.schedule[0].attention.options", "spec.model.hybrid.iha_options",
                      "spec.data.task_options", "spec.data.format_options"):
            status, parsed, text = api.request("POST", "/v1/jobs", body_with(field, nest(8), pool="cpu"))
            if status == 201:
                deep_job = (field, parsed["id"])
                break
            error_of(f"{field} nested 8 deep on the real pool", (status, parsed, text), 400, "")
            assert "nested deeper than" not in text, text
        if deep_job:
            job = api.wait_end(deep_job[1], timeout=180)
            deep_note = f"a depth-8 {deep_job[0]} job ran on the real worker and {job['state']}"
        else:
            deep_note = "no depth-8 options job was accepted (each refused by validation)"
        self.real_worker_alive()
        self.normal_job = self.submit(micro(20, interval=10))
        job = api.wait_end(self.normal_job, timeout=180)
        assert job["state"] == "succeeded", job
        for job_id in accepted:
            api.ok("POST", f"/v1/jobs/{job_id}/cancel")
        print(f"ok: JSON nested 1..200 deep in {len(fields)} free-form fields and {len(others) + len(raw_bodies)} "
              f"other places: {refused} refused cleanly, {len(accepted)} accepted and printable; {deep_note}; "
              f"a normal job succeeded afterwards ({self.normal_job})")

    # --- bodies ------------------------------------------------------------------------------------

    def vm_hwm_kib(self):
        return proc_status_kib(self.s.coordinator.pid, "VmHWM")

    def raw_exchange(self, head, chunks=(), limit_s=6.0):
        """Sends head then the chunks while a reader waits for the answer; stops sending once
        it came (or the connection broke). Returns (status, parsed, text, seconds to the answer)."""
        sock = socket.create_connection(("127.0.0.1", self.s.port), timeout=5)
        sock.settimeout(0.5)
        buf = bytearray()
        answer = {}
        done = threading.Event()
        start = time.monotonic()

        def reader():
            try:
                while time.monotonic() - start < limit_s:
                    try:
                        data = sock.recv(65536)
                    except socket.timeout:
                        continue
                    except OSError:
                        break
                    if not data:
                        break
                    buf.extend(data)
                    r = parse_response(bytes(buf))
                    if r:
                        answer.update(r, seconds=time.monotonic() - start)
                        return
                r = parse_response(bytes(buf), eof=True)
                if r:
                    answer.update(r, seconds=time.monotonic() - start)
            finally:
                done.set()
        t = threading.Thread(target=reader, daemon=True)
        t.start()
        sent = 0
        try:
            sock.sendall(head)
            for chunk in chunks:
                if done.is_set() or time.monotonic() - start > limit_s:
                    break
                try:
                    sock.sendall(chunk)
                    sent += len(chunk)
                except socket.timeout:
                    continue
                except OSError:
                    break
        except OSError:
            pass
        done.wait(limit_s)
        try:
            sock.close()
        except OSError:
            pass
        assert answer, f"no answer within {limit_s} s (sent {sent} body bytes; got {bytes(buf)[:200]!r})"
        return answer["status"], answer["parsed"], answer["text"], answer["seconds"]

    def test_bodies(self):
        port = self.s.port
        job = json.dumps(micro(10, pool="nowhere")).encode()

        def head(extra, method="POST", path="/v1/jobs", content_type="application/json"):
            lines = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", f"Authorization: Bearer {ALICE}"]
            if content_type:
                lines.append(f"Content-Type: {content_type}")
            return ("\r\n".join(lines + extra) + "\r\n\r\n").encode()
        mib = b"x" * MIB
        chunk_mib = b"100000\r\n" + mib + b"\r\n"
        chunk_16k = b"4000\r\n" + b"x" * 16384 + b"\r\n"
        gz = gzip.compress(job)
        cases = [
            ("chunked 1 GiB in 1 MiB chunks", head(["Transfer-Encoding: chunked"]),
             (chunk_mib for _ in range(GIB // MIB)), 413, "too large"),
            ("chunked 1 GiB in 16 KiB chunks", head(["Transfer-Encoding: chunked"]),
             (chunk_16k for _ in range(GIB // 16384)), 413, "too large"),
            ("Content-Length 1 GiB", head([f"Content-Length: {GIB}"]), (mib for _ in range(GIB // MIB)),
             413, "too large"),
            ("Content-Length 1 GiB, gzip", head([f"Content-Length: {GIB}", "Content-Encoding: gzip"]),
             (mib for _ in range(GIB // MIB)), 413, "too large"),
            ("chunked gzip", head(["Transfer-Encoding: chunked", "Content-Encoding: gzip"]),
             [b"%x\r\n" % len(gz) + gz + b"\r\n0\r\n\r\n"], 415, "Content-Encoding"),
            ("a small gzip body", head([f"Content-Length: {len(gz)}", "Content-Encoding: gzip"]), [gz],
             415, "Content-Encoding"),
            ("deflate, even if tiny", head(["Content-Length: 2", "Content-Encoding: deflate"]), [b"{}"],
             415, "Content-Encoding"),
            ("a POST without Content-Length or Transfer-Encoding", head([]), [job, mib, mib], 411, "Content-Length"),
            ("a 20 KiB request head", head(["X-Pad: " + "a" * 20480, "Content-Length: 2"]), [b"{}"], 431, ""),
            ("a text/plain POST", head([f"Content-Length: {len(job)}"], content_type="text/plain"), [job],
             415, "Content-Type"),
        ]
        hwm_start = self.vm_hwm_kib()
        worst = 0.0
        growth = []
        for what, h, chunks, want, needle in cases:
            before = self.snapshot()
            hwm = self.vm_hwm_kib()
            status, parsed, text, seconds = self.raw_exchange(h, chunks)
            assert seconds < 2.0, f"{what}: the answer took {seconds:.2f} s"
            worst = max(worst, seconds)
            self.refused(what, (status, parsed, text), want, needle, before)
            grew = self.vm_hwm_kib() - hwm
            growth.append(f"{grew}")
            assert grew < 32 * 1024, f"{what}: the coordinator's peak RSS grew by {grew} KiB"
        grew = self.vm_hwm_kib() - hwm_start
        status, _, text = self.api.request("GET", "/healthz", token=None)
        assert status == 200, (status, text)
        print(f"ok: {len(cases)} oversized, compressed, length-less or badly typed bodies refused (413/415/411/431) "
              f"within {worst:.2f} s; coordinator peak RSS grew {grew} KiB in all ({', '.join(growth)} KiB each)")

    def rank_waits_passively(self, job_id):
        """The real worker starts its ranks with OMP_WAIT_POLICY=passive (agent.cc,
        RankEnvironment), read from the running rank's own /proc environ."""
        envs = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            except OSError:
                continue
            # This test's job (its lease file is under the test's folder), not another Loom's.
            if (env.get(b"LOOM_JOB_ID") == job_id.encode()
                    and env.get(b"LOOM_LEASE_FILE", b"").startswith(self.tmp.encode())):
                envs.append(env)
        assert envs, f"no process of {job_id} found"
        policies = {e.get(b"OMP_WAIT_POLICY") for e in envs}
        assert policies == {b"passive"}, policies
        print(f"ok: {job_id}'s {len(envs)} process(es) run with OMP_WAIT_POLICY=passive")

    def connection_caps(self):
        """The coordinator's connection-cap metrics, asked from 127.0.0.3 (outside the attacked
        address's places): what to know when a request from 127.0.0.1 went unanswered."""
        try:
            _, _, text = Api(self.s.port, source="127.0.0.3").request("GET", "/metrics", token=None,
                                                                      timeout=5)
        except OSError as e:
            return f"/metrics from 127.0.0.3 failed too: {e!r}"
        caps = metric_family(text, "loom_coordinator_http_connections_")
        return "connection caps: " + ", ".join(f"{k} {v:g}" for k, v in sorted(caps.items()))

    def test_slowloris(self):
        port = self.s.port
        partial = (f"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-Slow: " + "a" * 200).encode()
        conns = []
        start = time.monotonic()
        for _ in range(40):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.setblocking(False)
            conns.append({"sock": s, "sent": 0, "closed": None, "first": None})
        before = self.snapshot()
        slowest = 0.0
        next_byte = time.monotonic()
        while time.monotonic() - start < 25 and any(c["closed"] is None for c in conns):
            now = time.monotonic()
            if now >= next_byte:
                next_byte = now + 1.0
                for c in conns:
                    if c["closed"] is not None:
                        continue
                    try:
                        c["sock"].send(partial[c["sent"]:c["sent"] + 1])
                        c["sent"] += 1
                        c["first"] = c["first"] or now
                    except (BlockingIOError, InterruptedError):
                        pass
                    except OSError:
                        c["closed"] = now
                # The API answers meanwhile.
                for path, token in (("/healthz", None), ("/v1/jobs?page_size=5", ALICE)):
                    t = time.monotonic()
                    try:
                        status, parsed, text = Api(port).request("GET", path, token=token, timeout=5)
                    except OSError as e:
                        raise AssertionError(f"GET {path} during slowloris: {e!r} after "
                                             f"{time.monotonic() - t:.1f} s; {self.connection_caps()}")
                    took = time.monotonic() - t
                    slowest = max(slowest, took)
                    assert status == 200 and took < 2.0, (f"GET {path} during slowloris: HTTP {status} in "
                                                          f"{took:.2f} s; {self.connection_caps()}")
            readable = [c["sock"] for c in conns if c["closed"] is None]
            r, _, _ = select.select(readable, [], [], 0.2)
            for c in conns:
                if c["sock"] in r:
                    try:
                        data = c["sock"].recv(4096)
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        data = b""
                    if not data:
                        c["closed"] = time.monotonic()
                    else:  # at most a 408 before the close
                        c["got"] = c.get("got", b"") + data
                        if not (c["got"].startswith(b"HTTP/1.1 408") or b"HTTP/1.1 408".startswith(c["got"])):
                            raise AssertionError(f"slowloris connection answered: {c['got'][:200]!r}")
        for c in conns:
            c["sock"].close()
        open_ = [c for c in conns if c["closed"] is None]
        assert not open_, f"{len(open_)} slowloris connections still open after 25 s"
        held = max(c["closed"] - (c["first"] or start) for c in conns)
        assert held <= 16.0, f"a slowloris connection was held {held:.1f} s (head timeout 10 s)"
        self.unchanged(before, "slowloris")
        print(f"ok: 40 slowloris connections closed after at most {held:.1f} s; the API answered within "
              f"{slowest:.2f} s meanwhile; the real worker stayed alive; {self.connection_caps()}")

    # --- log followers ---------------------------------------------------------------------------

    def open_follow(self, job_id, token):
        """Opens GET .../logs?follow=true; returns (status, error or None, socket while streaming)."""
        s, buf = open_log_follow(self.s.port, job_id, token)
        r = parse_response(buf, eof=False, head_only=True)
        assert r, f"no response head: {buf[:200]!r}"
        if r["status"] == 200:
            return 200, None, s
        while not parse_response(buf):
            data = s.recv(65536)
            if not data:
                break
            buf += data
        s.close()
        r = parse_response(buf, eof=True)
        error = (r["parsed"] or {}).get("error")
        if r["status"] == 429:  # the client is told when to come back, in the header and the body
            assert r["headers"].get("retry-after") == "1", r["headers"]
            assert {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "1s"} in error["details"], error
        return r["status"], error["message"] if isinstance(error, dict) else r["text"], None

    def test_log_followers(self, job_id):
        api = self.api
        results = {}
        lock = threading.Lock()
        stop = threading.Event()
        barrier = threading.Barrier(64)

        def follower(i, user, token):
            barrier.wait(timeout=30)
            try:
                status, err, sock = self.open_follow(job_id, token)
            except Exception as e:  # noqa: BLE001
                status, err, sock = None, repr(e), None
            with lock:
                results[i] = (user, status, err, sock)
            if sock is not None:  # keep reading so the stream is never blocked on this side
                sock.settimeout(0.5)
                while not stop.is_set():
                    try:
                        if not sock.recv(65536):
                            break
                    except socket.timeout:
                        continue
                    except OSError:
                        break
        threads = [threading.Thread(target=follower, args=(i, "alice" if i % 2 else "bob", ALICE if i % 2 else BOB),
                                    daemon=True) for i in range(64)]
        for t in threads:
            t.start()
        wait_for("64 follow requests answered", lambda: len(results) == 64, timeout=30)
        try:
            for user in ("alice", "bob"):
                mine = [r for r in results.values() if r[0] == user]
                streaming = [r for r in mine if r[1] == 200]
                refused = [r for r in mine if r[1] != 200]
                assert 1 <= len(streaming) <= FOLLOWERS_PER_USER, \
                    f"{user}: {len(streaming)} log streams admitted (limit {FOLLOWERS_PER_USER})"
                for r in refused:
                    assert r[1] == 429 and "too many log streams" in (r[2] or ""), f"{user}: {r[1]} {r[2]}"
            n_streams = sum(r[1] == 200 for r in results.values())
            # While they stay open: heartbeats keep the worker alive and the job makes progress.
            step0 = int(api.job(job_id)["progress"].get("step", 0))
            for _ in range(10):
                time.sleep(1.0)
                self.real_worker_alive()
                assert all(w["state"] == "alive" for w in api.workers() if w["name"] == "real")
            job = api.job(job_id)
            step1 = int(job["progress"].get("step", 0))
            assert job["state"] == "running" and step1 > step0, f"no progress while followed: {step0} -> {step1}"
        finally:
            stop.set()
            for r in results.values():
                if r[3] is not None:
                    try:
                        r[3].shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    r[3].close()
            for t in threads:
                t.join(timeout=5)

        # Closed streams free their slots.
        def follow_again(token):
            status, err, sock = self.open_follow(job_id, token)
            if sock:
                sock.close()
            return status == 200
        wait_for("a new log stream after the others closed", lambda: follow_again(ALICE), timeout=15, interval=0.5)
        wait_for("a new log stream for bob", lambda: follow_again(BOB), timeout=15, interval=0.5)
        print(f"ok: 64 concurrent log followers: {n_streams} streamed (<= {FOLLOWERS_PER_USER} per user), the rest "
              f"429 'too many log streams'; worker alive and job progressing ({step0} -> {step1}) for 10 s; "
              "slots freed on close")

    # --- agent protocol --------------------------------------------------------------------------

    def register(self, name, labels, slots=1):
        code, parsed, message = self.agent.register(
            {"name": name, "address": "127.0.0.1", "slots": slots, "labels": labels}, ENROLMENT_TOKEN)
        assert code == "OK" and parsed.get("worker_id") and parsed.get("credential"), f"register: {code} {message}"
        assert parsed["credential"] != ENROLMENT_TOKEN
        return parsed["worker_id"], parsed["credential"]

    def heartbeat(self, worker_id, token, attempts=()):
        """A Heartbeat call on the agent port: (gRPC code name, response, message)."""
        return self.agent.heartbeat({"worker_id": worker_id, "attempts": list(attempts)}, token)

    def http_on_agent_port(self):
        """A user route over HTTP/1.1 on the agent port: no HTTP answer (it speaks gRPC only)."""
        with socket.create_connection(("127.0.0.1", self.s.agent_port), timeout=10) as sock:
            sock.sendall(f"GET /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {ALICE}\r\n\r\n"
                         .encode())
            sock.settimeout(10)
            try:
                data = sock.recv(4096)
            except (ConnectionResetError, socket.timeout):
                data = b""
        assert not data.startswith(b"HTTP/"), f"the agent port answered HTTP: {data[:200]}"

    def test_forged_heartbeats(self, job_id):
        api = self.api
        f1 = FakeWorker(self, "fake-1", {"pool": "fake"})
        f2 = FakeWorker(self, "fake-2", {"pool": "fake2"})
        self.fakes = [f1, f2]
        job = api.job(job_id)
        assert job["state"] == "running", job["state"]
        attempt = job["attempt"]
        real_id = job["placement"][0]["worker_id"]

        def snap():
            jobs, cat = self.snapshot()
            return [x for x in jobs if x[0] != job_id], [x for x in cat if not x[0].startswith(job_id + "/")]

        def refused(what, send, want, needles):
            before = snap()
            err = error_of(what, send(), want, needles)
            after = snap()
            assert after == before, f"{what}: something changed: {after} vs {before}"
            self.real_worker_alive()
            j = api.job(job_id)
            assert j["state"] == "running" and j["attempt"] == attempt, f"{what}: {job_id} now {j['state']}"
            assert f1.id not in j.get("finished_workers", []), j.get("finished_workers")
            return err
        finished_report = {"job_id": job_id, "attempt": attempt, "finished": True,
                           "ranks": [{"rank": 0, "running": False, "exit_code": 0, "detail": "exited 0"}],
                           "progress": {"step": 999999, "total_steps": 999999}}
        hb = self.heartbeat
        cases = [
            ("another worker's id", lambda: hb(f2.id, f1.credential), "PERMISSION_DENIED", "credential"),
            ("the enrolment token on a heartbeat", lambda: hb(f1.id, ENROLMENT_TOKEN), "PERMISSION_DENIED",
             "credential"),
            ("an unknown worker with the enrolment token", lambda: hb("w-deadbeef", ENROLMENT_TOKEN),
             "PERMISSION_DENIED", "credential"),
            ("an unknown worker with a credential", lambda: hb("w-deadbeef", f1.credential), "PERMISSION_DENIED",
             "credential"),
            ("the real worker's id with a fake's credential", lambda: hb(real_id, f1.credential),
             "PERMISSION_DENIED", "credential"),
            ("a user token on the agent port", lambda: hb(f1.id, ALICE), ("UNAUTHENTICATED", "PERMISSION_DENIED"),
             "user token"),
            ("no token on the agent port", lambda: hb(f1.id, None), "UNAUTHENTICATED", "missing bearer token"),
            ("a heartbeat on the user listener", lambda: Api(self.s.port).request(
                "POST", "/v1/agent/heartbeat", {"worker_id": f1.id}, token=f1.credential), 404, "no route"),
            ("a registration on the user listener", lambda: Api(self.s.port).request(
                "POST", "/v1/agent/register", {"name": "x", "address": "127.0.0.1", "slots": 1},
                token=ENROLMENT_TOKEN), 404, "no route"),
            ("a credential on a registration", lambda: self.agent.register(
                {"name": "x", "address": "127.0.0.1", "slots": 1}, f1.credential),
             ("UNAUTHENTICATED", "PERMISSION_DENIED"), "invalid token"),
            ("finished report on an attempt placed elsewhere", lambda: hb(f1.id, f1.credential, [finished_report]),
             "PERMISSION_DENIED", "not placed on worker"),
            ("a progress report on an attempt placed elsewhere", lambda: hb(f1.id, f1.credential, [
                {"job_id": job_id, "attempt": attempt, "ranks": [{"rank": 0, "running": True}],
                 "progress": {"step": 999999}}]), "PERMISSION_DENIED", "not placed on worker"),
            ("a report on an attempt of it that does not exist", lambda: hb(f1.id, f1.credential, [
                {**finished_report, "attempt": attempt + 1}]), ("INVALID_ARGUMENT", "PERMISSION_DENIED"),
             ("not placed on worker", "attempt")),
        ]
        for what, result, want, needles in cases:
            refused(what, result, want, needles)
        before = snap()
        self.http_on_agent_port()  # a user route on the agent port
        assert snap() == before
        assert int(api.job(job_id)["progress"].get("step", 0)) < 999999
        # A lost worker's credential is revoked.
        f3_id, f3_cred = self.register("fake-3", {"pool": "fake3"})
        wait_for("fake-3 to be lost", lambda: any(w["id"] == f3_id and w["state"] == "lost" for w in api.workers()),
                 timeout=LOST_AFTER_MS / 1000 + 10)
        refused("a lost worker's credential", lambda: self.heartbeat(f3_id, f3_cred), "UNAUTHENTICATED",
                "revoked")
        assert all(f.ok() for f in (f1, f2)), "a fake worker's own heartbeats failed"
        print(f"ok: {len(cases) + 2} forged heartbeats (foreign ids, the enrolment token, user tokens, wrong listener, "
              f"reports on {job_id} placed elsewhere, a lost worker's credential) refused; {job_id} still running")

    def test_forged_checkpoints(self):
        api = self.api
        f1 = self.fakes[0]
        other = self.normal_job
        fj = self.submit(micro(50, pool="fake"))
        job = api.wait(fj, lambda j: j["state"] == "running", "the fake worker's job to run", timeout=30)
        attempt = job["attempt"]
        own = job["spec"]["checkpoint"]["dir"]
        storage = self.s.storage
        assert os.path.realpath(own).startswith(os.path.realpath(storage)), own

        def report(**kw):
            r = {"job_id": fj, "attempt": attempt, "ranks": [{"rank": 0, "running": True}],
                 "progress": {"step": 777, "total_steps": 50}}
            r.update(kw)
            return r
        paths = [
            ("/etc", "/etc"),
            ("another job's checkpoint", f"{storage}/jobs/{other}/checkpoints/step-00000005"),
            ("its own dir, then ../..", f"{own}/../../{other}/checkpoints/step-00000005"),
            ("a step directory of another step", f"{own}/step-00000006"),
            ("a relative path", "step-00000005"),
            ("its own dir itself", own),
            ("a step directory under /tmp", "/tmp/step-00000005"),
        ]
        for what, path in paths:
            before = self.snapshot()
            result = self.heartbeat(f1.id, f1.credential, [report(checkpoints=[{"step": 5, "path": path}])])
            self.refused(f"checkpoint report: {what}", result, "INVALID_ARGUMENT", "checkpoint", before)
            j = api.job(fj)
            assert int(j["progress"].get("step", 0)) != 777 and not j.get("checkpoints"), \
                f"a rejected heartbeat changed {fj}: {j['progress']} {j.get('checkpoints')}"
        assert not api.catalogue(fj), api.catalogue(fj)
        # finished with no rank reported is not a success.
        f1.hold(fj)  # the fake stops reporting this attempt itself
        code, parsed, message = self.heartbeat(f1.id, f1.credential, [report(ranks=[], finished=True, progress={})])
        assert code in ("OK", "INVALID_ARGUMENT", "PERMISSION_DENIED"), (code, message)
        time.sleep(1.5)
        j = api.job(fj)
        assert j["state"] != "succeeded", f"{fj} succeeded on a finished report without ranks: {j['events'][-3:]}"
        self.heartbeat(f1.id, f1.credential, [report(ranks=[{"rank": 0, "running": True}], finished=True,
                                                     progress={})])
        time.sleep(1.0)
        j = api.job(fj)
        assert j["state"] != "succeeded", f"{fj} succeeded while its rank was reported running: {j['events'][-3:]}"
        if j["state"] not in ("failed", "cancelled"):
            status, _, text = api.request("POST", f"/v1/jobs/{fj}/cancel")
            assert status in (200, 409), (status, text)
        print(f"ok: {len(paths)} forged checkpoint paths refused with INVALID_ARGUMENT (catalogue and job unchanged); "
              f"'finished' without successful ranks did not make {fj} succeed ({j['state']})")

    # --- loom up -------------------------------------------------------------------------------------

    def test_loom_up(self):
        args, tmp = self.args, self.tmp
        port = free_port()
        data = os.path.join(tmp, "up")
        xdg = os.path.join(tmp, "xdg")
        os.makedirs(xdg)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "XDG_CONFIG_HOME": xdg}
        env.pop("LOOM_TOKEN", None)
        out = open(os.path.join(tmp, "loom-up.log"), "w")
        up = subprocess.Popen([args.loom, "up", "--workers", "1", "--slots", "1", "--port", str(port),
                               "--data-dir", data], stdout=out, stderr=subprocess.STDOUT, env=env)
        PROCS.append(up)
        cli_env = {**env, "LOOM_COORDINATOR": f"http://127.0.0.1:{port}"}

        def cli(*argv):
            return subprocess.run([args.loom, *argv], env=cli_env, capture_output=True, text=True, timeout=60)

        def one_alive():
            assert up.poll() is None, "loom up exited"
            r = cli("workers", "--json")
            return r.returncode == 0 and sum(w["state"] == "alive" for w in json.loads(r.stdout)["workers"]) == 1
        wait_for("loom up's worker (CLI without a token)", one_alive, timeout=40, interval=0.3)
        token_file = os.path.join(xdg, "loom", f"local-{port}.token")
        assert os.path.isfile(token_file), f"{token_file} missing"
        assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600, oct(os.stat(token_file).st_mode)
        with open(token_file) as f:
            token = f.read().strip()
        assert len(token) >= 16, "a short token"
        holders, named = [], []
        for d, _, files in os.walk(data):
            for name in files:
                p = os.path.join(d, name)
                if "token" in name or "enrol" in name:
                    named.append(p)
                if os.path.getsize(p) < 65536:
                    with open(p, "rb") as f:
                        if token.encode() in f.read():
                            holders.append(p)
        assert holders, f"no file under {data} holds the user token"
        for p in set(holders + named):
            assert stat.S_IMODE(os.stat(p).st_mode) == 0o600, f"{p}: mode {oct(os.stat(p).st_mode)}"
        api = Api(port, token)
        status, _, _ = api.request("GET", "/v1/jobs")
        assert status == 200, status
        body = micro(5, world=1)
        del body["pool"]
        error_of("no token", api.request("GET", "/v1/jobs", token=None), 401, "")
        error_of("no token on a POST", api.request("POST", "/v1/jobs", body, token=None), 401, "")
        error_of("a foreign Host", api.request("GET", "/v1/jobs", headers={"Host": f"evil.example:{port}"}), 403,
                 "Host")
        error_of("a foreign Host on a POST", api.request("POST", "/v1/jobs", body,
                                                         headers={"Host": f"evil.example:{port}"}), 403, "Host")
        error_of("a foreign Origin", api.request("POST", "/v1/jobs", body,
                                                 headers={"Origin": "http://evil.example"}), 403, "Origin")
        error_of("a text/plain POST", api.request("POST", "/v1/jobs", raw=json.dumps(body).encode(),
                                                  headers={"Content-Type": "text/plain"}), 415, "Content-Type")
        error_of("a form POST", api.request("POST", "/v1/jobs", raw=b"a=b",
                                            headers={"Content-Type": "application/x-www-form-urlencoded"}),
                 415, "Content-Type")
        r = cli("list", "--json")
        assert r.returncode == 0 and json.loads(r.stdout).get("jobs", []) == [], r.stdout + r.stderr
        up.send_signal(signal.SIGINT)
        up.wait(timeout=30)
        out.close()
        with open(os.path.join(tmp, "loom-up.log")) as f:
            log = f.read()
        assert up.returncode == 0 and "loom up: stopped" in log, log[-2000:]
        assert not os.path.exists(token_file), f"{token_file} left after loom up stopped"
        print("ok: loom up: token file 0600 picked up by the CLI, 401 without it, 403 for a foreign Host or "
              "Origin, 415 for text/plain; nothing submitted; SIGINT removed the token file")


class FakeWorker:
    """A worker this test registers and heartbeats itself (every 250 ms, from a thread). It
    reports the attempts it is assigned as running (a fake rendezvous port for rank 0)."""

    def __init__(self, h, name, labels):
        self.h = h
        self.id, self.credential = h.register(name, labels)
        self.lock = threading.Lock()
        self.attempts = {}  # (job, attempt) -> assignment
        self.held = set()
        self.failures = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def reports(self):
        out = []
        with self.lock:
            for (job, attempt), a in self.attempts.items():
                if job in self.held:
                    continue
                out.append({"job_id": job, "attempt": attempt, "master_port": a.get("master_port") or 29999,
                            "ranks": [{"rank": r, "running": True} for r in a.get("ranks", [])]})
        return out

    def run(self):
        while not self.stop.is_set():
            try:
                code, parsed, message = self.h.heartbeat(self.id, self.credential, self.reports())
                if code != "OK":
                    self.failures.append((code, message[:200]))
                else:
                    with self.lock:
                        for a in parsed.get("assignments", []):
                            self.attempts.setdefault((a["job_id"], a["attempt"]), a)
                        for c in parsed.get("cancels", []) + parsed.get("forget", []):
                            self.attempts.pop((c["job_id"], c["attempt"]), None)
            except Exception as e:  # noqa: BLE001
                self.failures.append(repr(e))
            self.stop.wait(0.25)

    def hold(self, job_id):
        with self.lock:
            self.held.add(job_id)

    def ok(self):
        return not self.failures or print(f"fake worker {self.id}: {self.failures[:3]}")


def parse_response(buf, eof=False, head_only=False):
    """The first final HTTP response in buf as {status, parsed, text}, or None while incomplete."""
    while True:
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            return None
        lines = buf[:end].decode("latin-1").split("\r\n")
        try:
            status = int(lines[0].split(" ", 2)[1])
        except (IndexError, ValueError):
            return {"status": -1, "parsed": None, "text": buf[:200].decode("latin-1")}
        if 100 <= status < 200:
            buf = buf[end + 4:]
            continue
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        if head_only:
            return {"status": status, "parsed": None, "text": "", "headers": headers}
        body = buf[end + 4:]
        if "content-length" in headers:
            n = int(headers["content-length"])
            if len(body) < n:
                return None
            body = body[:n]
        elif not eof:
            return None
        text = body.decode("utf-8", "replace")
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = None
        return {"status": status, "parsed": parsed, "text": text, "headers": headers}


def main():
    ap = control_plane_arg_parser()
    args = ap.parse_args()
    tmp = os.path.realpath(tempfile.mkdtemp(prefix="loom-hostile-"))
    h = Hostile(args, tmp)
    h.fakes = []
    started = time.time()
    try:
        h.s.start_coordinator()
        h.s.start_worker("real", labels="pool=cpu", slots=2)
        h.s.wait_alive(["real"])
        h.test_paths()
        h.test_long_strings()
        h.test_nesting()
        h.test_bodies()
        h.test_slowloris()
        # A long job on the real worker for the followers and the forged reports.
        long_job = h.submit(micro(5000, interval=100, micro_batch=8, seq_len=64))
        # It runs and commits checkpoints while forged reports are refused: snapshots leave its
        # catalogue entries out (its state stays in), and its own end is checked below.
        h.volatile_jobs.add(long_job)
        h.api.wait(long_job, lambda j: j["state"] == "running" and int(j["progress"].get("step", 0)) > 20,
                   "the long job to run", timeout=60)
        h.rank_waits_passively(long_job)
        h.test_log_followers(long_job)
        h.test_forged_heartbeats(long_job)
        h.test_forged_checkpoints()
        job = h.api.wait_end_progressing(long_job)  # a loaded 2-core machine runs it slowly
        assert job["state"] == "succeeded" and job["restarts"] == 0, job
        print(f"ok: the long job {long_job} succeeded untouched by the forged reports")
        for f in h.fakes:
            f.stop.set()
        h.real_worker_alive()
        h.test_loom_up()
    except BaseException:
        h.s.dump_logs(["coordinator.log", "real.log", "loom-up.log"])
        raise
    finally:
        for f in h.fakes:
            f.stop.set()
        stop_all(PROCS, tmp)
    subprocess.run(["rm", "-rf", tmp])
    print(f"hostile clients: all checks passed in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()

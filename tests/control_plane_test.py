#!/usr/bin/env python3
"""The control plane with real processes on loopback: loom-coordinator (user tokens, RocksDB on
disk; a user listener and a separate agent listener), two loom-worker agents (enrolment token,
then per-worker credentials) launching real loom-train ranks, the loom CLI and the REST API.

Checks: submit -> run -> succeed; cancel mid-run (ranks gone, slots freed); kill -9 of a trainer
rank (restart from the newest checkpoint, finishes at the expected step); kill -9 of a worker
(marked lost, job reruns on the other worker); kill -9 + restart of the coordinator mid-run (jobs,
events and catalogue intact, the job completes); 200 concurrent submissions (each accepted exactly
once, ids unique); 25+ malformed and hostile requests (clean 4xx, server stays up); the OpenAPI
document linted clean by Redocly (recommended rules) and matching the served routes. Every process is killed on exit.
"""
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loom_testlib import (Service, agent_refusal, control_plane_arg_parser, loom_trainers, redocly_lint,  # noqa: E402
                          stop_all)

PROCS = []
ROOT = None  # this suite's temporary directory: its agents' ranks run under it
USER_TOKEN = "alice-token-0123456789abcdef"
BOB_TOKEN = "bob-token-0123456789abcdef01"
ROOT_TOKEN = "root-token-0123456789abcdef0"
WORKER_TOKEN = "worker-token-0123456789abcdef"  # the enrolment token: good for registration only


class Cluster(Service):
    """The coordinator (fast heartbeats, a 256 KiB body limit) and the node-a / node-b agents."""

    def __init__(self, args, tmp):
        super().__init__(args, tmp, {"alice": USER_TOKEN, "bob": BOB_TOKEN, "root": ROOT_TOKEN}, WORKER_TOKEN,
                         ["--heartbeat-ms", "200", "--lost-after-ms", "4000", "--term-grace-ms", "2000",
                          "--max-body-bytes", "262144"], PROCS, admins=("root",))

    def start_coordinator(self):
        """A restart reuses the ports, retrying while the old sockets still hold them."""
        return super().start_coordinator(self.port, self.agent_port, tries=20)

    def worker_ids(self):
        return {w["name"]: w for w in self.api.ok("GET", "/v1/workers")["workers"]}

    def wait_workers(self, n, timeout=20):
        deadline = time.time() + timeout
        while time.time() < deadline:
            alive = [w for w in self.worker_ids().values() if w["state"] == "alive"]
            if len(alive) >= n:
                return
            time.sleep(0.1)
        raise AssertionError(f"fewer than {n} live workers: {self.worker_ids()}")


def rank_pids(job_id):
    """rank -> pid of the live loom-train processes of a job that this suite's agents started
    (under ROOT): other suites' coordinators number their jobs from job-000001 too."""
    return {t["rank"]: t["pid"] for t in loom_trainers(ROOT) if t["job"] == job_id}


def micro(steps, world=2, interval=20, **extra):
    spec = {"preset": "micro", "steps": steps, "micro_batch": 4, "seq_len": 32, "threads": 1,
            "dist_timeout_seconds": 30, "data": {"corpus_bytes": 65536}, "eval": {"batches": 1},
            "checkpoint": {"interval": interval, "keep_last": 2}, "metrics": {"log_every": 5}}
    spec.update(extra)
    return {"spec": spec, "world_size": world, "pool": {"pool": "cpu"}}


def states(job):
    return [e["state"] for e in job["events"] if e["state"]]


def submit(api, body):
    status, parsed, text = api.request("POST", "/v1/jobs", body)
    assert status == 201, f"submit: HTTP {status}: {text}"
    return parsed["id"]


def test_submit_run_succeed(c):
    api = c.api
    job_id = submit(api, micro(40))
    job = api.wait(job_id, lambda j: j["state"] in ("succeeded", "failed", "cancelled"), "the end")
    assert job["state"] == "succeeded", job
    assert states(job) == ["queued", "scheduled", "running", "succeeded"], states(job)
    assert int(job["progress"]["step"]) == 40 and job["attempt"] == 1
    assert job["evals"] and job["evals"][-1]["eval_loss"] < job["evals"][0]["eval_loss"], job["evals"]
    cat = api.ok("GET", f"/v1/checkpoints?job={job_id}")["checkpoints"]
    assert [int(x["step"]) for x in cat] == [20, 40], cat
    assert all(os.path.isfile(os.path.join(x["path"], "manifest.json")) for x in cat[1:])
    status, _, log = api.request("GET", f"/v1/jobs/{job_id}/logs")
    assert status == 200 and "[rank 0] step 40/40" in log and "rank 1 exited 0" in log, log[-2000:]
    # Streaming a finished job's log ends by itself and returns the same bytes.
    status, _, followed = api.request("GET", f"/v1/jobs/{job_id}/logs?follow=true", timeout=60)
    assert status == 200 and followed.startswith(log[:200])
    # The CLI: status, list, checkpoints, workers (text and --json).
    r = c.cli("status", job_id)
    assert "succeeded" in r.stdout and "checkpoint at step 40" in r.stdout, r.stdout
    listed = json.loads(c.cli("list", "--json").stdout)
    assert any(j["id"] == job_id for j in listed["jobs"])
    assert f"{job_id}.40" in c.cli("checkpoints").stdout
    assert "alive" in c.cli("workers").stdout
    # -o json and -o yaml print every field, defaults included (priority 0, restarts 0).
    as_json = json.loads(c.cli("status", job_id, "-o", "json").stdout)
    assert as_json["priority"] == 0 and as_json["restarts"] == 0 and as_json["id"] == job_id, as_json
    as_yaml = yaml.safe_load(c.cli("-o", "yaml", "status", job_id).stdout)
    assert as_yaml == as_json, (as_yaml, as_json)
    test_cli_exit_codes(c)
    # A second job fine-tunes from the first one's checkpoint: lineage in the catalogue.
    body = micro(10)
    body["init_from"] = f"{job_id}/40"  # the old id form is still accepted
    child = submit(api, body)
    api.wait(child, lambda j: j["state"] == "succeeded", "the fine-tune to succeed")
    cat = api.ok("GET", f"/v1/checkpoints?job={child}")["checkpoints"]
    assert cat and all(x["parent"] == f"{job_id}.40" for x in cat), cat  # ... and stored canonical
    status, _, log = api.request("GET", f"/v1/jobs/{child}/logs")
    assert "init-from" in log or "initialised from" in log or "init from" in log, log[-3000:]
    print(f"ok: submit -> run -> succeed ({job_id}), fine-tune lineage ({child})")


def test_cli_exit_codes(c):
    """The documented exit codes (loom --help): not found 3, refused 4, job failed 5."""
    r = c.cli("status", "job-999999", check=False)
    assert r.returncode == 3 and "not found" in r.stderr, (r.returncode, r.stderr)
    bad = os.path.join(c.tmp, "bad-job.json")
    with open(bad, "w") as f:
        json.dump({"preset": "micro", "steps": -1}, f)
    r = c.cli("submit", bad, check=False)
    assert r.returncode == 4 and "steps" in r.stderr, (r.returncode, r.stderr)
    good = os.path.join(c.tmp, "long-job.json")
    with open(good, "w") as f:
        json.dump(micro(100000, world=1), f)
    env = {**c.env, "LOOM_COORDINATOR": f"http://127.0.0.1:{c.port}", "LOOM_TOKEN": USER_TOKEN}
    follow = subprocess.Popen([c.args.loom, "submit", good, "--follow"], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = follow.stdout.readline()
    job_id = re.match(r"submitted (job-\d+)", first).group(1)
    c.api.ok("POST", f"/v1/jobs/{job_id}/cancel")
    _, err = follow.communicate(timeout=60)
    assert follow.returncode == 5 and "cancelled" in err, (follow.returncode, err)
    print("ok: CLI exit codes: not found 3, refused 4, job cancelled under --follow 5")
    # Labels and a description: set by `loom submit`, shown by `loom status`, filtered by
    # `loom list --label` (a job on a pool nobody serves: it only waits).
    spec_file = os.path.join(c.tmp, "labelled-job.json")
    with open(spec_file, "w") as f:
        json.dump(micro(10, world=1), f)
    r = c.cli("submit", spec_file, "--pool", "pool=nobody", "--label", "project=iha,stage=a-1",
              "--description", "p=2 vs MHA")
    labelled = re.match(r"submitted (job-\d+)", r.stdout).group(1)
    status = c.cli("status", labelled).stdout
    assert "labels    project=iha,stage=a-1" in status and "about     p=2 vs MHA" in status, status
    listed = json.loads(c.cli("list", "--label", "project=iha", "--limit", "0", "--json").stdout)
    assert [j["id"] for j in listed["jobs"]] == [labelled], listed
    none = json.loads(c.cli("list", "--label", "project=mha", "--limit", "0", "--json").stdout)
    assert not none.get("jobs"), none
    r = c.cli("submit", spec_file, "--label", "Project=x", check=False)
    assert r.returncode == 4 and "labels" in r.stderr, (r.returncode, r.stderr)
    c.api.ok("POST", f"/v1/jobs/{labelled}/cancel")
    print(f"ok: labels and a description on {labelled}: shown, filtered, refused when malformed")


def test_eval_job_results_stored_with_the_job(c):
    """An eval job that names no model gets it from its init_from checkpoint (through the
    catalogue); the worker forwards the reasoning eval and the job record keeps it."""
    api = c.api
    body = micro(10, world=1, interval=10, model={"vocab_size": 260})
    pre = submit(api, body)
    api.wait(pre, lambda j: j["state"] == "succeeded", "the vocab-260 pretrain to succeed")
    ev = {"spec": {"kind": "eval", "threads": 1,
                   "reasoning_eval": {"task": "arithmetic", "problems": 3, "samples": 2,
                                      "generation": {"max_new_tokens": 8}}},
          "world_size": 1, "pool": {"pool": "cpu"}, "init_from": f"{pre}.10"}
    job_id = submit(api, ev)
    job = api.wait(job_id, lambda j: j["state"] in ("succeeded", "failed"), "the eval job")
    assert job["state"] == "succeeded", job
    assert job["spec"]["model"]["vocab_size"] == 260, job["spec"]["model"]  # from the manifest
    reasoning = [e for e in job.get("evals", []) if e.get("kind") == "reasoning"]
    assert len(reasoning) == 1, job.get("evals")
    r = reasoning[0]
    assert r["task"] == "builtin:arithmetic" and int(r["problems"]) == 3 and r["samples"] == 2, r
    assert 0 <= r.get("pass_at_1", 0) <= 1 and os.path.isfile(r["details"]), r
    out = c.cli("status", job_id).stdout
    assert "reasoning eval at step 0 (builtin:arithmetic, 3 problems x 2 samples)" in out, out
    # Without init_from and without a model there is nothing to evaluate: a 400 naming the field.
    status, _, text = api.request("POST", "/v1/jobs", {**ev, "init_from": ""})
    assert status == 400 and "spec.model" in text, (status, text)
    print(f"ok: eval job {job_id} on {pre}/10 (model from the checkpoint), result stored")


def test_cancel_mid_run(c):
    api = c.api
    job_id = submit(api, micro(100000, interval=0))
    api.wait(job_id, lambda j: j["state"] == "running" and int(j["progress"].get("step", 0)) > 5, "progress")
    assert len(rank_pids(job_id)) == 2
    # bob may not cancel alice's job: 403, and it runs on with the same ranks.
    pids = rank_pids(job_id)
    status, parsed, text = api.request("POST", f"/v1/jobs/{job_id}/cancel", token=BOB_TOKEN)
    assert status == 403 and "belongs to alice" in parsed["error"]["message"], (status, text)
    step = int(api.job(job_id)["progress"]["step"])
    api.wait(job_id, lambda j: int(j["progress"].get("step", 0)) > step + 5, "progress after bob's cancel")
    assert api.job(job_id)["state"] == "running" and rank_pids(job_id) == pids
    job = api.ok("POST", f"/v1/jobs/{job_id}/cancel")
    assert job["state"] == "cancelled"
    deadline = time.time() + 15
    while rank_pids(job_id) and time.time() < deadline:
        time.sleep(0.1)
    assert not rank_pids(job_id), "ranks still running after cancel"
    deadline = time.time() + 10
    while any(w["used_slots"] for w in c.worker_ids().values()) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(w["used_slots"] for w in c.worker_ids().values()), c.worker_ids()
    status, parsed, _ = api.request("POST", f"/v1/jobs/{job_id}/cancel")
    assert status == 409 and "already cancelled" in parsed["error"]["message"]
    print(f"ok: cancel mid-run ({job_id}); another user's cancel is 403 and the job runs on")


def wait_checkpoint(api, job_id, min_step):
    return api.wait(job_id, lambda j: any(int(x.rsplit(".", 1)[1]) >= min_step for x in j["checkpoints"]) and
                    j["state"] == "running", f"a checkpoint at step >= {min_step}")


def test_kill_rank(c):
    api = c.api
    job_id = submit(api, micro(240))
    wait_checkpoint(api, job_id, 40)
    pids = rank_pids(job_id)
    assert set(pids) == {0, 1}, pids
    os.kill(pids[1], signal.SIGKILL)
    job = api.wait(job_id, lambda j: j["state"] in ("succeeded", "failed", "cancelled"), "the end", timeout=180)
    assert job["state"] == "succeeded", job
    assert job["restarts"] == 1 and job["attempt"] == 2, job
    assert int(job["progress"]["step"]) == 240
    reasons = " | ".join(e["reason"] for e in job["events"])
    # The retry reason names the failed rank(s): usually "rank 1 ...: killed by signal 9", or rank
    # 0's communication error when the agent reaped that one first; the log always has the kill.
    retry = [e["reason"] for e in job["events"] if e["state"] == "retrying"]
    assert len(retry) == 1 and retry[0].startswith("rank "), retry
    assert "resuming from step" in reasons, reasons
    _, _, log = api.request("GET", f"/v1/jobs/{job_id}/logs")
    assert "rank 1 killed by signal 9" in log, log[-3000:]
    assert "resume: " in log and "attempt 2" in log, log[-3000:]
    steps = [int(x.rsplit(".", 1)[1]) for x in job["checkpoints"]]
    assert steps[-1] == 240, steps
    # keep_last 2: the catalogue keeps every entry and says which are still on disk.
    cat = api.ok("GET", f"/v1/checkpoints?job={job_id}")["checkpoints"]
    assert [x["available"] for x in cat][-2:] == [True, True] and not cat[0]["available"], cat
    body = micro(5)
    body["init_from"] = cat[0]["id"]
    status, parsed, _ = api.request("POST", "/v1/jobs", body)
    assert status == 400 and "no longer on disk" in parsed["error"]["message"], parsed
    print(f"ok: kill -9 of rank 1 -> restarted from a checkpoint, finished at step 240 ({job_id})")


def test_kill_worker(c):
    api = c.api
    job_id = submit(api, micro(240, world=1))
    job = wait_checkpoint(api, job_id, 20)
    victim_id = job["placement"][0]["worker_id"]
    names = {w["id"]: name for name, w in c.worker_ids().items()}
    victim = names[victim_id]
    c.workers[victim].kill()
    c.workers[victim].wait()
    job = api.wait(job_id, lambda j: j["state"] in ("succeeded", "failed", "cancelled"), "the end", timeout=180)
    assert job["state"] == "succeeded", job
    reasons = " | ".join(e["reason"] for e in job["events"])
    assert f"worker {victim_id} lost" in reasons, reasons
    last_scheduled = [e["reason"] for e in job["events"] if e["state"] == "scheduled"][-1]
    assert victim_id not in last_scheduled and "resuming from step" in last_scheduled, last_scheduled
    assert c.worker_ids()[victim]["state"] == "lost"
    assert not rank_pids(job_id), "the killed worker's rank survived it"
    # The worker comes back with its old id and is alive again.
    c.start_worker(victim)
    c.wait_workers(2)
    assert c.worker_ids()[victim]["id"] == victim_id
    print(f"ok: kill -9 of worker {victim} -> marked lost, job reran on the other worker ({job_id})")


def test_restart_coordinator(c):
    api = c.api
    job_id = submit(api, micro(240))
    wait_checkpoint(api, job_id, 20)
    before = api.job(job_id)
    catalogue = api.ok("GET", "/v1/checkpoints")["checkpoints"]
    jobs_before = {j["id"]: j["state"] for j in api.ok("GET", "/v1/jobs?page_size=500")["jobs"]}
    c.coordinator.kill()
    c.coordinator.wait()
    time.sleep(0.5)  # the agents notice, keep their ranks running (lease 2 s) and retry
    c.start_coordinator()
    after = api.job(job_id)
    assert after["events"][:len(before["events"])] == before["events"], "events changed across the restart"
    ids_after = {x["id"] for x in api.ok("GET", "/v1/checkpoints")["checkpoints"]}
    assert {x["id"] for x in catalogue} <= ids_after
    jobs_after = {j["id"]: j["state"] for j in api.ok("GET", "/v1/jobs?page_size=500")["jobs"]}
    for jid, state in jobs_before.items():
        if state in ("succeeded", "failed", "cancelled", "queued"):
            assert jobs_after[jid] == state, (jid, state, jobs_after[jid])
    c.wait_workers(2)
    job = api.wait(job_id, lambda j: j["state"] in ("succeeded", "failed", "cancelled"), "the end", timeout=180)
    assert job["state"] == "succeeded" and job["restarts"] == 0 and int(job["progress"]["step"]) == 240, job
    print(f"ok: coordinator kill -9 + restart mid-run: state intact, job completed ({job_id})")


def test_concurrent_submissions(c):
    api = c.api
    threads, per_thread = 8, 25
    results, errors = [], []
    lock = threading.Lock()

    def client(t):
        try:
            for i in range(per_thread):
                body = micro(10, world=1)
                body["pool"] = {"pool": "nowhere"}  # stays queued: this checks acceptance only
                body["request_id"] = f"client-{t}-{i}"
                status, parsed, text = api.request("POST", "/v1/jobs", body)
                with lock:
                    results.append((t, i, status, parsed))
                if i == 0:  # a client retry of the same request: the same job, not a new one
                    status2, parsed2, _ = api.request("POST", "/v1/jobs", body)
                    assert status2 == 200 and parsed2 == {"id": parsed["id"], "created": False}, parsed2
        except Exception as e:  # noqa: BLE001
            with lock:
                errors.append(repr(e))

    ts = [threading.Thread(target=client, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert not errors, errors
    assert len(results) == threads * per_thread
    assert all(r[2] == 201 and r[3]["created"] for r in results), [r for r in results if r[2] != 201][:3]
    ids = [r[3]["id"] for r in results]
    assert len(set(ids)) == len(ids) == 200
    listed, token = [], ""
    while True:
        page = api.ok("GET", "/v1/jobs?state=queued&page_size=64" + (f"&page_token={token}" if token else ""))
        listed += [j["id"] for j in page["jobs"] if j["request"].get("request_id", "").startswith("client-")]
        token = page["next_page_token"]
        if not token:
            break
    assert sorted(listed) == sorted(ids), (len(listed), len(ids))
    job = api.job(ids[0])
    assert "no live worker matches pool {pool=nowhere}" in job["reason"], job["reason"]
    for jid in ids:
        api.ok("POST", f"/v1/jobs/{jid}/cancel")
    print("ok: 200 concurrent submissions from 8 clients, each accepted once, ids unique")


def test_idempotency_keys(c):
    """request_id is scoped per user: a replay returns the same job, a replay with another request
    is a 409 naming the job, and another user's identical key is another request."""
    api = c.api
    body = micro(10, world=1)
    body["pool"] = {"pool": "nowhere"}  # stays queued
    body["request_id"] = "idem-1"
    s1, p1, t1 = api.request("POST", "/v1/jobs", body)
    assert s1 == 201 and p1["created"], t1
    s2, p2, t2 = api.request("POST", "/v1/jobs", body)
    assert s2 == 200 and p2 == {"id": p1["id"], "created": False}, t2
    changed = json.loads(json.dumps(body))
    changed["priority"] = 5
    s3, p3, t3 = api.request("POST", "/v1/jobs", changed)
    assert s3 == 409 and p3["error"]["status"] == "ALREADY_EXISTS" and p1["id"] in p3["error"]["message"], t3
    fields = [v["field"] for d in p3["error"]["details"] for v in d.get("fieldViolations", [])]
    assert fields == ["request_id"], p3
    s4, p4, t4 = api.request("POST", "/v1/jobs", body, token=BOB_TOKEN)
    assert s4 == 201 and p4["created"] and p4["id"] != p1["id"], t4
    api.ok("POST", f"/v1/jobs/{p1['id']}/cancel")
    s5, _, t5 = api.request("POST", f"/v1/jobs/{p4['id']}/cancel", token=BOB_TOKEN)
    assert s5 == 200, t5
    print("ok: idempotency keys per user; a replay with another request is 409 ALREADY_EXISTS")


def test_hostile_requests(c):
    api = c.api
    good = micro(10, world=1)

    def with_spec(**kw):
        b = json.loads(json.dumps(good))
        b["spec"].update(kw)
        return b

    cases = [
        ("bad JSON", "POST", "/v1/jobs", {"raw": b"{not json"}, 400, "request body"),
        ("JSON array", "POST", "/v1/jobs", {"raw": b"[1,2,3]"}, 400, "request body"),
        ("empty body", "POST", "/v1/jobs", {"raw": b""}, 400, "request body"),
        ("unknown field", "POST", "/v1/jobs", {"body": {**good, "colour": "red"}}, 400, "colour"),
        ("unknown spec field", "POST", "/v1/jobs", {"body": with_spec(learning_rate=1)}, 400, "learning_rate"),
        ("wrong type", "POST", "/v1/jobs", {"body": {**good, "world_size": "two"}}, 400, "world_size"),
        ("wrong nested type", "POST", "/v1/jobs", {"body": with_spec(steps={"a": 1})}, 400, "steps"),
        ("negative world size", "POST", "/v1/jobs", {"body": {**good, "world_size": -3}}, 400, "world_size"),
        ("priority out of range", "POST", "/v1/jobs", {"body": {**good, "priority": 10**6}}, 400, "priority"),
        ("int32 overflow", "POST", "/v1/jobs", {"body": {**good, "world_size": 2**40}}, 400, "world_size"),
        ("invalid model", "POST", "/v1/jobs", {"body": with_spec(model={"n_heads": 3})}, 400, "spec.model"),
        ("missing spec", "POST", "/v1/jobs", {"body": {"world_size": 1}}, 400, "spec"),
        ("traversal checkpoint dir", "POST", "/v1/jobs",
         {"body": with_spec(checkpoint={"dir": "../../../etc", "interval": 5})}, 400, "spec.checkpoint.dir"),
        ("absolute data path", "POST", "/v1/jobs",
         {"body": with_spec(data={"source": "shards", "path": "/etc"})}, 400, "spec.data.path"),
        ("metrics file", "POST", "/v1/jobs", {"body": with_spec(metrics={"jsonl": "/tmp/x"})}, 400,
         "spec.metrics.jsonl"),
        ("unknown init_from", "POST", "/v1/jobs", {"body": {**good, "init_from": "job-424242/1"}}, 400, "init_from"),
        ("bad request id", "POST", "/v1/jobs", {"body": {**good, "request_id": "a b\nc"}}, 400, "request_id"),
        ("bad pool label", "POST", "/v1/jobs", {"body": {**good, "pool": {"k": "v v"}}}, 400, "pool"),
        ("huge body", "POST", "/v1/jobs", {"raw": b'{"spec": {"name": "' + b"x" * 400000 + b'"}}'}, 413, "too large"),
        ("wrong content type", "POST", "/v1/jobs", {"raw": json.dumps(good).encode(),
                                                    "headers": {"Content-Type": "text/plain"}}, 415, "Content-Type"),
        ("missing token", "GET", "/v1/jobs", {"token": None}, 401, "bearer"),
        ("wrong token", "GET", "/v1/jobs", {"token": "x" * 30}, 401, "invalid token"),
        ("basic auth", "GET", "/v1/jobs", {"token": None, "headers": {"Authorization": "Basic YTpi"}}, 401, "bearer"),
        ("worker token on a user route", "GET", "/v1/jobs", {"token": WORKER_TOKEN}, 403, "user token"),
        # Agent routes live on the agent listener only.
        ("agent route on the user listener", "POST", "/v1/agent/heartbeat",
         {"body": {"worker_id": "w-1"}, "token": USER_TOKEN}, 404, "no route"),
        ("registration on the user listener", "POST", "/v1/agent/register",
         {"body": {"address": "127.0.0.1", "slots": 1}, "token": WORKER_TOKEN}, 404, "no route"),
        # httplib decodes %2F before routing: the path no longer matches a route.
        ("traversal job id", "GET", "/v1/jobs/..%2F..%2Fetc%2Fpasswd", {}, 404, "no route"),
        ("dot-dot job id", "GET", "/v1/jobs/..", {}, 400, "malformed"),
        ("traversal cancel", "POST", "/v1/jobs/%2E%2E/cancel", {}, 400, "malformed"),
        ("upper-case job id", "GET", "/v1/jobs/JOB-1", {}, 400, "malformed"),
        ("overlong job id", "GET", "/v1/jobs/" + "a" * 500, {}, 400, "malformed"),
        ("unknown job", "GET", "/v1/jobs/job-999999", {}, 404, "not found"),
        ("unknown route", "GET", "/v1/secrets", {}, 404, "no route"),
        ("wrong method", "DELETE", "/v1/jobs/job-000001", {}, 404, "no route"),
        ("bad state filter", "GET", "/v1/jobs?state=exploded", {}, 400, "state"),
        ("bad page size", "GET", "/v1/jobs?page_size=0", {}, 400, "page_size"),
        ("non-numeric page size", "GET", "/v1/jobs?page_size=1e9", {}, 400, "page_size"),
        ("unknown query parameter", "GET", "/v1/jobs?sort=desc", {}, 400, "sort"),
        ("repeated query parameter", "GET", "/v1/jobs?state=queued&state=running", {}, 400, "more than once"),
        ("bad log offset", "GET", "/v1/jobs/job-000001/logs?offset=-5", {}, 400, "offset"),
        ("bad follow", "GET", "/v1/jobs/job-000001/logs?follow=maybe", {}, 400, "follow"),
        ("traversal checkpoint filter", "GET", "/v1/checkpoints?job=../x", {}, 400, "job"),
    ]
    for name, method, path, kw, want, needle in cases:
        raw = kw.get("raw")
        target = api
        status, parsed, text = target.request(method, path, body=kw.get("body"), raw=raw,
                                              token=kw.get("token", USER_TOKEN), headers=kw.get("headers"))
        want = want if isinstance(want, tuple) else (want,)
        assert status in want, f"{name}: HTTP {status}, wanted {want}: {text[:300]}"
        assert parsed is not None and "error" in parsed, f"{name}: not a JSON error: {text[:300]}"
        assert needle.lower() in parsed["error"]["message"].lower(), f"{name}: '{needle}' not in '{parsed['error']}'"
    # The agent port (gRPC): the enrolment token only registers, heartbeats need the worker's own
    # credential, user tokens are refused there, and registrations are validated.
    live_worker = next(iter(c.worker_ids().values()))["id"]
    agent_cases = [
        ("user token on a heartbeat", "heartbeat", {"worker_id": "w-1"}, USER_TOKEN,
         ("UNAUTHENTICATED", "PERMISSION_DENIED"), "user token"),
        ("user token on a registration", "register", {"address": "127.0.0.1", "slots": 1}, USER_TOKEN,
         ("UNAUTHENTICATED", "PERMISSION_DENIED"), "user token"),
        ("heartbeat from an unknown worker", "heartbeat", {"worker_id": "w-deadbeef"}, WORKER_TOKEN,
         "PERMISSION_DENIED", "credential"),
        ("heartbeat of a live worker with the enrolment token", "heartbeat", {"worker_id": live_worker},
         WORKER_TOKEN, "PERMISSION_DENIED", "credential"),
        ("register with no slots", "register", {"address": "127.0.0.1", "slots": 0}, WORKER_TOKEN,
         "INVALID_ARGUMENT", "slots"),
        ("register with a traversal id", "register", {"worker_id": "../../x", "address": "h", "slots": 1},
         WORKER_TOKEN, "INVALID_ARGUMENT", "worker_id"),
    ]
    for name, call, body, token, want, needle in agent_cases:
        agent_refusal(name, getattr(c.agent, call)(body, token), want, needle)
    assert c.coordinator.poll() is None, "the coordinator died"
    c.wait_workers(2)  # the hostile agent requests changed nothing for the real agents
    status, _, text = api.request("GET", "/healthz", token=None)
    assert status == 200 and text.strip() == "ok"
    # Nothing hostile was stored as a job.
    jobs = api.ok("GET", "/v1/jobs?page_size=500")["jobs"]
    assert not any(j["name"].startswith("xxxx") for j in jobs)
    # The metrics endpoint counts them and is valid exposition text.
    status, _, metrics = api.request("GET", "/metrics", token=None)
    assert status == 200 and 'loom_coordinator_http_requests_total{code="400",route="/v1/jobs"}' in metrics \
        or 'loom_coordinator_http_requests_total{route="/v1/jobs",code="400"}' in metrics, metrics[:2000]
    print(f"ok: {len(cases)} malformed or hostile requests answered with clean 4xx, {len(agent_cases)} agent "
          "calls refused with their gRPC code and reason; server up")


def test_openapi(c, args):
    spec_path = os.path.join(args.source_dir, "api", "openapi.yaml")
    redocly_lint(args.source_dir, spec_path)
    import yaml
    with open(spec_path) as f:
        doc = yaml.safe_load(f)
    api = c.api
    job_id = api.ok("GET", "/v1/jobs?page_size=1")["jobs"][0]["id"]
    # The agent port is gRPC (not in the document): a probe worker registers with the enrolment
    # token and heartbeats with the credential registration returned.
    code, reg, message = c.agent.register(
        {"address": "127.0.0.1", "slots": 1, "name": "probe", "labels": {"pool": "probe"}}, WORKER_TOKEN)
    assert code == "OK" and reg.get("worker_id") and reg.get("credential"), (code, message)
    code, _, message = c.agent.heartbeat({"worker_id": reg["worker_id"]}, reg["credential"])
    assert code == "OK", (code, message)
    assert not any(p.startswith("/v1/agent/") for p in doc["paths"]), "agent routes are gRPC, not REST"
    probes = 0
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            if method == "parameters":
                continue
            url = path.replace("{id}", job_id)
            body = micro(1, world=1) if method == "post" and path == "/v1/jobs" else None
            status, parsed, text = api.request(method.upper(), url, body=body, token=USER_TOKEN)
            assert not (status == 404 and parsed and parsed.get("error", {}).get("message", "").startswith("no route")), \
                f"documented {method.upper()} {path} is not served: {text}"
            documented = {str(k) for k in op["responses"]}
            assert str(status) in documented, f"{method.upper()} {path}: HTTP {status} not documented ({documented})"
            probes += 1
    print(f"ok: OpenAPI document lint-clean (redocly recommended) and all {probes} documented operations served")


def test_loom_up(args, tmp):
    """`loom up`: a local-mode coordinator and two workers; the CLI submits and follows a job;
    Ctrl-C (SIGINT) stops every process it started."""
    from loom_testlib import free_port
    port = free_port()
    data = os.path.join(tmp, "up")
    # loom up writes its user token to $XDG_CONFIG_HOME/loom/local-<port>.token; the CLI finds it.
    xdg = os.path.join(tmp, "xdg")
    base_env = {**os.environ, "OMP_NUM_THREADS": "1", "XDG_CONFIG_HOME": xdg}
    base_env.pop("LOOM_TOKEN", None)
    up = subprocess.Popen([args.loom, "up", "--workers", "2", "--slots", "1", "--port", str(port),
                           "--data-dir", data], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=base_env)
    PROCS.append(up)
    env = {**base_env, "LOOM_COORDINATOR": f"http://127.0.0.1:{port}"}
    deadline = time.time() + 30
    while True:
        r = subprocess.run([args.loom, "workers", "--json"], env=env, capture_output=True, text=True)
        if r.returncode == 0 and sum(w["state"] == "alive" for w in json.loads(r.stdout).get("workers", [])) == 2:
            break
        assert up.poll() is None and time.time() < deadline, f"loom up did not come up: {r.stderr}"
        time.sleep(0.2)
    job = os.path.join(tmp, "up-job.json")
    body = micro(20, world=2, interval=10)
    del body["pool"]  # loom up's workers carry no labels
    with open(job, "w") as f:
        json.dump(body, f)
    r = subprocess.run([args.loom, "submit", job, "--follow"], env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0 and "succeeded" in r.stdout and "20/20" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([args.loom, "logs", "job-000001"], env=env, capture_output=True, text=True, timeout=60)
    # Both workers' lines (rank 0 on one, rank 1 on the other) arrive whole in the job's log.
    assert "[rank 0] step 20/20" in r.stdout and "rank 1 exited 0" in r.stdout, r.stdout[-2000:]
    assert all(line.startswith(("[rank ", "[agent ")) for line in r.stdout.splitlines()), r.stdout[-2000:]
    up.send_signal(signal.SIGINT)
    out, _ = up.communicate(timeout=30)
    assert up.returncode == 0 and "loom up: stopped" in out, out
    leftovers = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if data.encode() in f.read():
                    leftovers.append(pid)
        except OSError:
            pass
    assert not leftovers, f"processes left after loom up stopped: {leftovers}"
    print("ok: loom up (local coordinator + 2 workers), CLI submit --follow, clean stop")


def test_quota(c):
    """An admin's quota holds alice's third job queued with its reason while bob's runs; `loom admin
    quota` sets, lists and deletes it; a non-admin cannot; the job runs once the quota is gone."""
    api = c.api
    r = c.cli("admin", "quota", "set", "user", "alice", "2", check=False)
    assert r.returncode != 0 and "admins" in r.stderr, (r.returncode, r.stderr)
    r = c.cli("admin", "quota", "set", "user", "alice", "2", token=ROOT_TOKEN)
    assert "user alice: at most 2 slots" in r.stdout, r.stdout
    jobs = [submit(api, micro(100000, world=1, interval=0)) for _ in range(3)]
    for j in jobs[:2]:
        api.wait(j, lambda x: x["state"] == "running", "alice's first two jobs to run")
    third = api.wait(jobs[2], lambda x: x["reason"].startswith("quota:"), "the quota reason")
    assert third["state"] == "queued" and third["reason"] == "quota: alice uses 2 of 2 slots", third
    status, parsed, _ = api.request("POST", "/v1/jobs", micro(100000, world=1, interval=0), token=BOB_TOKEN)
    bobs = parsed["id"]
    api.wait(bobs, lambda x: x["state"] == "running", "bob's job to run beside alice's quota")
    listed = c.cli("admin", "quota", "list").stdout
    assert re.search(r"user\s+alice\s+2/2", listed), listed
    time.sleep(1)
    assert api.job(jobs[2])["state"] == "queued"
    c.cli("admin", "quota", "delete", "user", "alice", token=ROOT_TOKEN)
    api.wait(jobs[2], lambda x: x["state"] == "running", "the third job once the quota is gone")
    for j in jobs + [bobs]:
        api.request("POST", f"/v1/jobs/{j}/cancel", token=ROOT_TOKEN)
    for j in jobs + [bobs]:
        api.wait_end(j)
    print(f"ok: a quota of 2 slots held {jobs[2]} queued with its reason while bob's {bobs} ran; "
          "loom admin quota set/list/delete (admins only)")


def test_links_made_after_submission(c):
    """A path the coordinator accepted is opened by the ranks beneath the storage root
    (loom-train --storage-root, openat2 RESOLVE_BENEATH): a directory swapped for a symlink out
    of the root between submission and start makes the job fail with that reason, and the file
    outside is never read; a link that stays inside is followed."""
    api, root = c.api, c.storage
    conversation = json.dumps({"messages": [{"role": "user", "content": "2+2?"},
                                            {"role": "assistant", "content": "4"}]})
    for d in (os.path.join(root, "data", "chats"), os.path.join(ROOT, "outside")):
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "conv.jsonl"), "w") as f:
            f.write((conversation + "\n") * 64)
    os.symlink("chats", os.path.join(root, "data", "alias"))

    def sft(path):
        body = micro(2, world=1, interval=0, kind="sft", seq_len=64,
                     model={"vocab_size": 260}, data={"source": "chat", "path": path})
        body["pool"] = {"pool": "late"}  # nobody runs it until node-late starts
        body["max_restarts"] = 0
        return submit(api, body)

    swapped, inside = sft("data/chats/conv.jsonl"), sft("data/alias/conv.jsonl")
    os.rename(os.path.join(root, "data", "chats"), os.path.join(root, "data", "chats-moved"))
    os.symlink(os.path.join(ROOT, "outside"), os.path.join(root, "data", "chats"))
    os.remove(os.path.join(root, "data", "alias"))  # the inside link follows the move
    os.symlink("chats-moved", os.path.join(root, "data", "alias"))
    c.start_worker("node-late", labels="pool=late")
    try:
        job = api.wait_end(swapped)
        assert job["state"] == "failed", job
        _, _, log = api.request("GET", f"/v1/jobs/{swapped}/logs")
        assert "leaves the storage root" in log, log[-3000:]
        job = api.wait_end(inside)
        assert job["state"] == "succeeded", (job, api.request("GET", f"/v1/jobs/{inside}/logs")[2][-3000:])
    finally:
        c.workers["node-late"].terminate()
    print(f"ok: a directory swapped for a link out of the root after submission fails {swapped}; "
          f"a link inside is followed ({inside})")


def main():
    ap = control_plane_arg_parser()
    args = ap.parse_args()
    global ROOT
    tmp = ROOT = tempfile.mkdtemp(prefix="loom-control-plane-")
    c = Cluster(args, tmp)
    try:
        c.start_coordinator()
        c.start_worker("node-a")
        c.start_worker("node-b")
        c.wait_workers(2)
        test_hostile_requests(c)
        test_idempotency_keys(c)
        test_submit_run_succeed(c)
        test_eval_job_results_stored_with_the_job(c)
        test_cancel_mid_run(c)
        test_kill_rank(c)
        test_kill_worker(c)
        test_restart_coordinator(c)
        test_concurrent_submissions(c)
        test_quota(c)
        test_links_made_after_submission(c)
        test_openapi(c, args)
        test_loom_up(args, tmp)
    except BaseException:
        c.dump_logs(["coordinator.log", "node-a.log", "node-b.log"])
        raise
    finally:
        stop_all(PROCS, tmp)
    subprocess.run(["rm", "-rf", tmp])
    print("control plane: all checks passed")


if __name__ == "__main__":
    main()

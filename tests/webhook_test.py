#!/usr/bin/env python3
"""Webhooks end to end (docs/control-plane.md, "Webhooks"): a real coordinator and worker, and a
receiver in this process that records every POST. Admin-only routes and their checks (hostile
URLs, unknown events, formats, secrets: 400 naming the field; 403 for a user); `loom admin
webhook add|list|delete`. Jobs run to success and to failure, one is cancelled, a sweep runs to
its end: each event reaches the JSON webhook with a valid HMAC-SHA256 signature, the finished
sweep with its report summary, the Slack webhook with {"text": ...} bodies. Then the receiver
answers 500, the coordinator is killed (-9) with deliveries in its outbox, the receiver comes
back and the coordinator restarts on the same data directory: every event is delivered, under
the id it had before the kill; ids are unique per event, a duplicate only ever repeats one.
Every process is killed on exit."""
import hashlib
import hmac
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loom_testlib import Service, control_plane_arg_parser, stop_all, wait_for  # noqa: E402

PROCS = []
ALICE = "alice-token-0123456789abcdef"
ROOT = "root-token-0123456789abcdef0"
WORKER_TOKEN = "worker-token-0123456789abcdef"
SECRET_A = "a-secret-of-the-json-hook-0123"
TERMINAL = ("succeeded", "failed", "cancelled")


class Receiver:
    """An HTTP server on loopback that records (path, status answered, headers, body) of every
    POST; answers 500 while `failing` is set."""

    def __init__(self):
        self.lock, self.failing, self.log = threading.Lock(), False, []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with receiver.lock:
                    status = 500 if receiver.failing else 200
                    receiver.log.append((self.path, status, dict(self.headers), body))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def entries(self, path=None, status=None):
        with self.lock:
            return [e for e in self.log if (path is None or e[0] == path) and (status is None or e[1] == status)]

    def delivered(self, path):
        """(event id, parsed body) of every 2xx delivery to `path`."""
        return [(h["X-Loom-Event-Id"], json.loads(b)) for _, _, h, b in self.entries(path, 200)]


def micro(steps, **extra):
    spec = {"preset": "micro", "steps": steps, "micro_batch": 4, "seq_len": 32, "threads": 1,
            "data": {"corpus_bytes": 65536}, "eval": {"interval": 5, "batches": 1},
            "checkpoint": {"interval": 0}}
    spec.update(extra)
    return {"spec": spec, "world_size": 1, "max_restarts": 0}


def submit(api, body):
    status, parsed, text = api.request("POST", "/v1/jobs", body)
    assert status == 201, f"submit: HTTP {status}: {text}"
    return parsed["id"]


def cli(svc, *argv, token=ROOT, check=True):
    return svc.cli(*argv, token=token, check=check, timeout=60)


def test_admin_routes(svc, rx):
    """Only admins; every bad field a 400 naming it; the secret shown once. Returns the two
    webhooks' (id, secret)."""
    api = svc.api
    good = {"url": f"http://127.0.0.1:{rx.port}/a", "events": ["job.failed"]}
    status, _, text = api.request("POST", "/v1/admin/webhooks", good, token=ALICE)
    assert status == 403, (status, text)
    assert api.request("GET", "/v1/admin/webhooks", token=ALICE)[0] == 403
    assert api.request("DELETE", "/v1/admin/webhooks/wh-000001", token=ALICE)[0] == 403
    bad = [({"url": "ftp://x/"}, "url"), ({"url": "file:///etc/passwd"}, "url"),
           ({"url": "http://"}, "url"), ({"url": "http://a\r\nX-Evil: 1"}, "url"),
           ({"url": "http://x/" + "a" * 3000}, "url"), ({"events": ["job.exploded"]}, "events"),
           ({"events": []}, "events"), ({"events": ["job.failed", "job.failed"]}, "events"),
           ({"format": "xml"}, "format"), ({"secret": "short"}, "secret"),
           ({"secret": "x" * 300}, "secret"), ({"secret": "has a space in it 0123"}, "secret")]
    for change, field in bad:
        status, parsed, text = api.request("POST", "/v1/admin/webhooks", {**good, **change}, token=ROOT)
        assert status == 400 and field in parsed["error"]["message"], (change, status, text)
    status, _, text = api.request("POST", "/v1/admin/webhooks", {**good, "nope": 1}, token=ROOT)
    assert status == 400, (status, text)
    status, _, _ = api.request("POST", "/v1/admin/webhooks", raw="{", token=ROOT)
    assert status == 400
    # The JSON hook through the CLI (a given secret), the Slack one through REST (generated).
    r = cli(svc, "admin", "webhook", "add", f"http://127.0.0.1:{rx.port}/a", "--events",
            "job.running,job.retrying,job.succeeded,job.failed,job.cancelled,sweep.finished,sweep.cancelled",
            "--secret", SECRET_A)
    assert "wh-000001" in r.stdout and SECRET_A in r.stdout, r.stdout
    status, slack, text = api.request("POST", "/v1/admin/webhooks", {
        "url": f"http://127.0.0.1:{rx.port}/b", "events": ["job.succeeded", "sweep.finished"],
        "format": "slack"}, token=ROOT)
    assert status == 201 and slack["id"] == "wh-000002" and len(slack["secret"]) == 64, text
    extra = json.loads(cli(svc, "-o", "json", "admin", "webhook", "add", "https://example.invalid/x",
                           "--events", "job.failed").stdout)
    listed = api.ok("GET", "/v1/admin/webhooks", token=ROOT)["webhooks"]
    assert [w["id"] for w in listed] == ["wh-000001", "wh-000002", extra["id"]], listed
    assert all(not w.get("secret") for w in listed), "secrets are shown once"
    cli(svc, "admin", "webhook", "delete", extra["id"])
    assert extra["id"] not in cli(svc, "admin", "webhook", "list").stdout
    assert api.request("DELETE", f"/v1/admin/webhooks/{extra['id']}", token=ROOT)[0] == 404
    r = cli(svc, "admin", "webhook", "list", token=ALICE, check=False)
    assert r.returncode != 0 and "admin" in r.stderr, (r.returncode, r.stderr)
    print("ok: webhook routes admin-only, hostile fields refused naming them, CLI add/list/delete")
    return ("wh-000001", SECRET_A), (slack["id"], slack["secret"])


def failing_job(svc):
    """A job the coordinator accepts and the trainer fails on: a chat file that is not JSON."""
    path = os.path.join(svc.storage, "data", "bad.jsonl")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("this is not a conversation\n" * 8)
    return micro(2, kind="sft", seq_len=64, model={"vocab_size": 260},
                 data={"source": "chat", "path": "data/bad.jsonl"}, eval={"batches": 1})


SWEEP = {"name": "hooks", "base": micro(10), "grid": {"optimizer.lr": [0.001, 0.003]},
         "seeds": [1, 2], "metric": "eval_loss"}


def run_jobs_and_sweep(svc, rx):
    """Returns {job id: terminal state} and the sweep's id."""
    api = svc.api
    ok, bad = submit(api, micro(10)), submit(api, failing_job(svc))
    status, sweep, text = api.request("POST", "/v1/sweeps", SWEEP)
    assert status == 201, text
    ends = {j: api.wait_end(j)["state"] for j in (ok, bad)}
    assert ends == {ok: "succeeded", bad: "failed"}, (ends, api.request("GET", f"/v1/jobs/{bad}/logs")[2][-2000:])
    wait_for("the sweep's end", lambda: api.ok("GET", f"/v1/sweeps/{sweep['id']}")["state"] == "finished", 300, 1)
    for j in api.ok("GET", f"/v1/sweeps/{sweep['id']}")["jobs"]:
        ends[j["job_id"]] = api.job(j["job_id"])["state"]
    return ends, sweep["id"]


def expected_events(ends, sweep_id):
    out = {("sweep.finished", sweep_id)}
    for job, state in ends.items():
        out.add((f"job.{state}", job))
        if state != "cancelled":
            out.add(("job.running", job))
    return out


def events_of(delivered):
    return {(body["type"], (body.get("job") or body.get("sweep"))["id"]) for _, body in delivered}


def check_sweep_report(delivered, sweep_id, api):
    body = next(b for _, b in delivered if b["type"] == "sweep.finished" and b["sweep"]["id"] == sweep_id)
    report = api.ok("GET", f"/v1/sweeps/{sweep_id}/report")
    summary = body["report"]
    assert summary and len(summary["cells"]) == 2 and len(summary["differences"]) == 1, body
    for got, want in zip(summary["cells"], report["cells"]):
        assert got["cell"] == want["cell"] and got["n"] == want["n"] == 2, (got, want)
        assert abs(got["mean"] - want["mean"]) < 1e-9 and abs(got["ci_low"] - want["ci_low"]) < 1e-9
    d, want = summary["differences"][0], report["differences"][0]
    assert d["n"] == 2 and abs(d["mean"] - want["mean"]) < 1e-9 and abs(d["ci_high"] - want["t_high"]) < 1e-9
    assert body["sweep"]["job_states"] == {"succeeded": 4}, body["sweep"]


def check_deliveries(rx, hooks):
    """Signatures valid; one id per event; a duplicate (at least once) repeats one exactly."""
    (a_id, a_secret), (b_id, b_secret) = hooks
    by_id = {}
    for path, status, headers, body in rx.entries():
        secret, hook = (a_secret, a_id) if path == "/a" else (b_secret, b_id)
        want = "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
        assert hmac.compare_digest(headers["X-Loom-Signature"], want), (path, headers)
        assert headers["X-Loom-Webhook-Id"] == hook and headers["Content-Type"] == "application/json"
        key = (path, headers["X-Loom-Event-Id"])
        assert by_id.setdefault(key, body) == body, f"{key}: two different bodies under one id"
        if path == "/a":
            parsed = json.loads(body)
            assert parsed["id"] == headers["X-Loom-Event-Id"] and parsed["type"] == headers["X-Loom-Event"]
        else:
            parsed = json.loads(body)
            assert list(parsed) == ["text"] and parsed["text"].startswith("Loom "), parsed
    events = {}
    for (path, eid), body in by_id.items():
        if path == "/a":
            b = json.loads(body)
            event = (b["type"], (b.get("job") or b.get("sweep"))["id"])
            assert events.setdefault(event, eid) == eid, f"{event} delivered under two ids"
    assert len(set(events.values())) == len(events), "an id shared by two events"
    return len(by_id)


def test_delivered(svc, rx, hooks):
    api = svc.api
    ends, sweep_id = run_jobs_and_sweep(svc, rx)
    want = expected_events(ends, sweep_id)
    wait_for("every event at the JSON hook", lambda: want <= events_of(rx.delivered("/a")), 60)
    delivered = rx.delivered("/a")
    check_sweep_report(delivered, sweep_id, api)
    slack_want = {("job", j) for j, s in ends.items() if s == "succeeded"}
    texts = wait_for("the Slack hook's deliveries", lambda: (lambda t: len(t) >= len(slack_want) + 1 and t)(
        [json.loads(b)["text"] for _, _, _, b in rx.entries("/b", 200)]), 60)
    assert any(f"sweep {sweep_id}" in t and "finished" in t and " - " in t for t in texts), texts
    assert all(any(j in t for t in texts) for _, j in slack_want), (slack_want, texts)
    assert not any("failed" in t and "job" in t for t in texts), "the Slack hook is not subscribed to job.failed"
    print(f"ok: {len(want)} events delivered signed to the JSON hook (the sweep with its report), "
          f"{len(texts)} Slack texts")
    return ends, sweep_id


def test_kill_with_pending_deliveries(svc, rx, hooks):
    """The receiver fails; a job runs to success and one is cancelled meanwhile; the coordinator
    is killed -9 with their deliveries in its outbox, restarted, and delivers them, same ids."""
    api = svc.api
    rx.failing = True
    cancelled = submit(api, micro(100000))
    api.wait(cancelled, lambda j: j["state"] == "running", "running")
    api.ok("POST", f"/v1/jobs/{cancelled}/cancel")
    ok = submit(api, micro(10))
    assert api.wait_end(ok)["state"] == "succeeded"
    want = {("job.running", cancelled), ("job.cancelled", cancelled), ("job.running", ok),
            ("job.succeeded", ok)}

    def failed_ids():
        out = {}
        for _, _, headers, body in rx.entries("/a", 500):  # 500s come from this phase only
            b = json.loads(body)
            out[(b["type"], b["job"]["id"])] = headers["X-Loom-Event-Id"]
        return out

    wait_for("a failed try of every new event", lambda: want <= set(failed_ids()), 60)
    attempts = failed_ids()
    metrics = api.request("GET", "/metrics")[2]
    assert 'loom_coordinator_webhook_deliveries_total{result="failed"}' in metrics
    gauge = [ln for ln in metrics.splitlines() if ln.startswith("loom_coordinator_webhook_outbox ")]
    assert gauge and float(gauge[0].split()[1]) >= len(want), gauge
    svc.coordinator.send_signal(signal.SIGKILL)
    svc.coordinator.wait(timeout=30)
    rx.failing = False
    svc.start_coordinator(svc.port, svc.agent_port, tries=20)
    wait_for("the outbox delivered after the restart", lambda: want <= events_of(rx.delivered("/a")), 60)
    for eid, body in rx.delivered("/a"):
        event = (body["type"], (body.get("job") or body.get("sweep"))["id"])
        if event in attempts:
            assert attempts[event] == eid, f"{event}: {eid} after the restart, {attempts[event]} before"
    wait_for("an empty outbox", lambda: any(ln == "loom_coordinator_webhook_outbox 0" for ln in
                                            api.request("GET", "/metrics")[2].splitlines()), 30)
    print(f"ok: kill -9 with {len(want)} events pending (receiver answering 500): all delivered after "
          "the restart under their first ids")


def main():
    args = control_plane_arg_parser().parse_args()
    tmp = tempfile.mkdtemp(prefix="loom-webhook-")
    rx = Receiver()
    svc = Service(args, tmp, {"alice": ALICE, "root": ROOT}, WORKER_TOKEN,
                  ["--heartbeat-ms", "200", "--lost-after-ms", "4000", "--webhook-retry-base-ms", "200",
                   "--webhook-retry-max-ms", "1000"], PROCS, admins=("root",))
    try:
        svc.start_coordinator()
        svc.start_worker("node-a", slots=2)
        svc.wait_alive(["node-a"])
        hooks = test_admin_routes(svc, rx)
        test_delivered(svc, rx, hooks)
        test_kill_with_pending_deliveries(svc, rx, hooks)
        n = check_deliveries(rx, hooks)
        print(f"ok: {n} (webhook, event id) pairs: signatures valid, one id per event, duplicates identical")
    except BaseException:
        svc.dump_logs()
        raise
    finally:
        stop_all(PROCS, tmp)
        rx.server.shutdown()
    subprocess.run(["rm", "-rf", tmp])
    print("webhooks: all checks passed")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Slow clients against both ports of a real coordinator while a real job runs.

For 60 s, 256 connections from one address (127.0.0.2: any 127.x address is this host's
loopback) attack each port. On the user port (HTTP/1.1) a third send their request head one byte
every 2 s, a third send a head (with a valid token) and then the body one byte every 2 s, a third
pipeline requests and never read the answers. On the agent port (gRPC, HTTP/2) a third trickle
the connection preface, a third send it and then trickle a HEADERS frame, a third send it and
never read what the server sends. Each closed connection is replaced at once. Meanwhile the worker agent
(at 127.0.0.1) heartbeats, and every second a fresh user request from 127.0.0.1 must be
answered within 1 s. Afterwards: no worker was ever marked lost, the job kept its single attempt
and succeeded, the coordinator's RSS stayed within 64 MiB of its start, and its /metrics counted
what the connection caps did: the attack's connections beyond the address's 16 places evicted or
expired, none refused at the global cap, none left waiting once the attack stopped. Last, SIGTERM stops
the coordinator within 5 s while a ?follow=true log stream is open.
"""
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loom_testlib import (Api, Service, control_plane_arg_parser, metric_family, proc_status_kib,  # noqa: E402
                         stop_all, wait_for)

PROCS = []
ALICE = "alice-token-0123456789abcdef"
ENROLMENT_TOKEN = "enrolment-token-0123456789abcdef"
ATTACKER = "127.0.0.2"
CONNECTIONS = 256
ATTACK_S = 60


def connection_metrics(port):
    """The user port's connection-cap metrics: loom_coordinator_http_connections_* -> value."""
    status, _, text = Api(port, ALICE).request("GET", "/metrics", token=None, timeout=5)
    assert status == 200, f"/metrics: HTTP {status}"
    return metric_family(text, "loom_coordinator_http_connections_")


class Attacker:
    """CONNECTIONS slow clients from ATTACKER against one port, kept open for `seconds`."""

    def __init__(self, port, path, seconds, h2=False):
        self.port, self.path, self.seconds, self.h2 = port, path, seconds, h2
        self.conns = []
        self.opened = self.closed_by_server = self.refused = 0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def head(self, body_length=None):
        lines = [f"POST {self.path} HTTP/1.1", f"Host: 127.0.0.1:{self.port}",
                 f"Authorization: Bearer {ALICE}", "Content-Type: application/json"]
        if body_length is not None:
            lines.append(f"Content-Length: {body_length}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

    def open(self, i):
        s = socket.socket()
        s.bind((ATTACKER, 0))
        s.setblocking(False)
        try:
            s.connect((("127.0.0.1", self.port)))
        except BlockingIOError:
            pass
        except OSError:
            self.refused += 1
            s.close()
            return None
        self.opened += 1
        kind = i % 3
        if self.h2:
            preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # + SETTINGS
            headers = bytes([0, 0x40, 0, 1, 4, 0, 0, 0, 1]) + b"x" * 16384  # a 16 KiB HEADERS frame
            payload = [preface, preface + headers, preface][kind]
            return {"sock": s, "kind": kind, "payload": payload, "sent": 0, "i": i,
                    "burst": [0, len(preface), len(preface)][kind]}
        if kind == 0:  # slow head
            payload = self.head(2)[:-2]
        elif kind == 1:  # head at once, then a slow body
            payload = self.head(100000)
        else:  # pipelined requests, answers never read
            payload = (f"GET /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
                       f"Authorization: Bearer {ALICE}\r\n\r\n").encode() * 64
        return {"sock": s, "kind": kind, "payload": payload, "sent": 0, "i": i,
                "burst": [0, len(self.head(100000)), len(payload)][kind]}

    def run(self):
        end = time.monotonic() + self.seconds
        self.conns = [c for c in (self.open(i) for i in range(CONNECTIONS)) if c]
        next_i = CONNECTIONS
        while time.monotonic() < end:
            for c in list(self.conns):
                # The burst at once, then one byte per round (nothing more from slow readers).
                if c["kind"] == 2 and c["sent"] >= c["burst"]:
                    continue
                step = c["burst"] - c["sent"] if c["sent"] < c["burst"] else 1
                chunk = c["payload"][c["sent"]:c["sent"] + step] or b"x"
                try:
                    c["sent"] += c["sock"].send(chunk)
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError:
                    self.replace(c, next_i)
                    next_i += 1
            # Closed by the server: readable with EOF, or, for slow readers (never read), a hang-up.
            poll = select.poll()
            for c in self.conns:
                poll.register(c["sock"], select.POLLRDHUP if c["kind"] == 2 else select.POLLIN)
            ready = {fd for fd, _ in poll.poll(0)}
            for c in [c for c in self.conns if c["sock"].fileno() in ready]:
                if c["kind"] == 2:
                    self.replace(c, next_i)
                    next_i += 1
                    continue
                try:
                    data = c["sock"].recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data:
                    self.replace(c, next_i)
                    next_i += 1
            time.sleep(2.0)
        for c in self.conns:
            c["sock"].close()

    def replace(self, c, i):
        self.closed_by_server += 1
        c["sock"].close()
        self.conns.remove(c)
        fresh = self.open(i)
        if fresh:
            self.conns.append(fresh)


def main():
    args = control_plane_arg_parser().parse_args()
    tmp = os.path.realpath(tempfile.mkdtemp(prefix="loom-slowloris-"))
    s = Service(args, tmp, {"alice": ALICE}, ENROLMENT_TOKEN,
                ["--heartbeat-ms", "500", "--lost-after-ms", "4000", "--term-grace-ms", "1000"], PROCS)
    try:
        s.start_coordinator()
        s.start_worker("w1", slots=2)
        s.wait_alive(["w1"])
        api = s.api
        spec = {"preset": "micro", "steps": 40, "micro_batch": 4, "seq_len": 32, "threads": 1,
                "data": {"corpus_bytes": 65536}, "eval": {"batches": 1},
                "checkpoint": {"interval": 200, "keep_last": 2}, "metrics": {"log_every": 10}}

        def submit(steps):
            body = {"spec": dict(spec, steps=steps), "world_size": 1, "pool": {"pool": "cpu"}}
            return api.ok("POST", "/v1/jobs", body)["id"]
        # Calibration: how fast this machine runs the job, so the real one outlasts the attack.
        calib = submit(300)
        first = api.wait(calib, lambda j: int(j.get("progress", {}).get("step", 0)) >= 20, "calibration steps")
        t, step = time.monotonic(), int(first["progress"]["step"])
        done = api.wait_end_progressing(calib)
        assert done["state"] == "succeeded", done
        rate = (300 - step) / max(0.1, time.monotonic() - t)
        steps = max(400, int(rate * (ATTACK_S + 30)))
        job = submit(steps)
        api.wait(job, lambda j: j["state"] == "running" and int(j["progress"].get("step", 0)) > 5,
                 "the job to run", timeout=120)
        rss_start = proc_status_kib(s.coordinator.pid, "VmRSS")
        attackers = [Attacker(s.port, "/v1/jobs", ATTACK_S), Attacker(s.agent_port, "agent", ATTACK_S, h2=True)]
        for a in attackers:
            a.thread.start()
        slowest, lost_seen, rss_peak = 0.0, [], rss_start
        end = time.monotonic() + ATTACK_S
        while time.monotonic() < end:
            t = time.monotonic()
            status, parsed, text = Api(s.port, ALICE).request("GET", "/v1/jobs?page_size=5", timeout=5)
            took = time.monotonic() - t
            slowest = max(slowest, took)
            assert status == 200, f"a user request during the attack: HTTP {status}: {text[:300]}"
            assert took < 1.0, f"a user request from another address took {took:.2f} s during the attack"
            lost_seen += [w["name"] for w in api.workers() if w["state"] != "alive"]
            rss_peak = max(rss_peak, proc_status_kib(s.coordinator.pid, "VmRSS"))
            time.sleep(max(0.0, 1.0 - (time.monotonic() - t)))
        for a in attackers:
            a.thread.join(timeout=30)
        running_at_end = api.job(job)["state"] == "running"
        assert not lost_seen, f"workers marked lost during the attack: {sorted(set(lost_seen))}"
        grew = (rss_peak - rss_start) / 1024
        assert grew < 64, f"coordinator RSS grew {grew:.1f} MiB during the attack"
        j = api.wait_end_progressing(job)
        assert j["state"] == "succeeded" and j["restarts"] == 0, f"the job under attack: {j}"
        def settled():
            m = connection_metrics(s.port)
            return m if m.get("waiting") == 0 else None
        caps = wait_for("no connection left waiting after the attack", settled, timeout=20)
        assert caps["evicted_total"] + caps["expired_total"] >= CONNECTIONS - 16, caps
        assert caps["refused_total"] == 0, caps
        opened = {a.path: (a.opened, a.closed_by_server) for a in attackers}
        print(f"ok: {CONNECTIONS} slow connections per listener from {ATTACKER} for {ATTACK_S} s "
              f"(opened, closed by the server: {opened}); user requests from 127.0.0.1 answered within "
              f"{slowest:.3f} s; no worker lost; the job ({steps} steps, running at the attack's end: "
              f"{running_at_end}) succeeded on its single attempt; "
              f"coordinator RSS +{grew:.1f} MiB; connection caps {caps}")

        # SIGTERM with a log stream open on a running job: the coordinator stops anyway.
        job2 = submit(100000)
        api.wait(job2, lambda j: j["state"] == "running", "the second job to run", timeout=60)
        follow = socket.create_connection(("127.0.0.1", s.port), timeout=10)
        follow.sendall((f"GET /v1/jobs/{job2}/logs?follow=true HTTP/1.1\r\nHost: 127.0.0.1:{s.port}\r\n"
                        f"Authorization: Bearer {ALICE}\r\n\r\n").encode())
        assert follow.recv(4096).startswith(b"HTTP/1.1 200"), "no log stream"
        t = time.monotonic()
        s.coordinator.send_signal(signal.SIGTERM)
        s.coordinator.wait(timeout=15)
        took = time.monotonic() - t
        follow.close()
        assert took < 5.0, f"SIGTERM took {took:.1f} s with a log stream open"
        print(f"ok: SIGTERM stopped the coordinator in {took:.2f} s "
              "with a ?follow=true stream open")
    except BaseException:
        s.dump_logs()
        raise
    finally:
        stop_all(PROCS, tmp)
    subprocess.run(["rm", "-rf", tmp])


if __name__ == "__main__":
    main()

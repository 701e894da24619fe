#!/usr/bin/env python3
"""Fault matrix of the control plane with real processes on loopback: loom-coordinator (user and
agent listeners, RocksDB on disk), worker agents reaching the agent listener through small TCP
proxies of this test (so a network partition can be made), real loom-train ranks.

A sampler thread reads the process table every 0.5 s and records, per job, which attempts
(LOOM_ATTEMPT) have live loom-train processes; no job may ever have two attempts alive in one
sample (fencing: lease on the ranks, lost-after + term-grace before a new placement).

Cases: (a) SIGSTOP of the agent of a running job for 15 s; (b) a 12 s network partition of an
agent that keeps running; (c) flipped bytes in the newest checkpoint, then kill -9 of the rank:
resume skips it (event, catalogue "damaged") and the final weights equal an uninterrupted
reference run's; (d) the newest step directory deleted, then kill -9: same; (e) retention of a
parent racing a queued fine-tune that pins one of its checkpoints; (f) kill -9 of the rank, then
of its agent, then of the coordinator, in one run: final weights equal the reference's; (g) a
coordinator restart while a job is scheduled but not launched: one attempt, each rank started
once; (h) a job that checkpoints by wall-clock time only (checkpoint.interval_seconds, no step
interval) and whose agent is SIGSTOPped: the new attempt resumes from a timed checkpoint and the
final weights equal the reference's. Every process is killed on exit.
"""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loom_testlib import (Service, control_plane_arg_parser, loom_trainers, proc_state,  # noqa: E402
                          stop_all, verify_checkpoint,
                          final_tensors, wait_for)

PROCS = []
USERS = {"alice": "alice-token-0123456789abcdef"}
ENROLMENT_TOKEN = "enrolment-token-0123456789abcdef"
HEARTBEAT_MS, LOST_AFTER_MS, TERM_GRACE_MS = 250, 4000, 2000
LEASE_MS = LOST_AFTER_MS // 2
# The faults, not the training, are under test: a one-layer d_model 32 model at micro_batch 4 x
# seq_len 32 does a step in a few ms (1 thread), about 1/7 of the micro preset's cost at 8 x 64,
# so the jobs' compute no longer dominates the suite on a 2-core CI machine. STEPS_LONG is sized
# so that a job still runs on the fastest machine when a fault lands: a rank runs on for its
# lease (2 s) after its agent freezes, and that must end well before the last step.
MICRO_BATCH, SEQ_LEN = 4, 32
MODEL = {"d_model": 32, "n_layers": 1, "n_heads": 2}
STEPS_LONG = 4000
STEPS_SHORT = 600


class TcpProxy:
    """Forwards 127.0.0.1:<port> to target() (host, port). partition(): every open connection is
    closed and new ones are accepted but black-holed (nothing forwarded, nothing answered) until
    heal(), which closes them too: what the agent sees of a network partition."""

    def __init__(self, target):
        self.target = target
        self.lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(128)
        self.port = self.lsock.getsockname()[1]
        self.lock = threading.Lock()
        self.pairs = set()
        self.held = []
        self.partitioned = False
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def _accept(self):
        while not self.closed:
            try:
                client, _ = self.lsock.accept()
            except OSError:
                return
            with self.lock:
                if self.partitioned:
                    self.held.append(client)
                    continue
            try:
                upstream = socket.create_connection(self.target(), timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            pair = (client, upstream)
            with self.lock:
                if self.partitioned:
                    self.held.append(client)
                    upstream.close()
                    continue
                self.pairs.add(pair)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst, pair), daemon=True).start()

    def _pump(self, src, dst, pair):
        try:
            while True:
                data = src.recv(65536)
                if not data or self.partitioned:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            self._close(pair)

    def _close(self, pair):
        with self.lock:
            self.pairs.discard(pair)
        for s in pair:
            for op in (lambda: s.shutdown(socket.SHUT_RDWR), s.close):
                try:
                    op()
                except OSError:
                    pass

    def partition(self):
        with self.lock:
            self.partitioned = True
            pairs = list(self.pairs)
        for pair in pairs:
            self._close(pair)

    def heal(self):
        with self.lock:
            self.partitioned = False
            held, self.held = self.held, []
        for s in held:  # requests that waited in the partition are dropped, not replayed
            try:
                s.close()
            except OSError:
                pass

    def close(self):
        self.closed = True
        self.partition()
        self.heal()
        try:
            self.lsock.close()
        except OSError:
            pass


class Sampler(threading.Thread):
    """Every 0.5 s: per job id, the set of LOOM_ATTEMPT values of live loom-train processes."""

    def __init__(self, root):
        super().__init__(daemon=True)
        self.root = root
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self.seen = {}        # job -> every attempt ever seen alive
        self.violations = {}  # job -> [(time, {attempt: [(rank, pid, state)]})]
        self.samples = 0
        self.errors = []

    def run(self):
        while not self.stop_event.is_set():
            try:
                self.sample()
            except Exception as e:  # noqa: BLE001 - keep sampling; reported by check()
                self.errors.append(repr(e))
            self.stop_event.wait(0.5)

    def sample(self):
        by_job = {}
        for t in loom_trainers(self.root):
            by_job.setdefault(t["job"], {}).setdefault(t["attempt"], []).append((t["rank"], t["pid"], t["state"]))
        now = time.time()
        with self.lock:
            self.samples += 1
            for job, attempts in by_job.items():
                self.seen.setdefault(job, set()).update(attempts)
                if len(attempts) > 1:
                    self.violations.setdefault(job, []).append((now, attempts))

    def attempts_seen(self, job_id):
        with self.lock:
            return set(self.seen.get(job_id, set()))

    def check(self, job_id):
        with self.lock:
            v = list(self.violations.get(job_id, []))
            errors = list(self.errors)
        assert not errors, f"the sampler failed: {errors[:3]}"
        assert self.is_alive(), "the sampler thread died"
        if v:
            t, attempts = v[0]
            raise AssertionError(f"{job_id}: two attempts alive at once in {len(v)} sample(s); first at "
                                 f"{time.strftime('%H:%M:%S', time.localtime(t))}: attempt -> "
                                 f"[(rank, pid, state)]: {attempts}")


def job_body(steps, world=1, interval=20, keep_last=3, pool="cpu", **extra):
    """Preset micro narrowed to MODEL, 1 thread, a small corpus, a checkpoint every `interval`."""
    spec = {"preset": "micro", "model": dict(MODEL), "steps": steps, "micro_batch": MICRO_BATCH,
            "seq_len": SEQ_LEN, "threads": 1,
            "dist_timeout_seconds": 30, "data": {"corpus_bytes": 65536}, "eval": {"batches": 1},
            "checkpoint": {"interval": interval, "keep_last": keep_last}, "metrics": {"log_every": 10}}
    spec.update(extra)
    return {"spec": spec, "world_size": world, "pool": {"pool": pool}}


def submit(api, body):
    status, parsed, text = api.request("POST", "/v1/jobs", body)
    assert status == 201, f"submit: HTTP {status}: {text}"
    return parsed["id"]


def newest_checkpoint(job):
    return max([int(c.rsplit(".", 1)[1]) for c in job.get("checkpoints", [])] or [0])


def reasons(job):
    return [e.get("reason", "") for e in job.get("events", [])]


def committed_steps(root):
    """Steps of the committed checkpoints (a step directory with a manifest) under root."""
    out = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        m = re.fullmatch(r"step-(\d{8})", name)
        if m and os.path.isfile(os.path.join(root, name, "manifest.json")):
            out.append(int(m.group(1)))
    return sorted(out)


def rank_pid(root, job_id, rank=0):
    pids = [t["pid"] for t in loom_trainers(root) if t["job"] == job_id and t["rank"] == rank]
    assert len(pids) == 1, f"{job_id}: rank {rank} processes: {pids}"
    return pids[0]


def resumed_step(job, attempt):
    """The step an attempt's trainer restored ("resumed from step N" event), 0 for "from the
    start", None when there is no such event."""
    for e in job.get("events", []):
        if e.get("attempt") not in (None, attempt):
            continue
        m = re.search(r"resumed from step (\d+)", e.get("reason", ""))
        if m:
            return int(m.group(1))
        if "resumed from the start" in e.get("reason", ""):
            return 0
    return None


def attempt_record(job, attempt):
    return next((h for h in job.get("history", []) if int(h.get("attempt", 0)) == attempt), None)


def assert_same_weights(got, want, what):
    assert set(got) == set(want), f"{what}: tensor names differ: {sorted(set(got) ^ set(want))[:10]}"
    differ = [n for n in sorted(want) if got[n] != want[n]]
    assert not differ, f"{what}: {len(differ)} of {len(want)} tensors differ from the reference, e.g. {differ[:5]}"


class Matrix:
    def __init__(self, args, tmp):
        self.tmp = tmp
        self.s = Service(args, tmp, USERS, ENROLMENT_TOKEN,
                         ["--heartbeat-ms", str(HEARTBEAT_MS), "--lost-after-ms", str(LOST_AFTER_MS),
                          "--term-grace-ms", str(TERM_GRACE_MS)], PROCS)
        self.proxies = {}
        self.sampler = Sampler(tmp)
        self.reference = None  # final tensors of the uninterrupted reference job

    @property
    def api(self):
        return self.s.api

    def start_worker(self, name, labels="pool=cpu"):
        if name not in self.proxies:
            self.proxies[name] = TcpProxy(lambda: ("127.0.0.1", self.s.agent_port))
        return self.s.start_worker(name, labels=labels, coordinator_url=self.proxies[name].url())

    def ensure_workers(self, names=("node-a", "node-b")):
        """Every named agent running and alive (one that exited is noted and started again)."""
        for name in names:
            p = self.s.workers[name]
            if p.poll() is not None:
                print(f"note: agent {name} had exited with status {p.returncode}; starting it again")
                self.start_worker(name)
        self.s.wait_alive(list(names), timeout=40)

    def restart_coordinator(self):
        """kill -9 and a restart on the same user and agent ports (retried while the bind fails;
        after that any ports: the agents' proxies follow the agent port)."""
        port, agent_port = self.s.port, self.s.agent_port
        self.s.coordinator.kill()
        self.s.coordinator.wait()
        try:
            self.s.start_coordinator(port, agent_port, tries=20)
        except AssertionError as e:
            print(f"note: {e}; restarting on new ports")
            self.s.start_coordinator(0, 0)

    def hosting_worker(self, job):
        worker_id = job["placement"][0]["worker_id"]
        return worker_id, self.s.name_of(worker_id)

    def verify_catalogue(self, job_id):
        entries = [x for x in self.api.catalogue(job_id) if x.get("available")]
        assert entries, f"{job_id}: no available checkpoint"
        for x in entries:
            problems = verify_checkpoint(x["path"])
            assert not problems, f"{job_id}: catalogued checkpoint {x['id']} does not verify: {problems}"
        return len(entries)

    # ---------------------------------------------------------------------------------------------

    def run_reference(self):
        job_id = submit(self.api, job_body(STEPS_LONG))
        job = self.api.wait_end(job_id, timeout=240)
        assert job["state"] == "succeeded" and job["attempt"] == 1 and job["restarts"] == 0, job
        assert int(job["progress"]["step"]) == STEPS_LONG, job["progress"]
        self.reference = final_tensors(self.api, job_id, STEPS_LONG)
        self.sampler.check(job_id)
        took = (int(job.get("end_time_ms", 0)) - int(job.get("start_time_ms", 0))) / 1000
        print(f"ok: reference job {job_id}: {STEPS_LONG} steps uninterrupted in {took:.1f} s")

    def running_job(self):
        """A long job once it has a checkpoint at step >= 100: its id, the hosting worker's id and
        name, that worker's agent process and the job's live ranks (all of attempt 1)."""
        job_id = submit(self.api, job_body(STEPS_LONG))
        job = self.api.wait(job_id, lambda j: j["state"] == "running" and newest_checkpoint(j) >= 100,
                            "a checkpoint at step >= 100")
        victim_id, victim = self.hosting_worker(job)
        old = [t for t in loom_trainers(self.tmp) if t["job"] == job_id]
        assert old and all(t["attempt"] == 1 for t in old), old
        return job_id, victim_id, victim, self.s.workers[victim], old

    def case_a_agent_stopped(self):
        api = self.api
        job_id, victim_id, victim, agent, old = self.running_job()
        t0 = time.time()
        os.kill(agent.pid, signal.SIGSTOP)
        try:
            # The ranks stop by themselves once their lease lapses although their agent is frozen.
            wait_for("the frozen agent's ranks to stop themselves (lease)",
                     lambda: all(proc_state(t["pid"]) in (None, "Z", "X") for t in old),
                     timeout=LEASE_MS / 1000 + 4, interval=0.1)
            gone = time.time() - t0
            job = api.wait(job_id, lambda j: j["attempt"] >= 2 and j["state"] == "running",
                           "a new attempt on the other worker", timeout=40)
            time.sleep(max(0.0, t0 + 15 - time.time()))
        finally:
            os.kill(agent.pid, signal.SIGCONT)
        job = api.wait_end(job_id)
        assert job["state"] == "succeeded", job
        assert job["restarts"] == 0 and job.get("infra_restarts", 0) >= 1, \
            (job["restarts"], job.get("infra_restarts"), reasons(job))
        first, second = attempt_record(job, 1), attempt_record(job, 2)
        assert first and victim_id in first["worker_ids"], job.get("history")
        assert second and victim_id not in second["worker_ids"], job.get("history")
        fence = int(second["start_time_ms"]) - t0 * 1000
        assert fence >= LOST_AFTER_MS + TERM_GRACE_MS - 1500, \
            f"attempt 2 placed {fence:.0f} ms after the agent froze (lost-after + term-grace is " \
            f"{LOST_AFTER_MS + TERM_GRACE_MS} ms)"
        self.sampler.check(job_id)
        n = self.verify_catalogue(job_id)
        self.ensure_workers()
        print(f"ok: (a) agent {victim} SIGSTOPped 15 s: its ranks stopped {gone:.1f} s in (lease), attempt 2 "
              f"placed {fence / 1000:.1f} s in, never two attempts alive; {job_id} succeeded; "
              f"{n} available checkpoints verify (CRC-32C)")

    def case_b_partition(self):
        api = self.api
        job_id, victim_id, victim, agent, old = self.running_job()
        t0 = time.time()
        self.proxies[victim].partition()
        try:
            wait_for("the partitioned agent's ranks to stop (lease)",
                     lambda: all(proc_state(t["pid"]) in (None, "Z", "X") for t in old),
                     timeout=LEASE_MS / 1000 + 4, interval=0.1)
            gone = time.time() - t0
            assert agent.poll() is None, "the partitioned agent exited"
            job = api.wait(job_id, lambda j: j["attempt"] >= 2 and j["state"] == "running",
                           "a new attempt on the other worker", timeout=40)
            time.sleep(max(0.0, t0 + 12 - time.time()))
        finally:
            self.proxies[victim].heal()
        job = api.wait_end(job_id)
        assert job["state"] == "succeeded", job
        assert job["restarts"] == 0 and job.get("infra_restarts", 0) >= 1, \
            (job["restarts"], job.get("infra_restarts"), reasons(job))
        second = attempt_record(job, 2)
        assert second and victim_id not in second["worker_ids"], job.get("history")
        self.sampler.check(job_id)
        self.verify_catalogue(job_id)
        self.ensure_workers()
        print(f"ok: (b) agent {victim} partitioned 12 s: its ranks stopped {gone:.1f} s in, the new attempt ran "
              f"elsewhere, never two attempts alive; {job_id} succeeded (restarts 0, infra_restarts "
              f"{job.get('infra_restarts')})")

    def _freeze_after_reported_commit(self, job_id, root, pid, min_steps=2):
        """SIGSTOPs the rank where its newest committed checkpoint is also in the catalogue and
        returns that step. A stop can land between a commit and its event (retention runs in
        between), and a frozen rank never reports it: then the rank runs on briefly and is
        stopped again."""
        def reported(step):
            return any(int(x["step"]) == step for x in self.api.catalogue(job_id))

        for tries in range(1, 41):
            os.kill(pid, signal.SIGSTOP)
            steps = committed_steps(root)
            assert len(steps) >= min_steps, f"{root}: {steps}"
            newest = steps[-1]
            try:
                wait_for(f"step {newest} in the catalogue", lambda: reported(newest),
                         timeout=8 * HEARTBEAT_MS / 1000, interval=0.05)
            except AssertionError:
                os.kill(pid, signal.SIGCONT)
                time.sleep(0.03)
                continue
            if tries > 1:
                print(f"   ({job_id}: stopped {tries} times before its newest commit was reported)")
            return newest
        raise AssertionError(f"{job_id}: no stop of its rank found its newest commit in the catalogue")

    def _damage_then_kill(self, damage, what):
        """Runs a reference-spec job; with its rank frozen, damages the newest committed
        checkpoint (damage(dir)), kills the rank (-9) and follows the job to its end. Returns
        (job, damaged step, catalogue entries of that step seen meanwhile)."""
        api = self.api
        job_id = submit(api, job_body(STEPS_LONG))
        job = api.wait(job_id, lambda j: j["state"] == "running" and newest_checkpoint(j) >= 400,
                       "a checkpoint at step >= 400")
        root = job["spec"]["checkpoint"]["dir"]
        pid = rank_pid(self.tmp, job_id)
        try:
            newest = self._freeze_after_reported_commit(job_id, root, pid)
            damage(os.path.join(root, f"step-{newest:08d}"))
        finally:
            os.kill(pid, signal.SIGKILL)  # also ends a stopped process
        seen = []
        deadline = time.time() + 240
        while time.time() < deadline:
            job = api.job(job_id)
            seen += [x for x in api.catalogue(job_id) if int(x["step"]) == newest]
            if job["state"] in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(0.15)
        assert job["state"] == "succeeded", f"{what}: {job}"
        assert job["restarts"] == 1 and job["attempt"] == 2, (job["restarts"], job["attempt"], reasons(job))
        resumed = resumed_step(job, 2)
        assert resumed is not None and 0 < resumed < newest, \
            f"{what}: attempt 2 should resume from a checkpoint older than step {newest}: {resumed}; {reasons(job)}"
        assert_same_weights(final_tensors(api, job_id, STEPS_LONG), self.reference, f"{job_id} ({what})")
        self.sampler.check(job_id)
        return job, newest, resumed, seen

    def case_c_flipped_bytes(self):
        def flip(step_dir):
            shard = os.path.join(step_dir, next(f for f in os.listdir(step_dir) if f.startswith("shard-00000-")))
            with open(shard, "r+b") as f:
                f.seek(os.path.getsize(shard) // 2)
                data = f.read(4)
                f.seek(-4, os.SEEK_CUR)
                f.write(bytes(b ^ 0xFF for b in data))
        job, newest, resumed, seen = self._damage_then_kill(flip, "flipped bytes")
        skipped = [r for r in reasons(job) if f"checkpoint at step {newest} skipped" in r]
        assert skipped, f"no 'checkpoint at step {newest} skipped' event: {reasons(job)}"
        damaged = [x.get("damaged") for x in seen + [x for x in self.api.catalogue(job["id"])
                                                     if int(x["step"]) == newest] if x.get("damaged")]
        assert damaged, f"catalogue entry {job['id']}.{newest} never marked damaged: {seen[-3:]}"
        print(f"ok: (c) 4 bytes flipped in {job['id']}.{newest}, rank killed: \"{skipped[0]}\", catalogue "
              f"damaged \"{damaged[0]}\", resumed from step {resumed}, final weights = the reference's")

    def case_d_deleted_dir(self):
        job, newest, resumed, _ = self._damage_then_kill(shutil.rmtree, "deleted step directory")
        print(f"ok: (d) step directory {job['id']}.{newest} deleted, rank killed: resumed from step {resumed}, "
              f"final weights = the reference's")

    def case_e_pinned_by_queued_child(self):
        api = self.api
        parent = submit(api, job_body(STEPS_SHORT, interval=5, keep_last=1))
        job = api.wait(parent, lambda j: j["state"] == "running" and newest_checkpoint(j) >= 5,
                       "a first checkpoint")
        pid = rank_pid(self.tmp, parent)
        try:
            # Frozen (no new commits while the child is submitted) after its newest commit is
            # reported: retention may already have deleted the one before it.
            self._freeze_after_reported_commit(parent, job["spec"]["checkpoint"]["dir"], pid, 1)
            time.sleep(4 * HEARTBEAT_MS / 1000)  # retention settled in the catalogue
            child, pinned = None, None
            for entry in sorted(api.catalogue(parent), key=lambda x: -int(x["step"])):
                if not entry.get("available"):
                    continue
                body = job_body(40, pool="later")
                body["init_from"] = entry["id"]
                status, parsed, text = api.request("POST", "/v1/jobs", body)
                if status == 201:
                    child, pinned = parsed["id"], entry
                    break
                assert status == 400 and "disk" in text, f"submit child from {entry['id']}: HTTP {status}: {text}"
            assert child, f"no available checkpoint of {parent} to start from: {api.catalogue(parent)}"
        finally:
            os.kill(pid, signal.SIGCONT)
        pinned_step = int(pinned["step"])
        api.wait(parent, lambda j: newest_checkpoint(j) >= pinned_step + 20 or j["state"] != "running",
                 "four newer checkpoints of the parent", timeout=120)

        def check_pin(when):
            assert os.path.isfile(os.path.join(pinned["path"], "manifest.json")), \
                f"{when}: retention deleted {pinned['id']} that queued {child} starts from"
            assert not verify_checkpoint(pinned["path"]), verify_checkpoint(pinned["path"])
            entry = next(x for x in api.catalogue(parent) if x["id"] == pinned["id"])
            assert child in entry.get("pinned_by", []) and entry["available"] and not entry.get("deleted"), \
                f"{when}: {entry}"
            assert api.job(child)["state"] == "queued", api.job(child)["state"]
        check_pin("while the parent runs")
        job = api.wait_end(parent)
        assert job["state"] == "succeeded", job
        check_pin("after the parent succeeded")

        def old_ones_deleted():
            others = [x for x in api.catalogue(parent) if x["id"] != pinned["id"] and int(x["step"]) < STEPS_SHORT]
            return others and all(x.get("deleted") and not x["available"] for x in others) and others
        others = wait_for("keep_last 1: every other older checkpoint of the parent deleted by retention",
                          old_ones_deleted, timeout=15)
        self.start_worker("node-c", labels="pool=later")
        job = api.wait_end(child, timeout=120)
        assert job["state"] == "succeeded", job
        cat = api.catalogue(child)
        assert cat and all(x["parent"] == pinned["id"] for x in cat), cat
        wait_for(f"{child} to leave pinned_by once it ended", lambda: child not in next(
            x for x in api.catalogue(parent) if x["id"] == pinned["id"]).get("pinned_by", []), timeout=10)
        self.sampler.check(parent)
        self.sampler.check(child)
        node_c = self.s.workers["node-c"]
        node_c.terminate()
        node_c.wait(timeout=30)
        print(f"ok: (e) {pinned['id']} pinned by queued {child} through {len(others)} retention deletions "
              f"(keep_last 1); {child} succeeded on the late worker")

    def case_f_rank_agent_coordinator(self):
        api = self.api
        job_id = submit(api, job_body(STEPS_LONG))
        api.wait(job_id, lambda j: j["state"] == "running" and newest_checkpoint(j) >= STEPS_LONG // 10,
                 "a first checkpoint")
        os.kill(rank_pid(self.tmp, job_id), signal.SIGKILL)
        job = api.wait(job_id, lambda j: j["attempt"] >= 2 and j["state"] == "running" and
                       newest_checkpoint(j) >= STEPS_LONG * 35 // 100, "attempt 2 past 35 %", timeout=120)
        _, victim = self.hosting_worker(job)
        agent = self.s.workers[victim]
        agent.kill()
        agent.wait()
        self.start_worker(victim)  # same name, same work dir
        job = api.wait(job_id, lambda j: j["attempt"] >= 3 and j["state"] == "running" and
                       newest_checkpoint(j) >= STEPS_LONG * 60 // 100, "attempt 3 past 60 %", timeout=120)
        assert job["state"] == "running", "the job ended before the coordinator could be killed"
        self.restart_coordinator()
        job = api.wait_end(job_id)
        assert job["state"] == "succeeded", job
        assert int(job["progress"]["step"]) == STEPS_LONG and job["attempt"] >= 3, (job["progress"], job["attempt"])
        assert_same_weights(final_tensors(api, job_id, STEPS_LONG), self.reference, job_id)
        self.sampler.check(job_id)
        self.ensure_workers()
        print(f"ok: (f) {job_id}: kill -9 of the rank, then of agent {victim} (restarted), then of the coordinator "
              f"(restarted): succeeded after {job['attempt']} attempts, final weights = the reference's")

    def case_g_restart_while_scheduled(self):
        api = self.api
        agents = [self.s.workers[n] for n in ("node-a", "node-b")]
        t0 = time.time()
        for a in agents:
            os.kill(a.pid, signal.SIGSTOP)

        def resume_agents():
            for a in agents:
                try:
                    os.kill(a.pid, signal.SIGCONT)
                except OSError:
                    pass
        timer = threading.Timer(1.5, resume_agents)  # within 2 s of the stop, whatever happens
        timer.start()
        try:
            job_id = submit(api, job_body(STEPS_SHORT, world=2))
            api.wait(job_id, lambda j: j["state"] == "scheduled", "the job to be scheduled", timeout=1.0)
            self.restart_coordinator()
        finally:
            timer.join(timeout=5)
            resume_agents()
        stopped = time.time() - t0
        job = api.wait_end(job_id, timeout=180)
        assert job["state"] == "succeeded", job
        attempts = self.sampler.attempts_seen(job_id)
        assert len(attempts) == 1, f"{job_id}: attempts seen alive: {sorted(attempts)}"
        self.sampler.check(job_id)
        status, _, log = api.request("GET", f"/v1/jobs/{job_id}/logs")
        assert status == 200, status
        # The agents' launch lines ("[agent a] attempt 1: ranks 0,1 of 2, ...") name each rank
        # once, each rank exits once, and rank 0 (the only rank that prints) starts once.
        starts = {r: 0 for r in range(2)}
        for ranks in re.findall(r"^\[agent [^\]]+\] attempt \d+: ranks ([\d,]+) of ", log, re.M):
            for r in ranks.split(","):
                starts[int(r)] = starts.get(int(r), 0) + 1
        exits = {r: len(re.findall(rf"^\[agent [^\]]+\] rank {r} exited", log, re.M)) for r in range(2)}
        banners = len(re.findall(r"^\[rank 0\] loom-train: ", log, re.M))
        assert starts == {0: 1, 1: 1} and exits == {0: 1, 1: 1} and banners == 1, \
            f"launches per rank {starts}, exits per rank {exits}, rank 0 banners {banners}:\n{log[:3000]}"
        self.ensure_workers()
        print(f"ok: (g) coordinator restarted while {job_id} was scheduled (agents frozen {stopped:.1f} s): "
              f"one attempt ({sorted(attempts)}), each rank started once, succeeded")

    def case_h_timed_checkpoints(self):
        api = self.api
        body = job_body(STEPS_LONG)
        body["spec"]["checkpoint"] = {"interval": 0, "interval_seconds": 1}
        job_id = submit(api, body)
        job = api.wait(job_id, lambda j: j["state"] == "running" and newest_checkpoint(j) > 0,
                       "a first timed checkpoint", timeout=120)
        assert int(job["spec"]["checkpoint"]["interval_seconds"]) == 1, job["spec"]["checkpoint"]
        seen = newest_checkpoint(job)
        victim_id, victim = self.hosting_worker(job)
        agent = self.s.workers[victim]
        os.kill(agent.pid, signal.SIGSTOP)
        try:
            job = api.wait(job_id, lambda j: j["attempt"] >= 2 and j["state"] == "running",
                           "a new attempt on the other worker", timeout=40)
        finally:
            os.kill(agent.pid, signal.SIGCONT)
        job = api.wait_end(job_id)
        assert job["state"] == "succeeded", job
        resumed = resumed_step(job, 2)
        assert resumed is not None and resumed >= seen, \
            f"attempt 2 resumed from {resumed}, but a checkpoint at step {seen} was catalogued: {reasons(job)}"
        # With no step interval every checkpoint but the last was written because time had passed.
        steps = sorted(int(c.rsplit(".", 1)[1]) for c in job.get("checkpoints", []))
        assert len(steps) >= 3 and steps[-1] == STEPS_LONG, steps
        assert_same_weights(final_tensors(api, job_id, STEPS_LONG), self.reference, job_id)
        self.sampler.check(job_id)
        self.ensure_workers()
        print(f"ok: (h) {job_id}: checkpoints by time only (every 1 s: steps {steps[:6]}...), agent {victim} "
              f"SIGSTOPped: attempt 2 resumed from step {resumed}, final weights = the reference's")


def main():
    ap = control_plane_arg_parser()
    ap.add_argument("--cases", default="abcdefgh", help="which cases to run (letters)")
    args = ap.parse_args()
    tmp = os.path.realpath(tempfile.mkdtemp(prefix="loom-fault-matrix-"))
    m = Matrix(args, tmp)
    started = time.time()
    try:
        m.s.start_coordinator()
        m.start_worker("node-a")
        m.start_worker("node-b")
        m.s.wait_alive(["node-a", "node-b"])
        m.sampler.start()
        if set(args.cases) & set("cdfh"):
            m.run_reference()
        cases = {"a": m.case_a_agent_stopped, "b": m.case_b_partition, "c": m.case_c_flipped_bytes,
                 "d": m.case_d_deleted_dir, "e": m.case_e_pinned_by_queued_child,
                 "f": m.case_f_rank_agent_coordinator, "g": m.case_g_restart_while_scheduled,
                 "h": m.case_h_timed_checkpoints}
        for letter in args.cases:
            t = time.time()
            cases[letter]()
            print(f"   ({letter}: {time.time() - t:.0f} s)", flush=True)
        assert m.sampler.samples > 0
    except BaseException:
        m.s.dump_logs()
        raise
    finally:
        m.sampler.stop_event.set()
        stop_all(PROCS, tmp)
        for p in m.proxies.values():
            p.close()
    subprocess.run(["rm", "-rf", tmp])
    print(f"fault matrix: all checks passed in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()

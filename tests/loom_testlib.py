"""Helpers shared by the end-to-end test scripts: reading safetensors files and checkpoints from
the published format (and verifying them: CRC-32C), parsing the trainer's JSON-lines log, picking
free ports, finding trainer processes, and starting the control plane (coordinator + agents)."""
import http.client
import argparse
import glob
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.parse


def safetensors_raw(path):
    """{name: (dtype, shape, bytes)} read with the published format alone (8-byte length, JSON
    header, data), so the test does not trust Loom's own reader."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    return {name: (e["dtype"], e["shape"], data[e["data_offsets"][0]:e["data_offsets"][1]])
            for name, e in header.items() if name != "__metadata__"}


def shard_path(checkpoint_dir, rank=0):
    prefix = f"shard-{rank:05d}-of-"
    return os.path.join(checkpoint_dir, next(f for f in os.listdir(checkpoint_dir) if f.startswith(prefix)))


def step_losses(jsonl):
    """step -> the loss exactly as the trainer logged it (17 significant digits)."""
    out = {}
    with open(jsonl) as f:
        for line in f:
            m = re.search(r'"event":"step","step":(\d+),"loss":([^,]+)', line)
            if m:
                out[int(m.group(1))] = m.group(2)
    return out


def write_word_corpus(path, documents=3000):
    """JSONL documents of twelve words from eight in a fixed rotation: a corpus a micro model
    learns within tens of steps (for `loom-data pack`)."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    with open(path, "w") as f:
        for i in range(documents):
            f.write(json.dumps({"text": " ".join(words[(i * 7 + k * 3) % 8] for k in range(12)) + "."}) + "\n")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_all(procs):
    """Kills every child process still running (tests must not leave ranks or trainers behind)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)


# --- Shared by the control-plane suites (fault_matrix_test, hostile_client_test) ---------------

def _crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)  # reflected Castagnoli polynomial
        table.append(c)
    return table


_CRC32C_TABLE = _crc32c_table()


def crc32c(data, crc=0):
    """CRC-32C (Castagnoli), table driven; crc32c(b"123456789") == 0xE3069283."""
    t = _CRC32C_TABLE
    crc ^= 0xFFFFFFFF
    for b in data:
        crc = t[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


assert crc32c(b"123456789") == 0xE3069283


def verify_checkpoint(checkpoint_dir):
    """What is wrong with a committed checkpoint directory, from the published layout alone
    (manifest.json present; every shard listed with its size and CRC-32C); [] when it verifies."""
    manifest_path = os.path.join(checkpoint_dir, "manifest.json")
    if not os.path.isfile(manifest_path):
        return [f"{checkpoint_dir}: no manifest.json"]
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except ValueError as e:
        return [f"{manifest_path}: not JSON: {e}"]
    shards = manifest.get("shards") or []
    problems = []
    if not shards or len(shards) != int(manifest.get("world_size", len(shards))):
        problems.append(f"{manifest_path}: {len(shards)} shards for world size {manifest.get('world_size')}")
    for s in shards:
        path = os.path.join(checkpoint_dir, s["file"])
        if "/" in s["file"] or ".." in s["file"]:
            problems.append(f"{path}: shard file is not a plain name")
            continue
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            problems.append(f"{path}: {e}")
            continue
        if len(data) != int(s["bytes"]):
            problems.append(f"{path}: {len(data)} bytes, manifest says {s['bytes']}")
        elif f"{crc32c(data):08x}" != s["crc32c"].lower():
            problems.append(f"{path}: CRC-32C {crc32c(data):08x}, manifest says {s['crc32c']}")
    return problems


def proc_state(pid):
    """The one-letter state of a process ('R', 'S', 'T', 'Z', ...), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def proc_status_kib(pid, field):
    """A size line of /proc/PID/status in KiB: VmRSS (resident now), VmHWM (its peak so far)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def open_log_follow(port, job_id, token):
    """GET /v1/jobs/JOB/logs?follow=true on a raw socket, as a follower holds it: (the socket, the
    bytes read until the end of the response head or EOF)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall((f"GET /v1/jobs/{job_id}/logs?follow=true HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
               f"Authorization: Bearer {token}\r\n\r\n").encode())
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = s.recv(65536)
        if not data:
            break
        buf += data
    return s, buf


def loom_trainers(root=None):
    """Live (not zombie) loom-train processes with a LOOM_JOB_ID in their environment, as dicts
    {pid, job, rank, attempt, state}. With root: only those whose working directory or command
    line lies under root (ignores the trainers of other suites running at the same time)."""
    root = os.path.realpath(root) if root else None
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() != "loom-train":
                    continue
            state = proc_state(pid)
            if state is None or state in ("Z", "X"):
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            if root:
                try:
                    cwd = os.readlink(f"/proc/{pid}/cwd")
                except OSError:
                    cwd = ""
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().decode("utf-8", "replace").split("\0")
                if not (cwd.startswith(root) or any(a.startswith(root) for a in argv)):
                    continue
        except OSError:
            continue
        if b"LOOM_JOB_ID" not in env:
            continue
        out.append({"pid": pid, "job": env[b"LOOM_JOB_ID"].decode(),
                    "rank": int(env.get(b"LOOM_RANK", b"-1") or -1),
                    "attempt": int(env.get(b"LOOM_ATTEMPT", b"0") or 0), "state": state})
    return out


def rank_log_step(tmp, job_id):
    """The newest step in the job's rank logs on disk (what the rank did, whatever the
    coordinator knows)."""
    newest = 0
    for path in glob.glob(os.path.join(tmp, "*", "**", job_id, "**", "*.jsonl"), recursive=True):
        with open(path, errors="replace") as f:
            for line in f:
                if '"event":"step"' in line:
                    try:
                        newest = max(newest, int(json.loads(line)["step"]))
                    except (ValueError, KeyError):
                        pass
    return newest


class AttemptSampler:
    """Samples the job's live trainers every 50 ms; remembers any instant with two attempts.
    finish() stops it and fails if one was seen."""

    def __init__(self, root, job):
        self.root, self.job = root, job
        self.overlaps, self.samples, self.stop = [], 0, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop.is_set():
            attempts = {t["attempt"] for t in loom_trainers(self.root) if t["job"] == self.job and t["state"] != "T"}
            self.samples += 1
            if len(attempts) > 1:
                self.overlaps.append((time.time(), sorted(attempts)))
            time.sleep(0.05)

    def finish(self):
        self.stop.set()
        self.thread.join()
        assert self.samples > 20, f"only {self.samples} samples: the sampler hardly ran"
        assert not self.overlaps, f"{self.job}: two attempts alive at once: {self.overlaps[:3]}"


def kill_trainers_under(root):
    """SIGKILLs loom-train processes this suite's agents left under root (a safety net)."""
    for t in loom_trainers(root):
        try:
            os.kill(t["pid"], 9)
        except OSError:
            pass


def metric_family(text, prefix):
    """The samples of a Prometheus text exposition whose names start with `prefix`, as
    {name after the prefix, labels dropped: value}; e.g. the HTTP servers' connection caps,
    metric_family(text, "loom_coordinator_http_connections_")["refused_total"]."""
    out = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0][len(prefix):]] = float(value)
    return out


def read_port_file(path):
    """The port in a port file, or None while it is missing or still being written."""
    try:
        with open(path) as f:
            text = f.read().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


def wait_for(what, fn, timeout=60, interval=0.2):
    """Polls fn() until it returns something truthy (returned) or raises after timeout."""
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}; last: {str(last)[:2000]}")


class Api:
    """A JSON client for one listener of the coordinator: request() returns (status, parsed JSON
    or None, text); token is the default bearer token (None: no Authorization header); source:
    the local address to connect from (another 127.x address is another client to the server's
    per-address caps)."""

    def __init__(self, port, token=None, host="127.0.0.1", source=None):
        self.port = port
        self.token = token
        self.host = host
        self.source = source

    def request(self, method, path, body=None, token="default", raw=None, headers=None, timeout=30):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout,
                                          source_address=(self.source, 0) if self.source else None)
        h = dict(headers or {})
        token = self.token if token == "default" else token
        if token:
            h["Authorization"] = "Bearer " + token
        data = raw if raw is not None else (json.dumps(body) if body is not None else None)
        if data is not None:
            h.setdefault("Content-Type", "application/json")
        try:
            conn.request(method, path, body=data, headers=h)
            resp = conn.getresponse()
            text = resp.read().decode("utf-8", "replace")
        finally:
            conn.close()
        try:
            parsed = json.loads(text) if text else None
        except ValueError:
            parsed = None
        return resp.status, parsed, text

    def ok(self, method, path, body=None, token="default"):
        status, parsed, text = self.request(method, path, body, token)
        assert 200 <= status < 300, f"{method} {path}: HTTP {status}: {text[:2000]}"
        return parsed

    def job(self, job_id):
        return self.ok("GET", f"/v1/jobs/{job_id}")

    def catalogue(self, job_id=None):
        """Every catalogue entry (of one job), all pages: a long job's retained-and-deleted
        entries outnumber one page."""
        entries, token = [], ""
        while True:
            query = [f"job={job_id}"] if job_id else []
            if token:
                query.append(f"page_token={urllib.parse.quote(token)}")
            page = self.ok("GET", "/v1/checkpoints" + ("?" + "&".join(query) if query else ""))
            entries += page.get("checkpoints", [])
            token = page.get("next_page_token", "")
            if not token:
                return entries

    def workers(self):
        return self.ok("GET", "/v1/workers")["workers"]

    def wait(self, job_id, pred, what, timeout=120):
        deadline = time.time() + timeout
        job = None
        while time.time() < deadline:
            job = self.job(job_id)
            if pred(job):
                return job
            time.sleep(0.2)
        raise AssertionError(f"{job_id}: timed out waiting for {what}; last state {json.dumps(job)[:3000]}")

    def wait_end(self, job_id, timeout=240):
        return self.wait(job_id, lambda j: j["state"] in ("succeeded", "failed", "cancelled"), "the end", timeout)

    def wait_end_progressing(self, job_id, stall=60):
        """The job's end however slow the machine is, as long as its step keeps moving: a job
        that makes no progress for `stall` seconds fails the wait (the test's own timeout bounds
        the rest)."""
        last, moved = -1, time.time()
        while True:
            job = self.job(job_id)
            if job["state"] in ("succeeded", "failed", "cancelled"):
                return job
            step = int(job.get("progress", {}).get("step", 0))
            if step != last:
                last, moved = step, time.time()
            assert time.time() - moved < stall, \
                f"{job_id}: no progress for {stall} s at step {step}; last state {json.dumps(job)[:3000]}"
            time.sleep(0.2)


def final_tensors(api, job_id, step):
    """{name: (dtype, shape, bytes)} of rank 0's shard of a job's checkpoint at `step`."""
    entry = [x for x in api.catalogue(job_id) if int(x["step"]) == step]
    assert entry and entry[-1].get("available"), f"{job_id}: no available checkpoint at step {step}: {entry}"
    return safetensors_raw(shard_path(entry[-1]["path"], 0))


class AgentClient:
    """The agent protocol (gRPC, api/loom/v1/agent.proto) on the coordinator's agent port, as the
    tests speak it: register() and heartbeat() take and return dicts in the proto JSON mapping
    (snake_case, defaults printed) and give (code, parsed, message): code is the gRPC status name
    ("OK", "PERMISSION_DENIED", ...), parsed the response (None on an error), message the error's
    text. The stubs are generated at build time (api/CMakeLists.txt); --agent-stubs names them."""

    _modules = None

    @classmethod
    def load_stubs(cls, stubs_dir):
        if cls._modules is None:
            assert stubs_dir and os.path.isdir(stubs_dir), f"--agent-stubs: no directory {stubs_dir!r}"
            sys.path.insert(0, stubs_dir)
            import grpc  # python3-grpcio (scripts/install-deps)
            from google.protobuf import json_format
            from loom.v1 import agent_pb2_grpc, control_pb2
            cls._modules = (grpc, json_format, agent_pb2_grpc, control_pb2)
        return cls._modules

    def __init__(self, stubs_dir, port, ca_file=None, client_cert=None, client_key=None, host="127.0.0.1",
                 timeout=10):
        grpc, _, agent_pb2_grpc, _ = self.load_stubs(stubs_dir)
        self.port, self.timeout = port, timeout
        target = f"{host}:{port}"
        if ca_file:
            read = lambda f: open(f, "rb").read() if f else None  # noqa: E731
            creds = grpc.ssl_channel_credentials(read(ca_file), read(client_key), read(client_cert))
            self.channel = grpc.secure_channel(target, creds)
        else:
            self.channel = grpc.insecure_channel(target)
        self.stub = agent_pb2_grpc.AgentStub(self.channel)

    def close(self):
        self.channel.close()

    def _call(self, method, request_type, body, token):
        grpc, json_format, _, control_pb2 = self._modules
        request = json_format.ParseDict(body or {}, getattr(control_pb2, request_type)())
        metadata = [("authorization", "Bearer " + token)] if token else []
        for attempt in range(3):
            try:
                response = getattr(self.stub, method)(request, metadata=metadata, timeout=self.timeout)
                break
            except grpc.RpcError as e:
                # A connection to a coordinator that was killed fails its next call with
                # UNAVAILABLE before the channel notices; like the agents, try again.
                if e.code() != grpc.StatusCode.UNAVAILABLE or attempt == 2:
                    return e.code().name, None, e.details() or ""
                time.sleep(0.5)
        return "OK", json_format.MessageToDict(response, preserving_proto_field_name=True,
                                               including_default_value_fields=True), ""

    def register(self, body, token):
        return self._call("Register", "RegisterWorkerRequest", body, token)

    def heartbeat(self, body, token):
        return self._call("Heartbeat", "HeartbeatRequest", body, token)


def agent_refusal(what, result, want, needles=("",)):
    """Asserts that an agent call was refused with a gRPC code in want (a name or names) and a
    message holding one of needles; returns the message."""
    code, parsed, message = result
    want = (want,) if isinstance(want, str) else tuple(want)
    needles = (needles,) if isinstance(needles, str) else tuple(needles)
    assert code in want, f"{what}: gRPC {code}, wanted {want}: {message[:400]}"
    assert parsed is None and message, f"{what}: no error message"
    assert any(n.lower() in message.lower() for n in needles), f"{what}: none of {needles} in '{message[:400]}'"
    return message


def control_plane_arg_parser():
    """The binaries every control-plane suite is run with (tests/CMakeLists.txt passes them)."""
    ap = argparse.ArgumentParser()
    for flag in ("--coordinator", "--worker", "--loom", "--loom-train", "--source-dir"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--agent-stubs", help="Python stubs of the agent protocol (build/api/python)")
    return ap


class Service:
    """A coordinator (user listener + agent listener, token files written here) and worker
    agents, started as real processes. Every process goes into `procs` (the suite kills them).
    host: the coordinator's address (--bind); prefix: name ("coordinator" or a worker's) -> the
    command that launches it (["ip", "netns", "exec", ns] puts it in a network namespace);
    admins: the users given the admin role."""

    def __init__(self, args, tmp, users, enrolment_token, coordinator_flags, procs, host="127.0.0.1",
                 prefix=None, admins=()):
        self.args, self.tmp, self.procs = args, tmp, procs
        self.host, self.prefix = host, dict(prefix or {})
        self.users = dict(users)  # name -> token
        self.enrolment_token = enrolment_token
        self.flags = list(coordinator_flags)
        # The suites were written for a lease of half the loss timeout (the default until the
        # lease became its own flag, 90 s): they keep it unless they set --lease-ms.
        if "--lost-after-ms" in self.flags and "--lease-ms" not in self.flags:
            lost = int(self.flags[self.flags.index("--lost-after-ms") + 1])
            self.flags += ["--lease-ms", str(lost // 2)]
        self.users_file = os.path.join(tmp, "users")
        self.enrolment_file = os.path.join(tmp, "enrolment-token")
        with open(self.users_file, "w") as f:
            f.write("# user tokens\n" + "".join(f"{u} {t}{' admin' if u in admins else ''}\n"
                                                for u, t in self.users.items()))
        with open(self.enrolment_file, "w") as f:
            f.write(enrolment_token + "\n")
        os.chmod(self.users_file, 0o600)
        os.chmod(self.enrolment_file, 0o600)
        self.data_dir = os.path.join(tmp, "coord")
        self.storage = os.path.join(tmp, "storage")
        os.makedirs(self.storage, exist_ok=True)
        self.coordinator = None
        self.port = 0
        self.agent_port = 0
        self.workers = {}  # name -> Popen
        self.env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.env.pop("LOOM_TOKEN", None)
        self.api = Api(0, next(iter(self.users.values())), host)
        self._agent = None

    def cli(self, *argv, token=None, check=True, timeout=120):
        """Runs `loom ARGV...` against this coordinator as the user of `token` (default: the first
        user's); with check, a non-zero exit fails the suite with its output."""
        env = {**self.env, "LOOM_COORDINATOR": f"http://{self.host}:{self.port}",
               "LOOM_TOKEN": token or next(iter(self.users.values()))}
        r = subprocess.run([self.args.loom, *argv], env=env, capture_output=True, text=True,
                           timeout=timeout)
        if check:
            assert r.returncode == 0, f"loom {' '.join(argv)}: {r.returncode}\n{r.stdout}\n{r.stderr}"
        return r

    def start_coordinator(self, port=0, agent_port=0, tries=1):
        """Starts loom-coordinator; with fixed ports, retries while the bind fails. Returns the
        (port, agent_port) it listens on; self.api and self.agent follow them."""
        port_file = os.path.join(self.tmp, "port")
        agent_port_file = os.path.join(self.tmp, "agent-port")
        for attempt in range(tries):
            for f in (port_file, agent_port_file):
                if os.path.exists(f):
                    os.remove(f)
            log = open(os.path.join(self.tmp, "coordinator.log"), "a")
            p = subprocess.Popen(
                [*self.prefix.get("coordinator", []), self.args.coordinator, "--bind", self.host,
                 "--data-dir", self.data_dir, "--storage-root", self.storage,
                 "--port", str(port), "--port-file", port_file,
                 "--agent-port", str(agent_port), "--agent-port-file", agent_port_file,
                 "--user-tokens", self.users_file, "--worker-token-file", self.enrolment_file, *self.flags],
                stdout=log, stderr=subprocess.STDOUT, env=self.env)
            log.close()
            self.procs.append(p)
            deadline = time.time() + 30
            while time.time() < deadline and p.poll() is None:
                if read_port_file(port_file) and read_port_file(agent_port_file):
                    break
                time.sleep(0.02)
            if p.poll() is None and read_port_file(port_file) and read_port_file(agent_port_file):
                self.coordinator = p
                self._agent = None  # a new process: a new channel
                self.port, self.agent_port = read_port_file(port_file), read_port_file(agent_port_file)
                self.api.port = self.port
                return self.port, self.agent_port
            if p.poll() is None:
                p.kill()
                p.wait()
                raise AssertionError("loom-coordinator did not write its port files within 30 s")
            time.sleep(0.25)  # exited: the fixed port may still be taken; try again
        raise AssertionError(f"loom-coordinator exited at start-up {tries} time(s) (ports {port}, {agent_port})")

    @property
    def agent(self):
        """An AgentClient on the agent port (plaintext), following restarts of the coordinator."""
        if self._agent is None or self._agent.port != self.agent_port:
            self._agent = AgentClient(self.args.agent_stubs, self.agent_port, host=self.host)
        return self._agent

    def start_worker(self, name, labels="pool=cpu", slots=2, coordinator_url=None, term_grace_ms=3000,
                     extra=("--gpus", "none")):
        log = open(os.path.join(self.tmp, f"{name}.log"), "a")
        p = subprocess.Popen(
            [*self.prefix.get(name, []), self.args.worker,
             "--coordinator", coordinator_url or f"http://{self.host}:{self.agent_port}",
             "--token-file", self.enrolment_file, "--work-dir", os.path.join(self.tmp, name),
             "--slots", str(slots), "--name", name, "--labels", labels, "--term-grace-ms", str(term_grace_ms),
             "--loom-train", self.args.loom_train, *extra],
            stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()
        self.procs.append(p)
        self.workers[name] = p
        return p

    def worker_records(self):
        """name -> the worker record (an alive one when a name has several)."""
        out = {}
        for w in self.api.workers():
            if w["name"] not in out or w["state"] == "alive":
                out[w["name"]] = w
        return out

    def wait_alive(self, names, timeout=30):
        return wait_for(f"workers {sorted(names)} alive", lambda: (lambda r: all(
            n in r and r[n]["state"] == "alive" for n in names) and r)(self.worker_records()), timeout)

    def name_of(self, worker_id):
        return next(w["name"] for w in self.api.workers() if w["id"] == worker_id)

    def dump_logs(self, names=None):
        names = names or ["coordinator.log"] + [f"{n}.log" for n in self.workers]
        for name in names:
            p = os.path.join(self.tmp, name)
            if os.path.exists(p):
                with open(p, errors="replace") as f:
                    sys.stderr.write(f"--- {name} (tail) ---\n" + f.read()[-4000:] + "\n")


def stop_loom_up(up):
    """Stops a `loom up` as Ctrl-C does (SIGINT) and returns its output; it must exit 0."""
    up.send_signal(signal.SIGINT)
    out, _ = up.communicate(timeout=60)
    assert up.returncode == 0, out[-3000:]
    return out


def dump_loom_up(up):
    """After a failure: stops a `loom up` still running and prints the end of its output."""
    if up is None or up.poll() is not None:
        return
    up.send_signal(signal.SIGINT)
    try:
        print(up.communicate(timeout=30)[0][-6000:])
    except subprocess.TimeoutExpired:
        pass


def stop_all(procs, root=None):
    """SIGCONT (stopped ones cannot die of SIGTERM), SIGTERM, a grace period, then SIGKILL every
    process still running; then any trainer left under root."""
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGCONT)
                p.send_signal(signal.SIGTERM)
            except OSError:
                pass
    deadline = time.time() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            pass
    kill_all(procs)
    if root:
        kill_trainers_under(root)


def redocly_lint(source_dir, spec_path):
    """Lints an OpenAPI document with the pinned Redocly CLI (recommended rules, api/redocly.yaml):
    it must report no error and no warning."""
    linter = os.path.join(source_dir, ".tools", "node_modules", ".bin", "redocly")
    assert os.access(linter, os.X_OK), f"{linter} missing: run scripts/install-deps"
    config = os.path.join(source_dir, "api", "redocly.yaml")
    r = subprocess.run([linter, "lint", spec_path, "--config", config], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "REDOCLY_TELEMETRY": "off",
                                         "REDOCLY_SUPPRESS_UPDATE_NOTICE": "true"})
    report = r.stdout + r.stderr
    assert r.returncode == 0 and "Your API description is valid" in report, report
    assert not re.search(r"\d+ (warning|error)s?\b", report), f"redocly lint is not clean:\n{report}"

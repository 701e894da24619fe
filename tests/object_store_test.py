#!/usr/bin/env python3
"""Checkpoints on an S3-compatible object store, for real: s3rver (npm) behind a proxy that
checks every request's SigV4 signature with botocore and injects faults (tests/s3_testlib.py),
the Debian AWS CLI as an independent client, and the real binaries.

The client (loom-store): a multipart upload in parallel parts read back byte for byte by
`aws s3 cp`; a 503 SlowDown storm absorbed by backoff; wrong credentials (a wrong key id, a wrong
secret) fail at once with the store's code and the bucket named, one request each (no retry
loop).

A job through `loom up --checkpoint-store s3://...`: steps are uploaded in the background and
reported once their manifest is in the store; `aws s3 ls` sees exactly the committed steps, each
with its manifest; the store is killed mid-upload and restarted (the upload is tried again,
training never stops, no restart is counted); a checkpoint damaged in the store and the trainer
killed with kill -9: the next attempt skips the damaged step (marked in the catalogue), resumes
from the one before, and ends with final weights bitwise equal to an uninterrupted run;
retention deletes whole steps and never a pinned one. A POSIX checkpoint uploaded with
`aws s3 cp` is accepted by loom-train --init-from (a step or its root). A staging directory
on a full filesystem fails the save with the reason and leaves nothing in the store (skipped,
with the reason, where a tmpfs cannot be mounted). A packed dataset copied up with the AWS CLI
trains through the node's cache (content-addressed by CRC-32C: a second run fetches nothing, a
damaged cached copy is fetched again, a shard damaged in the store is refused by name), also as
a service job's data.path.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loom_testlib import (Api, dump_loom_up, free_port, loom_trainers, read_port_file, safetensors_raw,  # noqa: E402
                          stop_all, stop_loom_up, wait_for, write_word_corpus)
from s3_testlib import S3Server  # noqa: E402

PROCS = []
STORE = "s3://ckpt/loom"


def spec(steps, interval, keep_last=3, seed=7, world=1, zero=0):
    return {"spec": {"preset": "micro", "steps": steps, "micro_batch": 4, "seq_len": 32, "threads": 1,
                     "seed": seed, "data": {"corpus_bytes": 65536}, "eval": {"batches": 1, "interval": 0},
                     "checkpoint": {"interval": interval, "keep_last": keep_last},
                     "metrics": {"log_every": 1}, "zero_stage": zero, "dist_timeout_seconds": 30},
            "world_size": world}


def train_argv(args):
    """A four-step loom-train run of the micro preset (flags appended by the caller)."""
    return [args.loom_train, "train", "--preset", "micro", "--steps", "4", "--batch", "4", "--seq-len", "32",
            "--threads", "1"]


def run(argv, env, timeout=300):
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)


def test_client(args, s3, tmp):
    """loom-store against the checking proxy: multipart, SlowDown, wrong credentials."""
    big = os.path.join(tmp, "big.bin")
    with open(big, "wb") as f:
        f.write(os.urandom(23 * 1000 * 1000))
    env = s3.env(LOOM_S3_PART_MB="5", LOOM_S3_PARALLEL_PARTS="3")
    r = run([args.loom_store, "put", big, "s3://ckpt/client/big.bin"], env)
    assert r.returncode == 0, r.stderr
    parts = [p for m, p in s3.requests if m == "PUT" and "partNumber=" in p]
    assert len(parts) == 5, parts  # 23 MB in 5 MiB parts
    back = os.path.join(tmp, "back.bin")
    s3.aws("s3", "cp", "s3://ckpt/client/big.bin", back)
    assert open(back, "rb").read() == open(big, "rb").read(), "aws s3 cp read back other bytes"
    # A storm of 503 SlowDown: the client backs off and gets through.
    s3.slowdowns = 5
    r = run([args.loom_store, "ls", "s3://ckpt/client"], env)
    assert r.returncode == 0 and "client/big.bin" in r.stdout, r.stdout + r.stderr
    assert s3.slowdowns <= 0
    # Wrong credentials: one request, an error naming the bucket and the store's code.
    for name, bad, code in (("key id", {"AWS_ACCESS_KEY_ID": "NOT-A-KEY"}, "InvalidAccessKeyId"),
                            ("secret", {"AWS_SECRET_ACCESS_KEY": "not-the-secret"}, "SignatureDoesNotMatch")):
        before = len(s3.requests)
        r = run([args.loom_store, "ls", "s3://ckpt/client"], s3.env(**bad))
        assert r.returncode != 0 and code in r.stderr and "s3://ckpt/" in r.stderr, r.stderr
        assert len(s3.requests) - before == 1, f"wrong {name}: {len(s3.requests) - before} requests"
    s3.bad_signatures.clear()  # the wrong secret's, on purpose
    # Parts that never arrive: the upload fails after its retries and is aborted in the store.
    s3.drop_puts = 100
    r = run([args.loom_store, "put", big, "s3://ckpt/client/dropped.bin"], s3.env(LOOM_S3_PART_MB="5",
            LOOM_S3_MAX_ATTEMPTS="2"))
    s3.drop_puts = 0
    assert r.returncode != 0 and "dropped.bin" in r.stderr, r.stderr
    aborts = [p for m, p in s3.requests if m == "DELETE" and p.startswith("/ckpt/client/dropped.bin?uploadId=")]
    assert aborts, "no AbortMultipartUpload after the failed upload"
    # (s3rver implements neither AbortMultipartUpload nor ListMultipartUploads: what can be
    # checked is that the abort was sent and that no object came of the upload.)
    assert "client/dropped.bin" not in s3.keys("client/"), s3.keys("client/")
    # Virtual-host addressing: http://ckpt.s3.localhost:PORT/key (curl resolves *.localhost).
    vhost = s3.env(AWS_ENDPOINT_URL=s3.endpoint.replace("127.0.0.1", "s3.localhost"), LOOM_S3_ADDRESSING="virtual")
    r = run([args.loom_store, "ls", "s3://ckpt/client"], vhost)
    assert r.returncode == 0 and "client/big.bin" in r.stdout, r.stdout + r.stderr
    assert s3.hosts[-1].startswith("ckpt.s3.localhost:"), s3.hosts[-1]
    # TLS with a private CA: trusted through AWS_CA_BUNDLE, refused at once without it.
    endpoint, ca = s3.start_tls_server(tmp)
    r = run([args.loom_store, "put", os.path.join(tmp, "back.bin"), "s3://ckpt/tls.bin"],
            s3.env(AWS_ENDPOINT_URL=endpoint, AWS_CA_BUNDLE=ca))
    assert r.returncode == 0, r.stderr
    t0 = time.time()
    r = run([args.loom_store, "ls", "s3://ckpt/"], s3.env(AWS_ENDPOINT_URL=endpoint))
    assert r.returncode != 0 and "certificate" in r.stderr and "attempts" not in r.stderr, r.stderr
    assert time.time() - t0 < 10
    print("ok: multipart upload (5 parts) read back by aws s3 cp; SlowDown storm absorbed; "
          "wrong key id and wrong secret: one request each, the store's code and the bucket named; "
          "an upload whose parts never arrive is aborted; virtual-host addressing; TLS trusted "
          "through AWS_CA_BUNDLE and refused without it")


class Box:
    """loom up with its checkpoints in the store."""

    def __init__(self, args, s3, tmp):
        self.args, self.s3, self.tmp = args, s3, tmp
        self.port = free_port()
        self.env = s3.env(OMP_NUM_THREADS="1", XDG_CONFIG_HOME=os.path.join(tmp, "xdg"))
        self.env.pop("LOOM_TOKEN", None)
        self.up = subprocess.Popen(
            [args.loom, "up", "--workers", "1", "--slots", "2", "--port", str(self.port), "--data-dir",
             os.path.join(tmp, "up"), "--checkpoint-store", STORE],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env)
        PROCS.append(self.up)
        token = os.path.join(tmp, "up", "tokens", "user-token")
        wait_for("loom up's token", lambda: os.path.exists(token) and os.path.getsize(token) > 0, timeout=60)
        self.api = Api(self.port, open(token).read().strip())
        wait_for("loom up's worker", self.worker_alive, timeout=90)

    def worker_alive(self):
        try:  # the token is written before the coordinator listens (it lists the store first)
            return any(w["state"] == "alive" for w in self.api.workers())
        except OSError:
            return False

    def submit(self, body):
        status, parsed, text = self.api.request("POST", "/v1/jobs", body)
        assert status == 201, f"submit: HTTP {status}: {text}"
        return parsed["id"]

    def root(self, job_id):
        """The job's checkpoint root in the store, as a key prefix."""
        d = self.api.job(job_id)["spec"]["checkpoint"]["dir"]
        assert d.startswith(STORE + "/jobs/" + job_id + "-"), d
        return d[len("s3://ckpt/"):]

    def steps_in_store(self, job_id):
        """{step: [files]} under the job's root, as the AWS CLI lists them."""
        root = self.root(job_id) + "/"
        out = {}
        for key in self.s3.keys(root):
            step_dir, _, name = key[len(root):].partition("/")
            out.setdefault(int(step_dir.split("-")[1]), []).append(name)
        return out

    def tensors(self, job_id, step, rank=0):
        """A rank's shard of the step, fetched with the AWS CLI."""
        local = os.path.join(self.tmp, f"{job_id}-{step}")
        if not os.path.isdir(local):
            self.s3.aws("s3", "cp", "--recursive", f"s3://ckpt/{self.root(job_id)}/step-{step:08d}", local)
        shard = [f for f in os.listdir(local) if f.startswith(f"shard-{rank:05d}-of-")]
        return safetensors_raw(os.path.join(local, shard[0]))


def committed(box, job_id):
    """Steps the catalogue holds as available."""
    return sorted(int(e["step"]) for e in box.api.catalogue(job_id) if e.get("available"))


def test_job(box):
    """Background uploads, an outage mid-upload, a damaged step and kill -9, bitwise resume."""
    steps, interval = 100, 10
    box.s3.put_delay = 0.3  # a slow store: uploads overlap training, and pace it
    reference = box.submit(spec(steps, interval))
    assert box.api.wait_end_progressing(reference)["state"] == "succeeded"
    job = box.submit(spec(steps, interval))
    # The store dies while step 20's shard is on its way, and comes back 4 s later.
    shard20 = "/ckpt/" + box.root(job) + "/step-00000020/shard-"
    wait_for("step 20's upload", lambda: any(m == "PUT" and p.startswith(shard20) for m, p in box.s3.requests),
             timeout=180, interval=0.02)
    box.s3.kill_backend()
    time.sleep(4)
    box.s3.start_backend()
    box.api.wait(job, lambda j: 40 in [int(e["step"]) for e in box.api.catalogue(job)], "step 40 in the store",
                 timeout=180)
    j = box.api.job(job)
    assert j["attempt"] == 1 and j.get("restarts", 0) == 0, "the outage stopped training"
    _, _, log = box.api.request("GET", f"/v1/jobs/{job}/logs")
    uploaded = [line for line in log.splitlines() if "checkpoint: step 20 uploaded" in line]
    assert uploaded and "(0 retried request(s), 0 retried upload(s))" not in uploaded[0], \
        f"step 20's upload met no outage: {uploaded}"
    # The newest step's shard damaged in the store, then the trainer killed: attempt 2 skips it.
    trainer = [t for t in loom_trainers(box.tmp) if t["job"] == job]
    assert trainer, "no trainer"
    os.kill(trainer[0]["pid"], signal.SIGSTOP)
    # Damaged: the newest catalogued step, and any newer one already in the store that the
    # catalogue has not heard of yet (its event was still to be written or reported).
    time.sleep(2)  # the agent reads the events the trainer wrote before it stopped
    newest = max(committed(box, job))
    in_store = box.steps_in_store(job)
    for step, files in in_store.items():
        if step < newest or "manifest.json" not in files:
            continue
        shard = [f for f in files if f.startswith("shard-")][0]
        path = box.s3.object_file(f"{box.root(job)}/step-{step:08d}/{shard}")
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
    os.kill(trainer[0]["pid"], signal.SIGKILL)
    done = box.api.wait_end_progressing(job)
    assert done["state"] == "succeeded" and done["attempt"] == 2, done
    resumed = done["history"][1].get("resumed_from", "")
    assert resumed.startswith(STORE) and f"step-{newest - interval:08d}" in resumed, (newest, done["history"])
    damaged = [e for e in box.api.catalogue(job) if int(e["step"]) == newest]
    assert damaged and damaged[-1].get("damaged"), damaged
    a, b = box.tensors(job, steps), box.tensors(reference, steps)
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a), "final weights differ"
    # The commit point last: no request changed a step's shards while its manifest existed (a
    # rerun of a step deletes the manifest first), and every step got one.
    for step in range(interval, steps + 1, interval):
        prefix = f"/ckpt/{box.root(job)}/step-{step:08d}/"
        present, committed_once = False, False
        for m, p in box.s3.requests:
            if not p.startswith(prefix):
                continue
            if p.startswith(prefix + "manifest.json"):
                present = m == "PUT" or (present and m != "DELETE")
                committed_once |= m == "PUT"
            elif m in ("PUT", "POST"):
                assert not present, f"step {step}: {m} {p} while its manifest was in the store"
        assert committed_once, f"step {step} was never committed"
    # What the store holds is exactly what the catalogue calls available: whole steps.
    for j_id in (reference, job):
        in_store = box.steps_in_store(j_id)
        assert sorted(in_store) == committed(box, j_id), (j_id, sorted(in_store), committed(box, j_id))
        for step, files in in_store.items():
            assert "manifest.json" in files and any(f.startswith("shard-") for f in files), (step, files)
    box.s3.put_delay = 0
    print(f"   {uploaded[0].strip()}")
    print(f"ok: {job} survived a store outage mid-upload on attempt 1, skipped damaged step {newest} "
          f"after kill -9, resumed from {newest - interval} and matched {reference} bitwise; "
          f"the store holds exactly the catalogued steps {committed(box, job)}")
    return reference


def test_zero_job(box):
    """ZeRO-1 on the store: each rank uploads its own shard, rank 0 commits the manifest after
    both; kill -9 of rank 1, and the resumed job matches an uninterrupted one bitwise."""
    steps, interval = 100, 10
    box.s3.put_delay = 0.4  # uploads pace training, so the kill lands mid-run
    reference = box.submit(spec(steps, interval, world=2, zero=1))
    assert box.api.wait_end_progressing(reference)["state"] == "succeeded"
    job = box.submit(spec(steps, interval, world=2, zero=1))
    box.api.wait(job, lambda j: 20 in [int(e["step"]) for e in box.api.catalogue(job)], "step 20 in the store",
                 timeout=180)
    rank1 = [t for t in loom_trainers(box.tmp) if t["job"] == job and t["rank"] == 1]
    assert rank1, loom_trainers(box.tmp)
    os.kill(rank1[0]["pid"], signal.SIGKILL)
    done = box.api.wait_end_progressing(job)
    box.s3.put_delay = 0
    assert done["state"] == "succeeded" and done["attempt"] >= 2, done
    resumed = done["history"][-1].get("resumed_from", "")
    assert resumed.startswith(STORE) and int(resumed.rsplit("step-", 1)[1]) < steps, done["history"]
    manifest = json.loads(box.s3.aws("s3", "cp", f"s3://ckpt/{box.root(job)}/step-{steps:08d}/manifest.json", "-").stdout)
    assert [sh["file"] for sh in manifest["shards"]] == ["shard-00000-of-00002.safetensors",
                                                          "shard-00001-of-00002.safetensors"], manifest["shards"]
    for rank in (0, 1):
        a, b = box.tensors(job, steps, rank), box.tensors(reference, steps, rank)
        assert a.keys() == b.keys() and all(a[k] == b[k] for k in a), f"rank {rank}'s shard differs"
    print(f"ok: ZeRO-1 on the store: {job} lost rank 1 to kill -9, resumed from {resumed.rsplit('/', 1)[-1]} "
          f"and its two shards matched {reference}'s bitwise")


def test_retention_pins(box, reference):
    """keep_last lowered to 1: steps go whole, the one a running child starts from stays."""
    kept = committed(box, reference)
    pinned = kept[0]
    child = box.submit({**spec(100000, 0, seed=9), "init_from": f"{reference}.{pinned}"})
    box.api.wait(child, lambda j: j["state"] == "running", "the child to run", timeout=120)
    box.api.ok("PATCH", f"/v1/jobs/{reference}", {"keep_last": 1})
    want = sorted({pinned, kept[-1]})
    wait_for("retention in the store", lambda: sorted(box.steps_in_store(reference)) == want, timeout=60)
    assert committed(box, reference) == want
    box.api.ok("POST", f"/v1/jobs/{child}/cancel")
    box.api.wait_end(child)
    print(f"ok: keep_last 1 left steps {want} of {reference} in the store ({pinned} pinned by {child})")


def test_job_on_stored_dataset(box):
    """A service job whose data.path is in the store: accepted at submit, trained by the rank."""
    body = spec(10, 0)
    body["spec"]["data"] = {"source": "shards", "path": "s3://ckpt/datasets/words"}
    job = box.submit(body)
    done = box.api.wait_end_progressing(job)
    assert done["state"] == "succeeded", done
    status, _, text = box.api.request("POST", "/v1/jobs", {**body, "spec": {**body["spec"], "data": {
        "source": "shards", "path": "s3://ckpt/../etc"}}})
    assert status == 400 and "spec.data.path" in text, (status, text)
    print(f"ok: {job} trained on the dataset in the store; a malformed s3:// path is refused (400)")


def test_init_from_aws_upload(args, s3, tmp):
    """A POSIX checkpoint copied up with aws s3 cp starts a run (a step, and its root)."""
    local = os.path.join(tmp, "posix")
    env = s3.env(OMP_NUM_THREADS="1")
    base = train_argv(args)
    r = run(base + ["--checkpoint-dir", local, "--checkpoint-every", "4"], env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    s3.aws("s3", "cp", "--recursive", os.path.join(local, "step-00000004"), "s3://ckpt/manual/step-00000004")
    for where in ("s3://ckpt/manual/step-00000004", "s3://ckpt/manual"):
        r = run(base + ["--init-from", where], env)
        out = r.stdout + r.stderr
        assert r.returncode == 0 and "init-from: weights of s3://ckpt/manual/step-00000004" in out, out[-3000:]
    # The same references for the catalogue-free listing, export-hf and the model loader that
    # loom-serve shares with generate.
    r = run([args.loom, "checkpoints", "--store", "s3://ckpt/manual"], env)
    assert r.returncode == 0 and "s3://ckpt/manual/step-00000004" in r.stdout, r.stdout + r.stderr
    hf = os.path.join(tmp, "hf")
    r = run([args.loom_train, "export-hf", "--checkpoint", "s3://ckpt/manual/step-00000004", "--out", hf], env)
    assert r.returncode == 0 and os.path.exists(os.path.join(hf, "config.json")), r.stdout[-2000:] + r.stderr[-2000:]
    r = run([args.loom_train, "generate", "--checkpoint", "s3://ckpt/manual", "--prompt", "ab",
             "--max-new-tokens", "2", "--greedy"], env)
    assert r.returncode == 0 and "tokens" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    # The trainer's own checkpoints to a bucket it may not use: a clear error, at once.
    t0 = time.time()
    r = run(base + ["--checkpoint-dir", "s3://ckpt/denied"], s3.env(AWS_ACCESS_KEY_ID="NOT-A-KEY"))
    assert r.returncode != 0 and "InvalidAccessKeyId" in r.stderr + r.stdout and "s3://ckpt/" in r.stderr + r.stdout, \
        r.stdout[-2000:] + r.stderr[-2000:]
    assert time.time() - t0 < 30
    print("ok: an aws s3 cp upload of a POSIX checkpoint starts a run through --init-from (step and root), "
          "is listed by loom checkpoints --store, exported by export-hf and generates; "
          "wrong credentials stop loom-train at once")


def test_dataset_from_store(args, s3, tmp):
    """Token shards read from the store through the node's cache, keyed by CRC-32C."""
    text = os.path.join(tmp, "corpus.jsonl")
    write_word_corpus(text)
    ds = os.path.join(tmp, "ds")
    r = run([args.loom_data, "pack", "--output", ds, "--input", text, "--format", "jsonl",
             "--shard-tokens", "100000"], os.environ)
    assert r.returncode == 0, r.stdout + r.stderr
    index = json.load(open(os.path.join(ds, "index.json")))
    s3.aws("s3", "cp", "--recursive", ds, "s3://ckpt/datasets/words")
    cache = os.path.join(tmp, "data-cache")
    env = s3.env(OMP_NUM_THREADS="1", LOOM_CACHE_DIR=cache)
    argv = train_argv(args) + ["--set", "data.source=shards", "--set", "data.path=s3://ckpt/datasets/words"]

    def shard_gets():
        return [p for m, p in s3.requests if m == "GET" and p.startswith("/ckpt/datasets/words/shard-")]

    before = len(shard_gets())
    r = run(argv, env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert len(shard_gets()) - before == len(index["shards"]) >= 2, shard_gets()
    cached = sorted(os.listdir(os.path.join(cache, "objects")))
    width = 2 if index["dtype"] == "uint16" else 4
    assert cached == sorted(f"{e['crc32c']}-{e['tokens'] * width}" for e in index["shards"]), cached
    # Again: every shard from the cache; a damaged cached copy is fetched anew.
    with open(os.path.join(cache, "objects", cached[0]), "r+b") as f:
        f.write(b"\xff\xff")
    before = len(shard_gets())
    r = run(argv, env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert len(shard_gets()) - before == 1, shard_gets()[before:]
    # Damaged in the store (and not cached): refused, naming the object.
    shutil.rmtree(cache)
    path = s3.object_file("datasets/words/" + index["shards"][1]["file"])
    with open(path, "r+b") as f:
        f.write(b"\xff\xff")
    r = run(argv, env)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "s3://ckpt/datasets/words/" + index["shards"][1]["file"] in out, out[-2000:]
    s3.aws("s3", "cp", os.path.join(ds, index["shards"][1]["file"]),
           "s3://ckpt/datasets/words/" + index["shards"][1]["file"])
    print(f"ok: a dataset of {len(index['shards'])} shards trained from the store; a second run read "
          f"them from the cache (one damaged copy fetched again); a shard damaged in the store refused by name")


def test_serve_from_store(args, s3, tmp):
    """loom serve on a checkpoint in the store: one completion."""
    token_file, port_file = os.path.join(tmp, "serve-token"), os.path.join(tmp, "serve.port")
    with open(token_file, "w") as f:
        f.write("serve-token-0123456789abcdef\n")
    os.chmod(token_file, 0o600)
    log = open(os.path.join(tmp, "serve.log"), "w")
    p = subprocess.Popen([args.loom, "serve", "--port", "0", "--port-file", port_file, "--threads", "1",
                          "--token-file", token_file, "--checkpoint", "s3://ckpt/manual/step-00000004"],
                         env=s3.env(OMP_NUM_THREADS="1"), stdout=log, stderr=subprocess.STDOUT)
    PROCS.append(p)
    port = wait_for("loom serve to listen", lambda: p.poll() is None and read_port_file(port_file)
                    or (p.poll() is not None and -1), timeout=120)
    assert port != -1, open(os.path.join(tmp, "serve.log")).read()
    status, parsed, text = Api(port, "serve-token-0123456789abcdef").request(
        "POST", "/v1/completions", {"prompt": "ab", "max_tokens": 2})
    assert status == 200 and parsed["choices"][0]["text"] is not None, (status, text)
    p.send_signal(signal.SIGINT)
    assert p.wait(timeout=30) == 0
    print("ok: loom serve answered a completion from a checkpoint in the store")


def test_staging_disk_full(args, s3, tmp):
    """The staging directory full: the save fails with the reason; nothing reaches the store."""
    staging = os.path.join(tmp, "staging-full")
    os.makedirs(staging, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", staging], capture_output=True, text=True)
    if r.returncode != 0:
        print(f"skipped: staging on a full disk (cannot mount a tmpfs: {r.stderr.strip()})")
        return
    try:
        env = s3.env(OMP_NUM_THREADS="1", LOOM_STAGING_DIR=staging)
        r = run(train_argv(args) + ["--checkpoint-dir", "s3://ckpt/full", "--checkpoint-every", "2"], env)
        out = r.stdout + r.stderr
        assert r.returncode != 0 and "No space left on device" in out, out[-3000:]
        assert s3.keys("full/") == [], s3.keys("full/")
    finally:
        subprocess.run(["umount", staging])
    print("ok: a full staging directory fails the save with the reason; nothing reached the store")


def main():
    ap = argparse.ArgumentParser()
    for flag in ("loom", "loom-store", "loom-train", "loom-data", "source-dir"):
        ap.add_argument("--" + flag, required=True)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="loom-object-store-")
    s3 = S3Server(args.source_dir, tmp)
    box = None
    try:
        test_client(args, s3, tmp)
        test_init_from_aws_upload(args, s3, tmp)
        test_serve_from_store(args, s3, tmp)
        test_staging_disk_full(args, s3, tmp)
        test_dataset_from_store(args, s3, tmp)
        box = Box(args, s3, tmp)
        reference = test_job(box)
        test_retention_pins(box, reference)
        test_zero_job(box)
        test_job_on_stored_dataset(box)
        stop_loom_up(box.up)
    except BaseException:
        dump_loom_up(box and box.up)
        raise
    finally:
        stop_all(PROCS, tmp)
        s3.close()
    shutil.rmtree(tmp, ignore_errors=True)
    print("object store: all checks passed")


if __name__ == "__main__":
    main()

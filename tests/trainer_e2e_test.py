#!/usr/bin/env python3
"""The trainer as real processes on real files: bitwise-exact resume, kill -9 in the middle of
a checkpoint, a flipped byte in a shard, init-from lineage, and a live /metrics endpoint checked
by Debian's promtool. Every child process is killed on exit; every wait has a timeout."""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loom_testlib import kill_all, safetensors_raw, shard_path, step_losses, write_word_corpus  # noqa: E402

PROCS = []


def spec(tmp, name, **extra):
    s = {"preset": "micro", "steps": 40, "micro_batch": 4, "threads": 1,
         "data": {"corpus_bytes": 65536}, "eval": {"batches": 1},
         "checkpoint": {"dir": os.path.join(tmp, name), "interval": 10},
         "metrics": {"jsonl": os.path.join(tmp, name + ".jsonl"), "log_every": 1000}}
    s.update(extra)
    path = os.path.join(tmp, name + ".json")
    with open(path, "w") as f:
        json.dump(s, f)
    return path


def run(loom, args, env=None, expect_ok=True, timeout=300):
    p = subprocess.run([loom, "train"] + args, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})})
    if expect_ok and p.returncode != 0:
        raise AssertionError(f"{args} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def test_exact_resume(loom, tmp):
    run(loom, ["--spec", spec(tmp, "full")])
    run(loom, ["--spec", spec(tmp, "split"), "--stop-after", "20"])
    assert os.path.isdir(os.path.join(tmp, "split", "step-00000020"))
    assert not os.path.isdir(os.path.join(tmp, "split", "step-00000030"))
    p = run(loom, ["--spec", spec(tmp, "split"), "--resume", os.path.join(tmp, "split")])
    assert "resume:" in p.stdout and "at step 20" in p.stdout, p.stdout
    full, split = step_losses(os.path.join(tmp, "full.jsonl")), step_losses(os.path.join(tmp, "split.jsonl"))
    assert sorted(full) == list(range(1, 41)) and sorted(split) == list(range(1, 41)), (sorted(full), sorted(split))
    for step in range(1, 41):
        assert full[step] == split[step], f"step {step}: {full[step]} != {split[step]}"
    a = safetensors_raw(shard_path(os.path.join(tmp, "full", "step-00000040")))
    b = safetensors_raw(shard_path(os.path.join(tmp, "split", "step-00000040")))
    assert a.keys() == b.keys()
    for k in a:
        if k.startswith(("model.", "optim.")):
            assert a[k] == b[k], f"{k} differs after resume"
    print("exact resume: 40 losses and", len(a), "tensors bitwise equal")


def test_sigterm_checkpoints_and_resumes_exactly(loom, tmp):
    """SIGTERM (preemption, walltime): the step in flight finishes, a checkpoint is written at
    that step (not a multiple of the interval), the exit code is 76, and resuming from it gives
    the same losses as an uninterrupted run."""
    path = spec(tmp, "term", steps=100000, checkpoint={"dir": os.path.join(tmp, "term"), "interval": 100000})
    proc = subprocess.Popen([loom, "train", "--spec", path], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    PROCS.append(proc)
    jsonl = os.path.join(tmp, "term.jsonl")
    deadline = time.time() + 120
    while time.time() < deadline and len(step_losses(jsonl) if os.path.exists(jsonl) else {}) < 25:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 76, (proc.returncode, err[-2000:])
    stopped = int(re.search(r"stopped at step (\d+) on request \(SIGTERM\)", err).group(1))
    assert stopped >= 25 and os.path.isdir(os.path.join(tmp, "term", f"step-{stopped:08d}")), (stopped, os.listdir(os.path.join(tmp, "term")))
    target = stopped + 5
    run(loom, ["--spec", spec(tmp, "term-ref", steps=100000), "--stop-after", str(target)])
    p = run(loom, ["--spec", path, "--resume", os.path.join(tmp, "term"), "--stop-after", str(target)])
    assert f"at step {stopped}" in p.stdout, p.stdout
    ref, resumed = step_losses(os.path.join(tmp, "term-ref.jsonl")), step_losses(jsonl)
    for step in range(1, target + 1):
        assert ref[step] == resumed[step], f"step {step}: {ref[step]} != {resumed[step]}"
    print(f"SIGTERM: stopped at step {stopped} with a checkpoint (exit 76); resume matches bitwise to step {target}")


def test_kill_during_checkpoint(loom, tmp):
    path = spec(tmp, "crash")
    env = {**os.environ, "LOOM_TEST_CHECKPOINT_PAUSE": "20:60000"}
    p = subprocess.Popen([loom, "train", "--spec", path], stdout=subprocess.PIPE, text=True, env=env)
    PROCS.append(p)
    deadline = time.time() + 120
    for line in p.stdout:
        if "step 20 shards written, pausing before commit" in line:
            break
        assert time.time() < deadline, "never reached the checkpoint pause"
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    root = os.path.join(tmp, "crash")
    names = sorted(os.listdir(root))
    assert "step-00000010" in names and "step-00000020" not in names, names
    assert any(n.startswith(".tmp-step-20-") for n in names), names
    out = run(loom, ["--spec", path, "--resume", root]).stdout
    assert "removed 1 incomplete checkpoint" in out, out
    assert "step-00000010 at step 10" in out, out
    names = sorted(os.listdir(root))
    assert not any(n.startswith(".tmp") for n in names), names
    assert "step-00000040" in names, names
    print("kill -9 during checkpoint: partial ignored and cleaned, resumed from step 10")


def test_flipped_byte(loom, tmp):
    root = os.path.join(tmp, "full")
    shard = os.path.join(root, "step-00000040", "shard-00000-of-00001.safetensors")
    with open(shard, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        b = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x40]))
    out = run(loom, ["--spec", spec(tmp, "full", steps=45), "--resume", root]).stdout
    assert "skipping a damaged checkpoint" in out and "step-00000040/shard-00000-of-00001.safetensors" in out, out
    assert "checksum" in out, out
    assert "step-00000030 at step 30" in out, out
    print("flipped byte: named the shard, resumed from step 30")


def test_init_from_and_bad_inputs(loom, tmp):
    parent = os.path.join(tmp, "split", "step-00000040")
    out = run(loom, ["--spec", spec(tmp, "child", steps=5), "--init-from", parent]).stdout
    assert "init-from" in out, out
    with open(os.path.join(tmp, "child", "step-00000005", "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["parent"] == parent, manifest["parent"]
    assert manifest["state"]["optim.step"] == "5"
    # Resuming with a different model is refused by name.
    other = spec(tmp, "other", model={"n_layers": 3})
    p = run(loom, ["--spec", other, "--resume", os.path.join(tmp, "split")], expect_ok=False)
    assert p.returncode != 0 and "holds a different model" in p.stderr, p.stderr
    p = run(loom, ["--spec", spec(tmp, "x"), "--resume", os.path.join(tmp, "nothing-here")], expect_ok=False)
    assert p.returncode != 0 and "no complete checkpoint" in p.stderr, p.stderr
    bad = os.path.join(tmp, "bad.json")
    with open(bad, "w") as f:
        f.write('{"preset": "micro", "optimizer": {"lr": -1}}')
    p = run(loom, ["--spec", bad], expect_ok=False)
    assert p.returncode == 2 and "optimizer.lr" in p.stderr, p.stderr
    print("init-from lineage recorded; bad resume and spec refused by name")


def test_train_on_packed_shards(loom, loom_data, tmp):
    text = os.path.join(tmp, "corpus.jsonl")
    write_word_corpus(text)
    ds = os.path.join(tmp, "ds")
    p = subprocess.run([loom_data, "pack", "--output", ds, "--input", text, "--format", "jsonl",
                        "--shard-tokens", "50000"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "packed 3000 documents" in p.stdout, p.stdout
    path = spec(tmp, "shards", steps=60, data={"source": "shards", "path": ds},
                checkpoint={"dir": ""}, eval={"batches": 2})
    out = run(loom, ["--spec", path]).stdout
    assert "held out" in out, out
    m = re.search(r"eval loss: ([0-9.]+) -> ([0-9.]+)", out)
    assert m and float(m.group(2)) < float(m.group(1)) - 1.0, out
    # A model whose vocabulary is smaller than the dataset's is refused by name.
    small = spec(tmp, "small", model={"vocab_size": 100}, data={"source": "shards", "path": ds},
                 checkpoint={"dir": ""})
    p = run(loom, ["--spec", small], expect_ok=False)
    assert p.returncode != 0 and "model.vocab_size: 100 is smaller than the dataset's vocabulary 256" in p.stderr, p.stderr
    print(f"packed shards: trained, eval loss {m.group(1)} -> {m.group(2)}")


def test_live_metrics(loom, tmp, promtool):
    path = spec(tmp, "metrics", steps=100000, metrics={"port": -1, "log_every": 1000})
    p = subprocess.Popen([loom, "train", "--spec", path, "--name", "e2e"], stdout=subprocess.PIPE, text=True)
    PROCS.append(p)
    port = None
    deadline = time.time() + 60
    for line in p.stdout:
        m = re.search(r"metrics: http://127\.0\.0\.1:(\d+)/metrics", line)
        if m:
            port = int(m.group(1))
            break
        assert time.time() < deadline
    assert port, "no metrics port announced"
    body = ""
    while time.time() < deadline:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        m = re.search(r'loom_train_tokens_per_second\{job_id="e2e",rank="0"\} ([0-9.e+]+)', body)
        if m and float(m.group(1)) > 0:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("no positive tokens/s on /metrics:\n" + body)
    check = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr
    for name in ("loom_train_loss", "loom_train_learning_rate", "loom_train_grad_norm", "loom_train_step",
                 "loom_train_step_seconds_bucket", "loom_train_tokens_total"):
        assert name in body, name
    p.kill()
    p.wait(timeout=30)
    print("live /metrics: scraped, promtool check metrics passed")


def test_crafted_tokenizer(loom, loom_data, tmp):
    """A tokenizer.json whose added token has id 2^32 - 1 (it used to wrap the id table to size 0
    and write through a null pointer: SIGSEGV) or 2^31 + 5 (bad_alloc): loom-data refuses it (exit
    1: a bad input file; 2 is for a wrong command line) and loom-train too, as bad input (exit 2,
    the contract the agent fails a job by without retrying), both naming the field and value."""
    vocab, nxt = {}, 256
    for b in range(256):
        direct = ord("!") <= b <= ord("~") or 0xA1 <= b <= 0xAC or b >= 0xAE
        vocab[chr(b if direct else nxt)] = b
        nxt += 0 if direct else 1
    text = os.path.join(tmp, "lines.b64")
    with open(text, "w") as f:
        f.write("aGVsbG8=\n")
    for bad in (4294967295, 2 ** 31 + 5):
        tok = os.path.join(tmp, f"tokenizer-{bad}.json")
        with open(tok, "w") as f:
            json.dump({"added_tokens": [{"id": bad, "content": "<|x|>"}],
                       "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False},
                       "model": {"type": "BPE", "vocab": vocab, "merges": []}}, f)
        p = subprocess.run([loom_data, "encode", "--tokenizer", tok, "--input", text],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 1 and f"added_tokens[0].id: {bad} is not a token id" in p.stderr, \
            (p.returncode, p.stderr)
        path = spec(tmp, f"crafted-{bad}", data={"tokenizer": "bpe", "tokenizer_path": tok},
                    checkpoint={"dir": ""})
        p = run(loom, ["--spec", path], expect_ok=False)
        assert p.returncode == 2 and "added_tokens[0].id" in p.stderr, (p.returncode, p.stderr[-2000:])
    print("crafted tokenizer.json (ids 2^32 - 1, 2^31 + 5): refused by name (loom-data exit 1, "
          "loom-train exit 2: bad input), no crash")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loom-train", required=True)
    ap.add_argument("--loom-data", required=True)
    ap.add_argument("--promtool", default=shutil.which("promtool") or "promtool")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="loom_e2e_")
    try:
        test_exact_resume(args.loom_train, tmp)
        test_kill_during_checkpoint(args.loom_train, tmp)
        test_sigterm_checkpoints_and_resumes_exactly(args.loom_train, tmp)
        test_flipped_byte(args.loom_train, tmp)
        test_init_from_and_bad_inputs(args.loom_train, tmp)
        test_train_on_packed_shards(args.loom_train, args.loom_data, tmp)
        test_crafted_tokenizer(args.loom_train, args.loom_data, tmp)
        test_live_metrics(args.loom_train, tmp, args.promtool)
    finally:
        kill_all(PROCS)
        shutil.rmtree(tmp, ignore_errors=True)
    print("trainer e2e: ok")


if __name__ == "__main__":
    sys.exit(main())

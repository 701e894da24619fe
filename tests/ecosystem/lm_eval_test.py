#!/usr/bin/env python3
"""lm-evaluation-harness against `loom serve` (issue 72, item 4; docs/serve.md). Run with the
Python of .tools/torch (lm-eval 0.4.13, pinned in scripts/pins/torch.txt), offline.

A small chat model is trained (SFT) and exported with `export-hf` (for its tokenizer.json). lm-eval runs the
two tasks of tests/ecosystem/lm_eval_tasks/ against loom-serve:
* loom_mc (loglikelihood multiple choice, local-completions, the tokenizer from the export-hf
  folder): every (item, choice) loglikelihood equals the sum of `loom-train score`'s token
  log-probabilities of the choice within 2e-4 per token, and lm-eval's accuracy equals the one
  Loom's own scores give, exactly.
* loom_gen (generate_until, local-chat-completions with --apply_chat_template): every answer
  equals `loom-train generate --chat --greedy` cut at the stop sequence, and lm-eval's exact-match
  accuracy equals the one those answers give, exactly.
A failure names the item, the choice and the two values.
"""
import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "interop"))
from hf_interop_test import Loom, run  # noqa: E402
from loom_testlib import kill_all, read_port_file  # noqa: E402

TASKS = os.path.join(HERE, "lm_eval_tasks")
PER_TOKEN = 2e-4  # loom-serve's log-probabilities against loom-train score's (docs/serve.md)
MODEL_ID = "loom-tiny"


def train_sft(loom, tmp):
    """A small chat model (SFT on the built-in arithmetic conversations, byte tokenizer with chat
    tokens): chat completions need a chat template, and the same model serves completions."""
    root = os.path.join(tmp, "sft")
    spec = {"kind": "sft", "preset": "micro", "steps": 60, "micro_batch": 8, "seq_len": 96, "threads": 1,
            "model": {"d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 128, "vocab_size": 260},
            "data": {"source": "chat", "task": "arithmetic", "task_options": {"count": "500", "ops": "1"}},
            "optimizer": {"lr": 0.003, "warmup_steps": 5}, "eval": {"batches": 1},
            "checkpoint": {"dir": root, "interval": 60}}
    path = os.path.join(tmp, "sft.json")
    json.dump(spec, open(path, "w"))
    run([loom.train_bin, "train", "--spec", path])
    return max((os.path.join(root, d) for d in os.listdir(root) if d.startswith("step-")), key=os.path.basename)


def start_serve(serve_bin, step, tmp, procs):
    port_file = os.path.join(tmp, "serve.port")
    log = open(os.path.join(tmp, "serve.log"), "w")
    p = subprocess.Popen([serve_bin, "--checkpoint", step, "--port", "0", "--port-file", port_file,
                          "--threads", "1", "--model-name", MODEL_ID], stdout=log, stderr=subprocess.STDOUT)
    procs.append(p)
    deadline = time.time() + 60
    while time.time() < deadline and p.poll() is None and not read_port_file(port_file):
        time.sleep(0.1)
    assert read_port_file(port_file), f"loom-serve did not start: {open(log.name).read()[-2000:]}"
    return read_port_file(port_file)


def lm_eval(tmp, model, model_args, task, *extra):
    """Runs lm-eval offline on one task; returns (accuracy metric dict, per-sample records)."""
    out = os.path.join(tmp, "lm-eval-" + task)
    env = {**os.environ, "HF_HOME": os.path.join(tmp, "hf"), "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OPENAI_API_KEY": "unused"}
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", task,
           "--include_path", TASKS, "--output_path", out, "--log_samples", "--batch_size", "1", *extra]
    p = subprocess.run(cmd, cwd=TASKS, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"lm_eval {task}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    results = json.load(open(sorted(glob.glob(os.path.join(out, "**", "results_*.json"), recursive=True))[-1]))
    samples_file = sorted(glob.glob(os.path.join(out, "**", f"samples_{task}_*.jsonl"), recursive=True))[-1]
    samples = [json.loads(line) for line in open(samples_file)]
    return results["results"][task], sorted(samples, key=lambda s: s["doc_id"])


def request_args(sample):
    """A logged sample's requests as argument tuples: lm-eval 0.4.13 logs them as
    {"gen_args_0": {"arg_0": context, "arg_1": continuation}, ...}."""
    args = sample["arguments"]
    if isinstance(args, dict):
        return [tuple(a[k] for k in sorted(a)) for _, a in sorted(args.items(), key=lambda kv: int(kv[0].split("_")[-1]))]
    return [tuple(a) for a in args]


def loom_loglikelihood(loom, step, context, continuation):
    """The sum of loom-train score's log-probabilities of continuation's bytes after context's (the
    byte tokenizer: a token per byte)."""
    ctx, cont = list(context.encode()), list(continuation.encode())
    doc = json.loads(run([loom.train_bin, "score", "--checkpoint", step, "--tokens",
                          ",".join(map(str, ctx + cont)), "--threads", "1"]).stdout)
    logprobs = doc["logprobs"] if "logprobs" in doc else doc["token_logprobs"]
    return sum(logprobs[len(ctx):]), len(cont)


def test_multiple_choice(loom, step, folder, port, tmp):
    metrics, samples = lm_eval(tmp, "local-completions",
                               f"model={MODEL_ID},base_url=http://127.0.0.1:{port}/v1/completions,"
                               f"tokenizer={folder},tokenizer_backend=huggingface,max_length=128,"
                               "num_concurrent=1,max_retries=1", "loom_mc")
    correct, worst = 0, 0.0
    for s in samples:
        doc = s["doc"]
        ours = []
        for choice_index, ((context, continuation), resp) in enumerate(zip(request_args(s), s["resps"])):
            theirs = float(resp[0][0])
            mine, n = loom_loglikelihood(loom, step, context, continuation)
            ours.append(mine)
            diff = abs(theirs - mine)
            worst = max(worst, diff / n)
            assert diff <= PER_TOKEN * n, (f"loom_mc item {doc['id']}, choice {choice_index} "
                                           f"{continuation!r}: lm-eval's loglikelihood {theirs:.6f}, "
                                           f"loom-train score's {mine:.6f} ({n} tokens)")
        correct += int(max(range(len(ours)), key=lambda i: ours[i]) == doc["label"])
    ours_acc, theirs_acc = correct / len(samples), metrics["acc,none"]
    assert ours_acc == theirs_acc, f"loom_mc accuracy: lm-eval {theirs_acc}, Loom's own scores {ours_acc}"
    print(f"ok: lm-eval local-completions on loom serve: {len(samples)} items x 4 choices, every loglikelihood "
          f"equals loom-train score's (worst {worst:.1e} per token); accuracy {theirs_acc:.4f} both")


def test_generate(loom, step, port, tmp):
    metrics, samples = lm_eval(tmp, "local-chat-completions",
                               f"model={MODEL_ID},base_url=http://127.0.0.1:{port}/v1/chat/completions,"
                               "num_concurrent=1,max_retries=1", "loom_gen", "--apply_chat_template")
    correct = 0
    for s in samples:
        doc = s["doc"]
        theirs = s["resps"][0][0]
        out = json.loads(run([loom.train_bin, "generate", "--checkpoint", step, "--chat", doc["question"],
                              "--greedy", "--max-new-tokens", "8", "--threads", "1"]).stdout)
        text = out.get("text") if "text" in out else out["completions"][0]["text"]
        mine = text.split("\n")[0]
        assert theirs == mine, f"loom_gen item {doc['id']}: lm-eval got {theirs!r}, loom-train generate {mine!r}"
        correct += int(mine == doc["answer"])
    ours_acc, theirs_acc = correct / len(samples), metrics["exact_match,none"]
    assert ours_acc == theirs_acc, f"loom_gen accuracy: lm-eval {theirs_acc}, Loom's own answers {ours_acc}"
    print(f"ok: lm-eval local-chat-completions on loom serve: {len(samples)} answers equal loom-train generate "
          f"--chat --greedy's; exact match {theirs_acc:.4f} both")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loom-train", required=True)
    ap.add_argument("--loom-data", required=True)
    ap.add_argument("--loom-serve", required=True)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="loom-lm-eval-")
    procs = []
    try:
        loom = Loom(args, tmp)
        step = train_sft(loom, tmp)
        folder = os.path.join(tmp, "tiny-hf")
        loom.export(step, folder)
        port = start_serve(args.loom_serve, step, tmp, procs)
        test_multiple_choice(loom, step, folder, port, tmp)
        test_generate(loom, step, port, tmp)
    finally:
        kill_all(procs)
        shutil.rmtree(tmp, ignore_errors=True)
    print("lm_eval_test: ok")


if __name__ == "__main__":
    main()

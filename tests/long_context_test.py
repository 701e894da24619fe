#!/usr/bin/env python3
"""Long-context fine-tuning end to end (docs/long-context.md): pretrain the paper's hybrid stack
(4 local IHA layers : 1 global MHA) on the needle task at 256 tokens, then fine-tune it with
init_from at 4096 tokens with RoPE base-frequency scaling (rope_theta 10000 -> 160000) and
activation checkpointing, and report its needle accuracy at 256, 1024, 2048 and 4096 tokens from
the job's own held-out evaluations (eval.lengths). Checks that the weights came from the 256-token checkpoint (lineage in the
manifest), that the fine-tune's model differs only in max_seq_len, rope_theta and
activation_checkpointing, that a 4096-token step runs, and that the eval reports accuracy.
The accuracy itself is printed, not asserted: a CPU-sized model does not learn retrieval in a
few steps (docs/long-context.md says what the numbers were)."""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HYBRID = {"local_per_global": 4, "iha_options": {"p": 2}}
LENGTHS = [256, 1024, 2048]  # eval.lengths: the needle evaluation at these lengths too


def train(loom_train, spec, tmp, name, extra=(), timeout=900):
    path = os.path.join(tmp, name + ".json")
    with open(path, "w") as f:
        json.dump(spec, f)
    p = subprocess.run([loom_train, "train", "--spec", path, *extra], capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, f"{name} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    return p.stdout


def events(jsonl, kind):
    with open(jsonl) as f:
        return [e for e in map(json.loads, f) if e.get("event") == kind]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loom-train", required=True)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="loom-long-context-") as tmp:
        short_model = {"d_model": 64, "n_layers": 5, "n_heads": 4, "vocab_size": 256,
                       "max_seq_len": 256, "rope_theta": 10000, "tie_embeddings": True,
                       "hybrid": HYBRID}
        # One thread, as in the other suites: two beside another busy test starve both
        # (docs/testing.md, "CI time").
        base = {"threads": 1, "optimizer": {"lr": 0.003, "warmup_steps": 5},
                "data": {"source": "task", "task": "needle"}}
        train(a.loom_train, {**base, "model": short_model, "steps": 40, "micro_batch": 8,
                             "seq_len": 256, "checkpoint": {"dir": os.path.join(tmp, "short")}},
              tmp, "short")

        long_model = {**short_model, "max_seq_len": 4096, "rope_theta": 160000,
                      "activation_checkpointing": "full"}
        jsonl = os.path.join(tmp, "long.jsonl")
        out = train(a.loom_train, {**base, "model": long_model, "steps": 3, "micro_batch": 1,
                                   "optimizer": {"lr": 0.001, "warmup_steps": 1},
                                   "seq_len": 4096, "eval": {"batches": 2, "lengths": LENGTHS},
                                   "checkpoint": {"dir": os.path.join(tmp, "long")},
                                   "metrics": {"jsonl": jsonl, "log_every": 1}},
                    tmp, "long", ["--init-from", os.path.join(tmp, "short")])
        assert "init-from: weights of" in out, out
        evals = events(jsonl, "eval")
        at_length = {e["length"]: e for e in evals if "length" in e}
        assert sorted(at_length) == LENGTHS, evals
        last = [e for e in evals if "length" not in e][-1]
        for e in [last, *at_length.values()]:
            assert 0.0 <= e["accuracy"] <= 1.0 and e["eval_loss"] > 0, e
        for length in LENGTHS:
            assert f"eval at length {length}: loss" in out, out
        step = sorted(d for d in os.listdir(os.path.join(tmp, "long")) if d.startswith("step-"))[-1]
        with open(os.path.join(tmp, "long", step, "manifest.json")) as f:
            manifest = json.load(f)
        assert "short" in manifest["parent"], manifest["parent"]
        spec = json.loads(manifest["state"]["spec"])
        assert spec["model"]["max_seq_len"] == 4096 and spec["model"]["rope_theta"] == 160000, spec
        assert spec["model"]["activation_checkpointing"] == "full", spec["model"]
        report = ", ".join(f"{n}: loss {e['eval_loss']:.3f} accuracy {e['accuracy']:.3f}"
                           for n, e in [*sorted(at_length.items()), (4096, last)])
        print(f"ok: 256 -> 4096 tokens (rope_theta x16, full activation checkpointing); "
              f"needle eval by length: {report}")
    print("long_context_test: ok")


if __name__ == "__main__":
    sys.exit(main())

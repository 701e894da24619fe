#!/usr/bin/env python3
"""Hugging Face transformers meets Loom (issue 72, item 3; docs/interop.md). Run with the Python of
.tools/torch (transformers 5.25 and torch 2.15, pinned in scripts/pins/torch.txt), offline:

* Folders written by `loom-train export-hf` load with AutoModelForCausalLM (local_files_only):
  Llama (global attention), Mistral (sliding window) and Loom-IHA (its modeling_loom_iha.py, with
  trust_remote_code). Their logits on fixed prompts equal `loom-train logits` within 2e-5 of the
  largest logit, both in float32, and greedy `generate` gives the same 16 tokens as
  `loom-train generate --greedy`. (float32 only: transformers' RMSNorm computes in float32 even in
  a float64 model, so it is no float64 reference; tests/interop/hf_interop_test.py checks Loom
  against float64 equations.)
* A small Llama and a small Mistral made by transformers with random weights and written with
  save_pretrained import with `loom-train import-hf`, and Loom's logits equal transformers' to the
  same tolerances.

A failure names what differed: the model, the dtype, the prompt, and the token index and logit
(or the first generated token) where it did.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch
import transformers

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "interop"))
from hf_interop_test import Loom, run  # noqa: E402

PROMPTS = {"mixed": [(i * 37 + 11) % 256 for i in range(40)],  # 40 > every window below
           "short": [72, 101, 108, 108, 111],
           "repeats": [7, 7, 7, 200, 13, 7, 7, 7, 200, 13, 1, 2, 3]}
TOLERANCE = 2e-5  # of the largest |logit|, float32
NEW_TOKENS = 16


def compare_logits(what, loom_logits, hf_logits):
    """Asserts max |diff| <= tolerance x max |logit|; names the token and vocabulary index."""
    ref = hf_logits.to(torch.float64)
    got = loom_logits.to(torch.float64)
    assert got.shape == ref.shape, f"{what}: Loom's logits {tuple(got.shape)}, transformers' {tuple(ref.shape)}"
    scale = ref.abs().max().item()
    diff = (got - ref).abs()
    err = diff.max().item()
    if err > TOLERANCE * scale:
        t, v = divmod(int(diff.argmax()), ref.shape[1])
        raise AssertionError(f"{what}: token {t}, logit {v}: Loom {got[t, v].item():.9g}, "
                             f"transformers {ref[t, v].item():.9g} (|diff| {err:.3g} > "
                             f"{TOLERANCE:g} x largest logit {scale:.3g})")
    return err / scale


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def loom_generate(loom, step, ids):
    out = run([loom.train_bin, "generate", "--checkpoint", step, "--prompt-tokens", ",".join(map(str, ids)),
               "--greedy", "--max-new-tokens", str(NEW_TOKENS), "--threads", "1"]).stdout
    doc = json.loads(out)
    tokens = doc.get("tokens") or doc.get("completions", [{}])[0].get("tokens")
    assert isinstance(tokens, list), f"loom-train generate printed no token list: {out[:400]}"
    return tokens[-NEW_TOKENS:] if len(tokens) > NEW_TOKENS else tokens


def hf_generate(model, ids):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


def load(folder, remote=False):
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, local_files_only=True, trust_remote_code=remote, dtype=torch.float32,
        attn_implementation="eager").eval()


def check_folder(loom, what, step, folder, remote=False, generate=True):
    """transformers' logits (each prompt) and greedy tokens against Loom's; the largest relative
    difference of the logits."""
    model = load(folder, remote)
    worst = 0.0
    for name, ids in PROMPTS.items():
        rel = compare_logits(f"{what}, prompt {name}", loom.logits(step, ids, "float32"), hf_logits(model, ids))
        worst = max(worst, rel)
    if generate:
        for name, ids in PROMPTS.items():
            want, got = hf_generate(model, ids), loom_generate(loom, step, ids)
            if want != got:
                first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
                raise AssertionError(f"{what}, prompt {name}: greedy generation differs at new token {first}: "
                                     f"transformers {want}, Loom {got}")
    return worst


def test_exports(loom):
    base = {"d_model": 32, "n_layers": 2, "n_heads": 4, "ffn_activation": "swiglu", "max_seq_len": 64,
            "tie_embeddings": False}
    iha_local = {"plugin": "iha", "window": 8, "options": {"p": 2}}
    iha_global = {"plugin": "iha", "options": {"p": 3, "mask": "block", "rope_phase": "token"}}
    cases = [
        ("Llama", {**base, "schedule": [{"repeat": 1, "attention": {"plugin": "mha"}}]}, False),
        ("Mistral", {**base, "tie_embeddings": True,
                     "schedule": [{"repeat": 1, "attention": {"plugin": "local", "window": 8}}]}, False),
        ("Loom-IHA", {"d_model": 32, "n_layers": 3, "n_heads": 4, "max_seq_len": 64, "attention_bias": True,
                      "tie_embeddings": False,
                      "schedule": [{"repeat": 1, "attention": iha_local}, {"repeat": 1, "attention": iha_global},
                                   {"repeat": 1, "attention": {"plugin": "mha"}}]}, True),
    ]
    for what, model, remote in cases:
        step = loom.train(what.lower(), model, steps=20)
        folder = os.path.join(loom.tmp, what.lower() + "-hf")
        loom.export(step, folder)
        worst = check_folder(loom, f"export-hf {what}", step, folder, remote)
        print(f"ok: export-hf {what} loads in transformers {transformers.__version__}"
              f"{' (trust_remote_code)' if remote else ''}: logits equal loom-train's on {len(PROMPTS)} prompts "
              f"(relative {worst:.1e}); greedy generate gives "
              f"loom-train generate's {NEW_TOKENS} tokens")


def test_imports(loom):
    common = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, head_dim=8, max_position_embeddings=64,
                  rms_norm_eps=1e-6, tie_word_embeddings=False)
    cases = [("Llama", transformers.LlamaConfig(**common, rope_parameters={"rope_type": "default",
                                                                           "rope_theta": 500000.0}),
              transformers.LlamaForCausalLM),
             ("Mistral", transformers.MistralConfig(**common, sliding_window=8), transformers.MistralForCausalLM)]
    for what, config, cls in cases:
        torch.manual_seed(11)
        model = cls(config)
        folder = os.path.join(loom.tmp, "made-" + what.lower())
        model.save_pretrained(folder)
        step = loom.import_hf(folder, folder + "-ckpt")
        worst = check_folder(loom, f"import-hf of transformers' {what}", step, folder, generate=False)
        print(f"ok: a random {what} saved by transformers imports with import-hf: Loom's logits equal "
              f"transformers' (relative {worst:.1e})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loom-train", required=True)
    ap.add_argument("--loom-data", required=True)
    args = ap.parse_args()
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="loom-transformers-")
    try:
        loom = Loom(args, tmp)
        test_exports(loom)
        test_imports(loom)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("transformers_test: ok")


if __name__ == "__main__":
    main()

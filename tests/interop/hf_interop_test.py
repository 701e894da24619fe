#!/usr/bin/env python3
"""Hugging Face interop end to end (docs/interop.md): `loom-train export-hf`, `import-hf` and
`logits` against independent Python.

* A trained global-attention SwiGLU model exports as LlamaForCausalLM and a sliding-window one as
  MistralForCausalLM; the logits of the Llama/Mistral equations written here (transformers'
  LlamaModel: rotate-half RoPE, causal or sliding-window mask q - k < W, RMSNorm, SwiGLU) from
  the exported files equal Loom's forward: float64 to 1e-9 relative, float32 to 2e-5 of the
  largest logit.
* An IHA stack (local IHA, global IHA with the block mask and token RoPE phase, GELU FFN,
  biases) exports as LoomIhaForCausalLM; the folder's own modeling_loom_iha.py, run with plain
  torch, gives Loom's logits to the same tolerances.
* Import of each export reproduces the checkpoint's weights bit for bit.
* A Llama folder made here (random weights, head_dim != hidden/heads) imports into a checkpoint
  whose logits are the Python Llama's; the same weights in Meta's interleaved RoPE pairing
  import with --rope-pairing interleaved to the same logits (and without it, not); the import
  trains further with --init-from.
* The byte tokenizer's tokenizer.json is GPT-2's byte alphabet (id = byte) and loom-data encodes
  with it to the raw bytes.
* Hostile input: an export into a non-empty folder and an import of grouped-query attention fail
  with the reason named.
"""
import argparse
import base64
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from loom_testlib import safetensors_raw  # noqa: E402

DTYPES = {"F64": torch.float64, "F32": torch.float32}
TOKENS = [(i * 37 + 11) % 256 for i in range(40)]  # 40 > every window below


def run(cmd, expect_ok=True):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if expect_ok and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def tensors_of(path):
    out = {}
    for name, (dtype, shape, raw) in safetensors_raw(path).items():
        out[name] = torch.frombuffer(bytearray(raw), dtype=DTYPES[dtype]).reshape(shape).clone()
    return out


def folder_tensors(folder):
    index = os.path.join(folder, "model.safetensors.index.json")
    if not os.path.exists(index):
        return tensors_of(os.path.join(folder, "model.safetensors"))
    out = {}
    for f in sorted(set(json.load(open(index))["weight_map"].values())):
        out.update(tensors_of(os.path.join(folder, f)))
    return out


def newest_step(root):
    return os.path.join(root, sorted(d for d in os.listdir(root) if d.startswith("step-"))[-1])


def model_bytes(step_dir):
    """name -> raw bytes of the model.* tensors of a checkpoint directory."""
    out = {}
    for f in os.listdir(step_dir):
        if f.endswith(".safetensors"):
            for name, (_, _, raw) in safetensors_raw(os.path.join(step_dir, f)).items():
                if name.startswith("model."):
                    out[name] = raw
    return out


# ---- The Llama / Mistral equations, as transformers' LlamaModel computes them ----------------

def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, theta):  # x [H, N, d], rotate-half pairing, angles in float64
    d, n = x.shape[-1], x.shape[-2]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def llama_logits(cfg, w, ids, dtype):
    w = {k: v.to(dtype) for k, v in w.items()}
    heads, d = cfg["num_attention_heads"], cfg["head_dim"]
    eps, theta, window = cfg["rms_norm_eps"], cfg["rope_theta"], cfg.get("sliding_window") or 0
    n = len(ids)
    h = w["model.embed_tokens.weight"][torch.tensor(ids)]
    qi, ki = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = ki <= qi
    if window:
        allowed &= (qi - ki) < window
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."

        def proj(name, x):
            out = x @ w[p + name + ".weight"].T
            return out + w[p + name + ".bias"] if p + name + ".bias" in w else out

        x = rms_norm(h, w[p + "input_layernorm.weight"], eps)
        q, k, v = (proj(f"self_attn.{c}_proj", x).view(n, heads, d).transpose(0, 1) for c in "qkv")
        q, k = rope(q, theta), rope(k, theta)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        scores = scores.masked_fill(~allowed, float("-inf"))
        attended = (torch.softmax(scores, -1) @ v).transpose(0, 1).reshape(n, heads * d)
        h = h + proj("self_attn.o_proj", attended)
        x = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
        act = torch.nn.functional.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)
        h = h + act @ w[p + "mlp.down_proj.weight"].T
    h = rms_norm(h, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else w["lm_head.weight"]
    return h @ head.T


# ---- Loom ---------------------------------------------------------------------------------

class Loom:
    def __init__(self, args, tmp):
        self.train_bin, self.data_bin, self.tmp = args.loom_train, args.loom_data, tmp

    def train(self, name, model, steps=3):
        root = os.path.join(self.tmp, name)
        spec = {"preset": "micro", "model": model, "steps": steps, "micro_batch": 2, "seq_len": 32,
                "threads": 1, "data": {"corpus_bytes": 65536}, "eval": {"batches": 1},
                "checkpoint": {"dir": root, "interval": steps}}
        path = os.path.join(self.tmp, name + ".json")
        json.dump(spec, open(path, "w"))
        run([self.train_bin, "train", "--spec", path])
        return newest_step(root)

    def logits(self, checkpoint, ids, dtype):
        out = os.path.join(self.tmp, f"logits-{len(os.listdir(self.tmp))}.safetensors")
        run([self.train_bin, "logits", "--checkpoint", checkpoint, "--tokens", ",".join(map(str, ids)),
             "--dtype", dtype, "--output", out, "--threads", "1"])
        return tensors_of(out)["logits"]

    def export(self, checkpoint, out, *extra):
        return run([self.train_bin, "export-hf", "--checkpoint", checkpoint, "--out", out, *extra]).stdout

    def import_hf(self, folder, out, *extra):
        run([self.train_bin, "import-hf", "--from", folder, "--out", out, *extra])
        return newest_step(out)


def assert_close(loom, ref, dtype, what):
    ref = ref.to(loom.dtype)
    assert loom.shape == ref.shape, (what, loom.shape, ref.shape)
    scale = ref.abs().max().item()
    err = (loom - ref).abs().max().item()
    tol = 1e-9 * scale if dtype == "float64" else 2e-5 * scale
    assert err <= tol, f"{what} ({dtype}): max |diff| {err:.3g} > {tol:.3g} (largest logit {scale:.3g})"
    return err / scale


def check_round_trip(loom, step_dir, folder, what):
    back = loom.import_hf(folder, folder + "-back")
    original, imported = model_bytes(step_dir), model_bytes(back)
    assert original.keys() == imported.keys(), (what, original.keys() ^ imported.keys())
    changed = [n for n in original if original[n] != imported[n]]
    assert not changed, f"{what}: import changed {changed}"
    return back


def test_llama_and_mistral_exports(loom):
    base = {"d_model": 32, "n_layers": 2, "n_heads": 4, "ffn_activation": "swiglu", "max_seq_len": 64,
            "tie_embeddings": False}
    cases = [("llama", {**base, "schedule": [{"repeat": 1, "attention": {"plugin": "mha"}}]}, "LlamaForCausalLM"),
             ("mistral", {**base, "tie_embeddings": True,
                          "schedule": [{"repeat": 1, "attention": {"plugin": "local", "window": 8}}]},
              "MistralForCausalLM")]
    for name, model, arch in cases:
        step = loom.train(name, model)
        folder = os.path.join(loom.tmp, name + "-hf")
        out = loom.export(step, folder)
        assert arch in out, out
        cfg = json.load(open(os.path.join(folder, "config.json")))
        assert cfg["architectures"] == [arch], cfg
        w = folder_tensors(folder)
        errors = []
        for dtype, torch_dtype in (("float64", torch.float64), ("float32", torch.float32)):
            errors.append(assert_close(loom.logits(step, TOKENS, dtype), llama_logits(cfg, w, TOKENS, torch_dtype),
                                       dtype, f"{arch} export"))
        if name == "mistral":  # the window matters at 40 tokens: without it the logits differ
            unwindowed = llama_logits({**cfg, "sliding_window": None}, w, TOKENS, torch.float64)
            assert (loom.logits(step, TOKENS, "float64") - unwindowed).abs().max() > 1e-3
        check_round_trip(loom, step, folder, arch)
        print(f"ok: {arch}: Python's {arch.replace('ForCausalLM', '')} equations give Loom's logits "
              f"(relative max diff {errors[0]:.1e} float64, {errors[1]:.1e} float32); import is bitwise")
    return step, folder


def load_modeling(folder):
    spec = importlib.util.spec_from_file_location("modeling_loom_iha", os.path.join(folder, "modeling_loom_iha.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_iha_export(loom):
    iha_local = {"plugin": "iha", "window": 8, "options": {"p": 2}}
    iha_global = {"plugin": "iha", "options": {"p": 3, "mask": "block", "rope_phase": "token"}}
    model = {"d_model": 32, "n_layers": 3, "n_heads": 4, "max_seq_len": 64, "attention_bias": True,
             "tie_embeddings": False,
             "schedule": [{"repeat": 1, "attention": iha_local}, {"repeat": 1, "attention": iha_global},
                          {"repeat": 1, "attention": {"plugin": "mha"}}]}
    step = loom.train("iha", model)
    folder = os.path.join(loom.tmp, "iha-hf")
    out = loom.export(step, folder, "--max-shard-bytes", "20000")
    assert "LoomIhaForCausalLM" in out and os.path.exists(os.path.join(folder, "model.safetensors.index.json")), out
    cfg = json.load(open(os.path.join(folder, "config.json")))
    assert [l["kind"] for l in cfg["loom_layers"]] == ["iha", "iha", "mha"], cfg
    modeling = load_modeling(folder)
    errors = []
    for dtype, torch_dtype in (("float64", torch.float64), ("float32", torch.float32)):
        py = modeling.LoomIhaForCausalLM.from_pretrained(folder, dtype=torch_dtype)
        with torch.no_grad():
            ref = py(torch.tensor([TOKENS])).logits[0]
        errors.append(assert_close(loom.logits(step, TOKENS, dtype), ref, dtype, "LoomIhaForCausalLM export"))
    check_round_trip(loom, step, folder, "LoomIhaForCausalLM")
    print(f"ok: LoomIhaForCausalLM (local IHA P=2, global IHA P=3 block/token, MHA; GELU, biases; sharded): "
          f"modeling_loom_iha.py gives Loom's logits (relative max diff {errors[0]:.1e} float64, "
          f"{errors[1]:.1e} float32); import is bitwise")


def write_folder(folder, cfg, tensors):
    """A transformers-style folder: config.json and model.safetensors (float32)."""
    os.makedirs(folder)
    json.dump(cfg, open(os.path.join(folder, "config.json"), "w"))
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in tensors.items():
        raw = t.contiguous().to(torch.float32).numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(os.path.join(folder, "model.safetensors"), "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head + b"".join(blobs))


def to_meta_pairing(w, heads, d):
    """transformers' convert_llama_weights_to_hf.py permutes Meta's q/k rows into rotate-half
    order; this is its inverse: row c*d/2 + i of a head goes back to row 2i + c."""
    rows = w.shape[0]
    return w.view(heads, 2, d // 2, -1).transpose(1, 2).reshape(rows, -1)


def test_import_llama_folder(loom):
    torch.manual_seed(3)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 24,
           "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8, "num_hidden_layers": 2,
           "intermediate_size": 40, "vocab_size": 300, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
           "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu", "rope_scaling": None,
           "torch_dtype": "float32"}
    D, H, d, F, V = 24, 4, 8, 40, 300
    w = {"model.embed_tokens.weight": torch.randn(V, D), "model.norm.weight": 1 + 0.1 * torch.randn(D),
         "lm_head.weight": torch.randn(V, D) / math.sqrt(D)}
    for i in range(2):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + 0.1 * torch.randn(D)
        w[p + "post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(D)
        for c in "qkv":
            w[p + f"self_attn.{c}_proj.weight"] = torch.randn(H * d, D) / math.sqrt(D)
        w[p + "self_attn.o_proj.weight"] = torch.randn(D, H * d) / math.sqrt(H * d)
        w[p + "mlp.gate_proj.weight"] = torch.randn(F, D) / math.sqrt(D)
        w[p + "mlp.up_proj.weight"] = torch.randn(F, D) / math.sqrt(D)
        w[p + "mlp.down_proj.weight"] = torch.randn(D, F) / math.sqrt(F)
    folder = os.path.join(loom.tmp, "made-llama")
    write_folder(folder, cfg, w)
    ref = llama_logits(cfg, w, TOKENS, torch.float64)
    step = loom.import_hf(folder, os.path.join(loom.tmp, "made-llama-ckpt"))
    err = assert_close(loom.logits(step, TOKENS, "float64"), ref, "float64", "imported Llama folder")

    meta = {k: (to_meta_pairing(v, H, d) if k.endswith(("q_proj.weight", "k_proj.weight")) else v)
            for k, v in w.items()}
    meta_folder = os.path.join(loom.tmp, "made-llama-meta")
    write_folder(meta_folder, cfg, meta)
    meta_step = loom.import_hf(meta_folder, os.path.join(loom.tmp, "made-llama-meta-ckpt"),
                               "--rope-pairing", "interleaved")
    assert_close(loom.logits(meta_step, TOKENS, "float64"), ref, "float64", "Meta-pairing import")
    wrong = loom.import_hf(meta_folder, os.path.join(loom.tmp, "made-llama-meta-wrong"))
    assert (loom.logits(wrong, TOKENS, "float64") - ref).abs().max() > 1e-3, "the pairing must matter"

    # The import is a starting point: a job trains from it (weights only).
    ckpt_root = os.path.join(loom.tmp, "made-llama-ckpt")
    model = json.load(open(os.path.join(ckpt_root, "model.json")))
    spec = {"preset": "micro", "model": model, "steps": 1, "micro_batch": 2, "seq_len": 32, "threads": 1,
            "data": {"corpus_bytes": 65536}, "eval": {"batches": 1}}
    json.dump(spec, open(os.path.join(loom.tmp, "finetune.json"), "w"))
    p = run([loom.train_bin, "train", "--spec", os.path.join(loom.tmp, "finetune.json"), "--init-from", step])
    assert "init-from: weights of" in p.stdout + p.stderr, p.stdout[-2000:] + p.stderr[-2000:]
    print(f"ok: a Llama folder made here imports to Python's logits (relative {err:.1e}); Meta's "
          "interleaved pairing imports with --rope-pairing interleaved to the same logits (not without); "
          "a job trains from it with --init-from")


def bytes_to_unicode():
    """GPT-2's byte alphabet, as the tokenizers library defines it."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def test_byte_tokenizer_file(loom, folder):
    tok = json.load(open(os.path.join(folder, "tokenizer.json")))
    assert tok["model"]["type"] == "BPE" and tok["model"]["merges"] == [], tok["model"]["type"]
    assert tok["model"]["vocab"] == {c: b for b, c in bytes_to_unicode().items()}
    sample = "IHA vs MHA: naïve tokens, 漢字, emoji 🙂\n\ttabs".encode()
    inputs = os.path.join(loom.tmp, "strings.b64")
    open(inputs, "w").write(base64.b64encode(sample).decode() + "\n")
    out = json.loads(run([loom.data_bin, "encode", "--tokenizer", os.path.join(folder, "tokenizer.json"),
                          "--input", inputs]).stdout.splitlines()[0])
    assert out["ids"] == list(sample), out
    print("ok: the byte tokenizer exports as a byte-level tokenizer.json (GPT-2 alphabet, id = byte); "
          "loom-data encodes with it to the raw bytes")


def test_refusals(loom, step, folder):
    p = run([loom.train_bin, "export-hf", "--checkpoint", step, "--out", folder], expect_ok=False)
    assert p.returncode != 0 and "not empty" in p.stderr, p.stderr
    cfg = json.load(open(os.path.join(folder, "config.json")))
    gqa = os.path.join(loom.tmp, "gqa")
    shutil.copytree(folder, gqa)
    cfg["num_key_value_heads"] = 2
    json.dump(cfg, open(os.path.join(gqa, "config.json"), "w"))
    p = run([loom.train_bin, "import-hf", "--from", gqa, "--out", gqa + "-out"], expect_ok=False)
    assert p.returncode == 2 and "num_key_value_heads" in p.stderr and "grouped-query" in p.stderr, p.stderr
    assert not os.path.exists(gqa + "-out")
    print("ok: export into a non-empty folder and import of grouped-query attention are refused by name")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loom-train", required=True)
    ap.add_argument("--loom-data", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="loom-hf-interop-")
    try:
        loom = Loom(args, tmp)
        step, folder = test_llama_and_mistral_exports(loom)
        test_byte_tokenizer_file(loom, folder)
        test_iha_export(loom)
        test_import_llama_folder(loom)
        test_refusals(loom, step, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("hf_interop_test: ok")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""End-to-end check of `loom-train attention` and of Loom's safetensors files from Python.

Python writes weights and inputs, loom-train runs one attention layer, Python reads the output
and compares it with an independent float64 reference written here (tolerance: 1e-10 for
float64 runs, 2e-5 for float32). Files Loom writes are read back both with the reference
`safetensors` package when it is installed and with a reader written from the published format
(8-byte little-endian header length, JSON header, raw data) into PyTorch tensors.
"""
import argparse
import json
import math
import os
import struct
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from loom_testlib import safetensors_raw  # noqa: E402

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
          "U8": torch.uint8, "BOOL": torch.bool}
NAMES = {v: k for k, v in DTYPES.items()}


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        data = t.contiguous().numpy().tobytes() if t.dtype != torch.bfloat16 else \
            t.contiguous().view(torch.int16).numpy().tobytes()
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def read_safetensors(path):
    out = {}
    for name, (dtype, shape, data) in safetensors_raw(path).items():
        buf = bytearray(data)
        t = torch.frombuffer(buf, dtype=DTYPES[dtype]) if buf else torch.empty(0, dtype=DTYPES[dtype])
        out[name] = t.reshape(shape).clone()
    return out


def read_with_reference_package(path):
    try:
        from safetensors.torch import load_file  # noqa: F401
    except ImportError:
        return None
    return load_file(path)


def rope(x, pos, theta):
    d = x.shape[-1]
    half = d // 2
    freq = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / d)
    ang = pos.to(torch.float64)[:, None] * freq[None, :]
    c, s = torch.cos(ang), torch.sin(ang)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def split_heads(x, w, name, heads):
    B, N, _ = x.shape
    out = x @ w[name].double().T
    return out.reshape(B, N, heads, out.shape[-1] // heads)


def allowed_mask(N, causal, window):
    i = torch.arange(N)[:, None]
    j = torch.arange(N)[None, :]
    allowed = torch.ones(N, N, dtype=torch.bool)
    if causal:
        allowed &= j <= i
    if window > 0:
        allowed &= (i - j).abs() < window
    return allowed


def queries_keys_values(w, x, heads, theta, v_heads=None):
    """q, k [B, H, N, d] with RoPE at token positions, v [B, v_heads, N, H*d/v_heads]."""
    q, k = (split_heads(x, w, f"{n}_proj.weight", heads).transpose(1, 2) for n in "qk")
    v = split_heads(x, w, "v_proj.weight", v_heads or heads).transpose(1, 2)
    if theta > 0:
        pos = torch.arange(x.shape[1])
        q, k = rope(q, pos, theta), rope(k, pos, theta)
    return q, k, v


def reference_attention(w, x, heads, causal, window, theta, options):
    x = x.to(torch.float64)
    B, N, D = x.shape
    q, k, v = queries_keys_values(w, x, heads, theta)
    d = q.shape[-1]
    scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(
        ~allowed_mask(N, causal, window), float("-inf"))
    out = torch.softmax(scores, -1) @ v
    return out.transpose(1, 2).reshape(B, N, heads * d) @ w["o_proj.weight"].double().T


def reference_talking_heads(w, x, heads, causal, window, theta, options):
    x = x.to(torch.float64)
    B, N, D = x.shape
    q, k, v = queries_keys_values(w, x, heads, theta)
    d = q.shape[-1]
    logits = torch.einsum("bmqk,mh->bhqk", q @ k.transpose(-1, -2) / math.sqrt(d), w["logit_mix"].double())
    probs = torch.softmax(logits.masked_fill(~allowed_mask(N, causal, window), float("-inf")), -1)
    probs = torch.einsum("bmqk,mh->bhqk", probs, w["weight_mix"].double())
    out = probs @ v
    return out.transpose(1, 2).reshape(B, N, heads * d) @ w["o_proj.weight"].double().T


def reference_diff(w, x, heads, causal, window, theta, options):
    x = x.to(torch.float64)
    B, N, D = x.shape
    q, k, v = queries_keys_values(w, x, heads, theta, heads // 2)  # v: [B, H/2, N, 2d]
    d = q.shape[-1]
    scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(
        ~allowed_mask(N, causal, window), float("-inf"))
    maps = torch.softmax(scores, -1).reshape(B, heads // 2, 2, N, N)
    lam_init = 0.8 - 0.6 * math.exp(-0.3 * options.get("layer_index", 0))
    lam = (torch.exp((w["lambda_q1"] * w["lambda_k1"]).double().sum())
           - torch.exp((w["lambda_q2"] * w["lambda_k2"]).double().sum()) + lam_init)
    out = (maps[:, :, 0] - lam * maps[:, :, 1]) @ v
    out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + 1e-5) * w["subln.weight"].double()
    out = out * (1 - lam_init)
    return out.transpose(1, 2).reshape(B, N, heads * d) @ w["o_proj.weight"].double().T


def reference_iha(w, x, heads, causal, window, theta, options):
    """Interleaved Head Attention as the paper's Algorithm 1, written with einsum."""
    x = x.to(torch.float64)
    B, N, D = x.shape
    P = int(options.get("p", heads))
    mask = options.get("mask", "interleaved" if causal else "none")
    phase = options.get("rope_phase", "interleaved")
    q, k, v = (split_heads(x, w, f"{n}_proj.weight", heads) for n in "qkv")  # [B, N, H, d]
    d = q.shape[-1]

    def pseudo(t, alpha):  # [B, N, H(m), d] -> [B, H, N*P, d], row s = n*P + j
        return torch.einsum("bnmd,mhj->bhnjd", t, alpha.double()).reshape(B, heads, N * P, -1)

    qt, kt, vt = pseudo(q, w["alpha_q"]), pseudo(k, w["alpha_k"]), pseudo(v, w["alpha_v"])
    if theta > 0:
        n_idx = torch.arange(N).repeat_interleave(P)
        pos = n_idx * P + torch.arange(P).repeat(N) if phase == "interleaved" else n_idx
        qt, kt = rope(qt, pos, theta), rope(kt, pos, theta)
    s = torch.arange(N * P)
    si, sj = s[:, None], s[None, :]
    allowed = torch.ones(N * P, N * P, dtype=torch.bool)
    if mask == "interleaved":
        allowed &= sj <= si
    elif mask == "block":
        allowed &= (sj // P) <= (si // P)
    if window > 0:
        allowed &= (si - sj).abs() < window * P
    scores = (qt @ kt.transpose(-1, -2) / math.sqrt(d)).masked_fill(~allowed, float("-inf"))
    out = (torch.softmax(scores, -1) @ vt).reshape(B, heads, N, P, d)
    heads_out = torch.einsum("bgnjd,hgj->bnhd", out, w["collapse"].double().reshape(heads, heads, P))
    return heads_out.reshape(B, N, heads * d) @ w["o_proj.weight"].double().T


def run(cmd, expect_ok=True):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if expect_ok and p.returncode != 0:
        raise AssertionError(f"{cmd} failed ({p.returncode}): {p.stderr}")
    return p


def check_attention(loom, tmp, plugin, dtype, causal, window, theta, options=None, extra=None,
                    reference=reference_attention, layer_index=0):
    torch.manual_seed(0)
    D, H = 16, 4
    w = {n: torch.randn(D, D, dtype=dtype) * 0.3 for n in
         ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")}
    w.update({n: t.to(dtype) for n, t in (extra or {}).items()})
    x = torch.randn(2, 7, D, dtype=dtype)
    cfg = {"d_model": D, "n_heads": H, "causal": causal, "rope_theta": theta,
           "layer_index": layer_index, "attention": {"window": window, "options": options or {}},
           "dtype": "float64" if dtype == torch.float64 else "float32"}
    tag = f"{plugin}_{window}_{int(causal)}"
    paths = {k: os.path.join(tmp, f"{tag}_{k}") for k in ("w", "x", "y", "cfg")}
    write_safetensors(paths["w"], w)
    write_safetensors(paths["x"], {"x": x})
    with open(paths["cfg"], "w") as f:
        json.dump(cfg, f)
    run([loom, "attention", "--plugin", plugin, "--config", paths["cfg"], "--weights", paths["w"],
         "--input", paths["x"], "--output", paths["y"]])
    y = read_safetensors(paths["y"])["y"]
    pkg = read_with_reference_package(paths["y"])
    if pkg is not None:
        assert torch.equal(pkg["y"], y)
    assert y.dtype == dtype, y.dtype
    opts = dict(options or {})
    opts["layer_index"] = layer_index
    ref = reference(w, x, H, causal, window, theta, opts)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    err = (y.double() - ref).abs().max().item()
    assert err < tol, f"{plugin} {dtype} causal={causal} window={window} {options}: max error {err}"
    print(f"{plugin:14s} {str(dtype):14s} causal={causal!s:5s} window={window} {options or ''}: max error {err:.2e}")
    return paths


def expect_failure(loom, args, needle):
    p = run([loom] + args, expect_ok=False)
    assert p.returncode != 0, f"{args} should fail"
    assert needle in p.stderr, f"expected '{needle}' in: {p.stderr}"
    assert "Segmentation" not in p.stderr and p.returncode > 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loom-train", required=True)
    loom = ap.parse_args().loom_train
    with tempfile.TemporaryDirectory() as tmp:
        check_attention(loom, tmp, "mha", torch.float64, True, 0, 10000.0)
        check_attention(loom, tmp, "mha", torch.float32, False, 0, 0.0)
        paths = check_attention(loom, tmp, "local", torch.float64, True, 3, 500000.0)
        check_attention(loom, tmp, "local", torch.float64, False, 2, 10000.0)
        # IHA with the interop names: alpha_q/k/v [H, H, P] indexed [source m, target h, pseudo j]
        # and collapse [H, H*P] indexed [h, h'*P + j].
        for P, mask, window, phase in ((2, "interleaved", 0, "interleaved"), (3, "block", 2, "token"),
                                       (4, "interleaved", 2, "interleaved")):
            iha_w = {"alpha_q": torch.randn(4, 4, P), "alpha_k": torch.randn(4, 4, P),
                     "alpha_v": torch.randn(4, 4, P), "collapse": torch.randn(4, 4 * P) / P}
            check_attention(loom, tmp, "iha", torch.float64, True, window, 10000.0,
                            {"p": P, "mask": mask, "rope_phase": phase}, iha_w, reference_iha)
        check_attention(loom, tmp, "iha", torch.float32, False, 0, 0.0, {"p": 2, "mask": "none"},
                        {"alpha_q": torch.randn(4, 4, 2), "alpha_k": torch.randn(4, 4, 2),
                         "alpha_v": torch.randn(4, 4, 2), "collapse": torch.randn(4, 8) / 2},
                        reference_iha)
        check_attention(loom, tmp, "talking_heads", torch.float64, True, 0, 10000.0, None,
                        {"logit_mix": torch.randn(4, 4) / 2, "weight_mix": torch.randn(4, 4) / 2},
                        reference_talking_heads)
        check_attention(loom, tmp, "diff", torch.float64, True, 3, 10000.0, None,
                        {"lambda_q1": torch.randn(4) * 0.1, "lambda_k1": torch.randn(4) * 0.1,
                         "lambda_q2": torch.randn(4) * 0.1, "lambda_k2": torch.randn(4) * 0.1,
                         "subln.weight": 1 + torch.randn(8) * 0.1},
                        reference_diff, layer_index=3)

        base = ["attention", "--plugin", "local", "--config", paths["cfg"], "--weights", paths["w"],
                "--input", paths["x"], "--output", os.path.join(tmp, "never.safetensors")]
        # Missing tensor in the weights: names it.
        w = read_safetensors(paths["w"])
        del w["k_proj.weight"]
        bad_w = os.path.join(tmp, "bad_w")
        write_safetensors(bad_w, w)
        expect_failure(loom, base[:6] + [bad_w] + base[7:], "missing: k_proj.weight")
        # Unknown config field: names it.
        bad_cfg = os.path.join(tmp, "bad_cfg")
        with open(bad_cfg, "w") as f:
            json.dump({"d_model": 16, "n_heads": 4, "windw": 3}, f)
        expect_failure(loom, base[:4] + [bad_cfg] + base[5:], "windw")
        # Corrupt weights file: truncated.
        with open(paths["w"], "rb") as f:
            raw = f.read()
        trunc = os.path.join(tmp, "trunc")
        with open(trunc, "wb") as f:
            f.write(raw[: len(raw) // 2])
        expect_failure(loom, base[:6] + [trunc] + base[7:], "trunc")
        # Unknown plugin and missing flags.
        expect_failure(loom, ["attention", "--plugin", "nope"] + base[3:], "no attention plugin named 'nope'")
        expect_failure(loom, ["attention", "--plugin", "mha"], "--config is required")
        expect_failure(loom, ["train", "--steps", "ten"], "--steps")

        # A file Loom writes (trained weights) loads in PyTorch, every tensor finite.
        out = os.path.join(tmp, "weights.safetensors")
        run([loom, "train", "--preset", "micro", "--steps", "3", "--batch", "2", "--seq-len", "16",
             "--log-every", "1000", "--save-weights", out])
        tensors = read_safetensors(out)
        assert "embed.weight" in tensors and "layers.0.attention.q_proj.weight" in tensors, list(tensors)
        for name, t in tensors.items():
            assert torch.isfinite(t.float()).all(), name
        pkg = read_with_reference_package(out)
        if pkg is not None:
            for name, t in tensors.items():
                assert torch.equal(pkg[name], t), name
        print("safetensors package:", "checked" if pkg is not None else "not installed (format reader only)")
    print("attention CLI interop: ok")


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Plain-torch self-check of interop/modeling_loom_iha.py (no transformers, no numpy).

Builds tiny random Loom model folders (config.json + safetensors written by the small writer
below) and checks:
  (a) Theorem 2a: an IHA layer with identity mixing, R on pseudo 0, mask block, RoPE phase
      token and no window equals the MHA layer with the same q/k/v/o weights (float64, 1e-10);
      the interleaved mask does not (a control);
  (b) causality: changing token t changes no logits before t;
  (c) padding: a left-padded row with matching position_ids gives the unpadded row's logits;
plus the IHA layer against scalar loops written from docs/iha.md, the safetensors reader
(dtypes, sharding, strict offsets), the refusals (unknown layer kind, missing / misshapen /
extra tensor), float32 against float64, the loss and the CLI.

Run: /usr/bin/python3 interop/modeling_loom_iha_test.py (ctest modeling_loom_iha_test)
"""

import ctypes
import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
MODULE_PATH = os.path.join(HERE, "modeling_loom_iha.py")
_spec = importlib.util.spec_from_file_location("modeling_loom_iha", MODULE_PATH)
mli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mli)

ST_NAMES = {torch.float32: "F32", torch.float64: "F64", torch.bfloat16: "BF16",
            torch.float16: "F16"}


# ---------------------------------------------------------------------------------------------
# A tiny safetensors writer and folder builder
# ---------------------------------------------------------------------------------------------


def tensor_bytes(t):
    t = t.detach().contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def write_safetensors(path, tensors, dtype=torch.float32):
    """Writes {name: tensor} (cast to dtype) as a .safetensors file, header padded to 8 bytes."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name in sorted(tensors):
        t = tensors[name].to(dtype)
        data = tensor_bytes(t)
        header[name] = {"dtype": ST_NAMES[dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode("utf-8")
    raw += b" " * ((8 - len(raw) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def make_config(layers, *, vocab=37, hidden=24, heads=3, head_dim=6, ffn=40, act="silu",
                tied=False, bias=True, theta=10000.0, max_pos=64):
    return {
        "architectures": ["LoomIhaForCausalLM"], "model_type": "loom_iha",
        "auto_map": {"AutoConfig": "modeling_loom_iha.LoomIhaConfig",
                     "AutoModelForCausalLM": "modeling_loom_iha.LoomIhaForCausalLM"},
        "vocab_size": vocab, "hidden_size": hidden, "num_attention_heads": heads,
        "head_dim": head_dim, "intermediate_size": ffn, "hidden_act": act,
        "mlp_gated": act == "silu", "num_hidden_layers": len(layers),
        "max_position_embeddings": max_pos, "rope_theta": theta, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": tied, "attention_bias": bias, "loom_layers": layers,
        "torch_dtype": "float32", "eos_token_id": 0, "bos_token_id": 1,
        # what Loom's exporter (interop/hf_export.cc) also writes
        "num_key_value_heads": heads, "rope_scaling": None, "attention_dropout": 0.0,
        "initializer_range": 0.02, "use_cache": False, "loom": {"step": 0},
    }


def random_weights(cfg, seed):
    """Random float64 tensors under the exported names, scaled so activations stay O(1)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    v, d, h, hd, f = (cfg["vocab_size"], cfg["hidden_size"], cfg["num_attention_heads"],
                      cfg["head_dim"], cfg["intermediate_size"])
    w = {"model.embed_tokens.weight": rnd(v, d), "model.norm.weight": 1 + rnd(d, scale=0.1)}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = rnd(v, d, scale=d ** -0.5)
    for i, layer in enumerate(cfg["loom_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + rnd(d, scale=0.1)
        w[p + "post_attention_layernorm.weight"] = 1 + rnd(d, scale=0.1)
        for name, shape in (("q", (h * hd, d)), ("k", (h * hd, d)), ("v", (h * hd, d)),
                            ("o", (d, h * hd))):
            w[p + f"self_attn.{name}_proj.weight"] = rnd(*shape, scale=shape[1] ** -0.5)
            if cfg["attention_bias"]:
                w[p + f"self_attn.{name}_proj.bias"] = rnd(shape[0], scale=0.1)
        if layer["kind"] == "iha":
            pp = layer["p"]
            for name in ("alpha_q", "alpha_k", "alpha_v"):
                w[p + "self_attn." + name] = rnd(h, h, pp, scale=h ** -0.5)
            w[p + "self_attn.collapse"] = rnd(h, h * pp, scale=(h * pp) ** -0.5)
        w[p + "mlp.up_proj.weight"] = rnd(f, d, scale=d ** -0.5)
        w[p + "mlp.down_proj.weight"] = rnd(d, f, scale=f ** -0.5)
        if cfg["mlp_gated"]:
            w[p + "mlp.gate_proj.weight"] = rnd(f, d, scale=d ** -0.5)
    return w


def write_folder(root, name, cfg, weights, *, shards=1, dtype=torch.float32):
    folder = os.path.join(root, name)
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    if shards == 1:
        write_safetensors(os.path.join(folder, "model.safetensors"), weights, dtype)
        return folder
    names = sorted(weights)
    weight_map = {}
    for s in range(shards):
        shard = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: weights[n] for n in names[s::shards]}
        write_safetensors(os.path.join(folder, shard), part, dtype)
        weight_map.update({n: shard for n in part})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return folder


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------

RESULTS = []


def check(name, ok, detail=""):
    RESULTS.append(ok)
    print(f"[{'PASS' if ok else 'FAIL'}] {name}" + (f": {detail}" if detail else ""))


def logits_of(model, ids, **kw):
    with torch.no_grad():
        return model(torch.as_tensor(ids), **kw).logits


def max_diff(a, b):
    return (a - b).abs().max().item()


def expect_value_error(name, fn, must_contain):
    try:
        fn()
    except ValueError as e:
        ok = must_contain in str(e)
        check(name, ok, str(e))
        return
    except Exception as e:  # noqa: BLE001
        check(name, False, f"raised {type(e).__name__}: {e}")
        return
    check(name, False, "no error")


LAYERS_A = [
    {"kind": "mha", "window": 0},
    {"kind": "local", "window": 3},
    {"kind": "iha", "window": 0, "p": 2, "mask": "interleaved", "rope_phase": "interleaved",
     "score": "softmax", "scale": 0.0},
    {"kind": "iha", "window": 2, "p": 3, "mask": "block", "rope_phase": "token",
     "score": "softmax", "scale": 0.0},
]
LAYERS_C = [
    {"kind": "iha", "window": 2, "p": 2, "mask": "interleaved", "rope_phase": "interleaved",
     "score": "linear", "scale": 0.5},
    {"kind": "local", "window": 2},
    {"kind": "mha", "window": 0},
]


def causality_and_padding(tag, model, vocab, n=12):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(2, vocab, (2, n), generator=g)
    base = logits_of(model, ids)
    worst_before, least_at = 0.0, float("inf")
    for t in (0, 3, 7, n - 1):
        changed = ids.clone()
        changed[:, t] = (changed[:, t] + 1 - 2) % (vocab - 2) + 2
        out = logits_of(model, changed)
        if t > 0:
            worst_before = max(worst_before, max_diff(out[:, :t], base[:, :t]))
        least_at = min(least_at, max_diff(out[:, t], base[:, t]))
    check(f"(b) causality [{tag}]", worst_before == 0.0 and least_at > 1e-6,
          f"max change before t = {worst_before:.1e}, min change at t = {least_at:.1e}")

    pad, real = 3, n - 3
    row = ids[0, :real]
    padded = torch.stack([torch.cat([torch.zeros(pad, dtype=torch.long), row]), ids[1, :n]])
    mask = torch.tensor([[0] * pad + [1] * real, [1] * n])
    pos = torch.stack([torch.cat([torch.zeros(pad, dtype=torch.long), torch.arange(real)]),
                       torch.arange(n)])
    out = logits_of(model, padded, attention_mask=mask, position_ids=pos)
    alone = logits_of(model, row.unsqueeze(0))
    other = logits_of(model, ids[1:2])
    d_real, d_other = max_diff(out[0, pad:], alone[0]), max_diff(out[1], other[0])
    check(f"(c) left padding [{tag}]",
          d_real < 1e-10 and d_other < 1e-10 and bool(torch.isfinite(out).all()),
          f"padded row vs alone {d_real:.1e}, unpadded row {d_other:.1e}, all finite")


def loop_iha(att, x, positions, theta):
    """docs/iha.md written out with scalar loops (one batch row): an independent check of the
    module's vectorised mixing, interleaving, RoPE positions, masks, window, score and collapse."""
    n, h, d, p = x.shape[0], att.num_heads, att.head_dim, att.p
    q, k, v = (lin(x).view(n, h, d) for lin in (att.q_proj, att.k_proj, att.v_proj))

    def mix(t, alpha):  # -> [H][N*P] vectors
        return [[sum(alpha[m, hh, s % p] * t[s // p, m] for m in range(h)) for s in range(n * p)]
                for hh in range(h)]

    def rope(vec, pos):
        if theta <= 0:
            return vec
        half, out = d // 2, vec.clone()
        for i in range(half):
            ang = torch.tensor(float(pos) * theta ** (-2.0 * i / d), dtype=torch.float64)
            c, sn = torch.cos(ang).item(), torch.sin(ang).item()
            out[i] = vec[i] * c - vec[i + half] * sn
            out[i + half] = vec[i + half] * c + vec[i] * sn
        return out

    def rpos(s):
        if att.rope_phase == "interleaved":
            return positions[s // p] * p + s % p
        return positions[s // p]

    qt, kt, vt = mix(q, att.alpha_q), mix(k, att.alpha_k), mix(v, att.alpha_v)
    outs = []
    for hh in range(h):
        qs = [rope(qt[hh][s], rpos(s)) for s in range(n * p)]
        ks = [rope(kt[hh][s], rpos(s)) for s in range(n * p)]
        rows = []
        for s in range(n * p):
            ok = [(t <= s if att.mask == "interleaved" else t // p <= s // p)
                  and (att.window == 0 or abs(s - t) < att.window * p) for t in range(n * p)]
            sc = [float(qs[s] @ ks[t]) * att.scale for t in range(n * p)]
            if att.score == "linear":
                w = [sc[t] if ok[t] else 0.0 for t in range(n * p)]
            else:
                mx = max(sc[t] for t in range(n * p) if ok[t])
                e = [torch.exp(torch.tensor(sc[t] - mx, dtype=torch.float64)).item()
                     if ok[t] else 0.0 for t in range(n * p)]
                w = [x_ / sum(e) for x_ in e]
            rows.append(sum(w[t] * vt[hh][t] for t in range(n * p)))
        outs.append(rows)
    o = torch.stack([torch.stack([sum(att.collapse[hh, g * p + j] * outs[g][tok * p + j]
                                      for g in range(h) for j in range(p)) for hh in range(h)])
                     for tok in range(n)])  # [N, H, d]
    return att.o_proj(o.reshape(n, h * d))


def check_against_loops():
    worst, combos = 0.0, 0
    g = torch.Generator().manual_seed(11)
    for p in (1, 2, 3):
        for mask in ("interleaved", "block"):
            for phase in ("interleaved", "token"):
                for score, scale in (("softmax", 0.0), ("linear", 0.7)):
                    for window in (0, 2):
                        cfg = mli.LoomIhaConfig(**make_config(
                            [{"kind": "mha"}], hidden=8, heads=2, head_dim=4, theta=100.0))
                        spec = {"kind": "iha", "window": window, "p": p, "mask": mask,
                                "rope_phase": phase, "score": score, "scale": scale}
                        att = mli.LoomIhaInterleavedHeadAttention(cfg, spec).double()
                        with torch.no_grad():
                            for prm in att.parameters():
                                prm.copy_(torch.randn(prm.shape, generator=g, dtype=torch.float64))
                            x = torch.randn(5, 8, generator=g, dtype=torch.float64)
                            pos = torch.tensor([3, 4, 5, 6, 7])
                            got = att(x.unsqueeze(0), pos.unsqueeze(0), None)[0]
                            want = loop_iha(att, x, pos, 100.0)
                        worst = max(worst, max_diff(got, want) / want.abs().max().item())
                        combos += 1
    check("IHA layer vs scalar-loop implementation of docs/iha.md", worst < 1e-12,
          f"{combos} combinations (P x mask x rope phase x score x window), "
          f"max relative diff {worst:.1e}")


def main():
    torch.manual_seed(0)
    root = tempfile.mkdtemp(prefix="loom_iha_selfcheck_")
    print(f"module: {MODULE_PATH} (transformers: {mli.HAS_TRANSFORMERS})")

    # Folder A: [mha, local, iha(interleaved, P=2), iha(block, token, P=3, window 2)].
    cfg_a = make_config(LAYERS_A)
    w_a = random_weights(cfg_a, seed=1)
    folder_a = write_folder(root, "a", cfg_a, w_a, dtype=torch.float64)
    a64 = mli.load_pretrained(folder_a, dtype=torch.float64)
    a32 = mli.load_pretrained(folder_a, dtype=torch.float32)
    ids = torch.randint(0, cfg_a["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(3))
    l64, l32 = logits_of(a64, ids), logits_of(a32, ids)
    check("forward shape and dtype", tuple(l64.shape) == (2, 10, 37) and l64.dtype == torch.float64
          and l32.dtype == torch.float32, f"{list(l64.shape)}")
    rel = max_diff(l32.double(), l64) / l64.abs().max().item()
    check("float32 vs float64", rel < 1e-5, f"max relative difference {rel:.1e}")

    check_against_loops()

    # (a) Theorem 2a: layer 0 (mha) replaced by identity IHA with mask block, token RoPE.
    for p in (1, 2, 3):
        for mask, want_equal in (("block", True), ("interleaved", False)):
            cfg_b = make_config([dict(kind="iha", window=0, p=p, mask=mask, rope_phase="token",
                                      score="softmax", scale=0.0)] + LAYERS_A[1:])
            w_b = dict(w_a)
            w_b.update({
                f"model.layers.0.self_attn.{n}":
                    mli.LoomIhaInterleavedHeadAttention.identity_alpha(3, p).double()
                for n in ("alpha_q", "alpha_k", "alpha_v")})
            w_b["model.layers.0.self_attn.collapse"] = \
                mli.LoomIhaInterleavedHeadAttention.identity_collapse(3, p).double()
            b64 = mli.load_pretrained(write_folder(root, f"b_{p}_{mask}", cfg_b, w_b,
                                                   dtype=torch.float64), dtype=torch.float64)
            d = max_diff(logits_of(b64, ids), l64)
            if want_equal:
                check(f"(a) Thm 2a: identity IHA (block, token RoPE, P={p}) == MHA", d < 1e-10,
                      f"max |diff| = {d:.1e}")
            elif p > 1:
                check(f"(a) control: identity IHA with mask interleaved (P={p}) != MHA", d > 1e-6,
                      f"max |diff| = {d:.1e}")

    causality_and_padding("a: mha, local, iha x2; float64", a64, cfg_a["vocab_size"])

    # Folder C: GELU, tied head, no bias, no RoPE, linear-score windowed IHA; 3 shards.
    cfg_c = make_config(LAYERS_C, act="gelu", tied=True, bias=False, theta=0.0)
    w_c = random_weights(cfg_c, seed=2)
    folder_c = write_folder(root, "c", cfg_c, w_c, shards=3, dtype=torch.float64)
    c64 = mli.load_pretrained(folder_c, dtype=torch.float64)
    check("tied head shares the embedding",
          c64.lm_head.weight.data_ptr() == c64.model.embed_tokens.weight.data_ptr())
    causality_and_padding("c: linear iha, gelu, tied, sharded; float64", c64, cfg_c["vocab_size"])

    # The reader: every dtype round-trips; strict offsets.
    src = {"a": torch.randn(3, 4, dtype=torch.float64), "b": torch.randn(5),
           "c": torch.zeros(0, 2), "s": torch.tensor(2.5)}
    for dtype in ST_NAMES:
        path = os.path.join(root, f"rt_{ST_NAMES[dtype]}.safetensors")
        write_safetensors(path, src, dtype)
        back = mli.read_safetensors(path)
        ok = all(back[k].dtype == dtype and back[k].shape == src[k].shape
                 and torch.equal(back[k], src[k].to(dtype)) for k in src)
        check(f"safetensors round trip {ST_NAMES[dtype]}", ok)
    good = open(os.path.join(root, "rt_F32.safetensors"), "rb").read()
    (hlen,) = struct.unpack("<Q", good[:8])
    header = json.loads(good[8:8 + hlen])

    def rewrite(name, hdr, tail=b""):
        raw = json.dumps(hdr).encode()
        path = os.path.join(root, name)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw + good[8 + hlen:] + tail)
        return path

    gap = json.loads(json.dumps(header))
    gap["b"]["data_offsets"] = [o + 4 for o in gap["b"]["data_offsets"]]
    expect_value_error("reader refuses a gap/overlap", lambda: mli.read_safetensors(
        rewrite("gap.safetensors", gap, b"\0" * 4)), "gap or overlap")
    expect_value_error("reader refuses trailing bytes", lambda: mli.read_safetensors(
        rewrite("tail.safetensors", header, b"\0" * 4)), "tensors cover")
    short = json.loads(json.dumps(header))
    short["a"]["shape"] = [3, 3]
    expect_value_error("reader refuses a byte count that mismatches the shape",
                       lambda: mli.read_safetensors(rewrite("short.safetensors", short)),
                       "bytes for shape")
    bad = json.loads(json.dumps(header))
    bad["a"]["dtype"] = "I64"
    expect_value_error("reader refuses an unsupported dtype",
                       lambda: mli.read_safetensors(rewrite("i64.safetensors", bad)), "'I64'")

    # Refusals naming the field.
    cfg_bad = make_config([{"kind": "mla", "window": 0}])
    expect_value_error("unknown layer kind", lambda: mli.load_pretrained(
        write_folder(root, "bad_kind", cfg_bad, random_weights(make_config(LAYERS_A[:1]), 1))),
        "loom_layers[0].kind")
    missing = {k: v for k, v in w_a.items() if k != "model.layers.2.self_attn.alpha_v"}
    expect_value_error("missing tensor", lambda: mli.load_pretrained(
        write_folder(root, "missing", cfg_a, missing)), "model.layers.2.self_attn.alpha_v")
    wrong = dict(w_a)
    wrong["model.layers.3.self_attn.collapse"] = torch.zeros(3, 6, dtype=torch.float64)
    expect_value_error("tensor of the wrong shape", lambda: mli.load_pretrained(
        write_folder(root, "wrong", cfg_a, wrong)), "model.layers.3.self_attn.collapse")
    extra = dict(w_c)
    extra["lm_head.weight"] = w_c["model.embed_tokens.weight"]
    expect_value_error("unexpected extra tensor (lm_head with a tied head)",
                       lambda: mli.load_pretrained(write_folder(root, "extra", cfg_c, extra)),
                       "unexpected tensor(s) lm_head.weight")

    # from_pretrained (plain classes), the loss, and the CLI.
    if not mli.HAS_TRANSFORMERS:
        m = mli.LoomIhaForCausalLM.from_pretrained(folder_a, dtype=torch.float64)
        check("LoomIhaForCausalLM.from_pretrained", max_diff(logits_of(m, ids), l64) == 0.0)
    with torch.no_grad():
        out = a64(ids, labels=ids)
    manual = torch.nn.functional.cross_entropy(l64[:, :-1].reshape(-1, 37), ids[:, 1:].reshape(-1))
    check("loss = shifted cross-entropy", abs(out.loss.item() - manual.item()) < 1e-12,
          f"{out.loss.item():.6f}")
    bin_path = os.path.join(root, "logits.bin")
    tokens = [5, 1, 30, 2, 2, 17]
    run = subprocess.run([sys.executable, MODULE_PATH, folder_a, "--tokens",
                          ",".join(map(str, tokens)), "--dtype", "float64", "--out", bin_path],
                         capture_output=True, text=True)
    want = logits_of(a64, [tokens])
    raw = open(bin_path, "rb").read() if run.returncode == 0 else b""
    got = torch.tensor(struct.unpack(f"<{len(raw) // 8}d", raw), dtype=torch.float64)
    ok = run.returncode == 0 and got.numel() == want.numel() and \
        max_diff(got, want.reshape(-1)) == 0.0
    check("CLI --dtype float64 --out", ok, run.stdout.strip().replace("\n", " | ")
          if ok else run.stderr[-500:])

    shutil.rmtree(root, ignore_errors=True)
    passed = sum(RESULTS)
    print(f"{passed}/{len(RESULTS)} checks passed")
    return 0 if passed == len(RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())

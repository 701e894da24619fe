#!/usr/bin/env python3
"""Writes the hand-made seed inputs of every harness into fuzz/corpus/<name>/ (what libFuzzer
starts from; findings are added beside them as crash-<sha1> files). Run from the repository
root: python3 fuzz/seed_corpus.py. The files are committed; this script says where they came
from and regenerates them."""
import hashlib
import json
import os
import pathlib
import struct
import subprocess
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
CORPUS = ROOT / "fuzz" / "corpus"
SEP = b"\n@@@@\n"


def put(name, label, data):
    if isinstance(data, str):
        data = data.encode()
    d = CORPUS / name
    d.mkdir(parents=True, exist_ok=True)
    (d / f"seed-{label}").write_bytes(data)


def yaml_spec(path):
    """The spec: block of an example file, dedented (the harness takes a JobSpec)."""
    lines = path.read_text().splitlines()
    out, inside = [], False
    for line in lines:
        if line.startswith("spec:"):
            inside = True
            continue
        if inside:
            if line and not line.startswith(" "):
                break
            out.append(line[2:])
    return "\n".join(out) + "\n"


def job_specs():
    for ex in ["tiny-iha", "tiny-sft"]:
        put("job_spec", f"{ex}.yaml", b"y" + yaml_spec(ROOT / "examples" / f"{ex}.yaml").encode())
    specs = {
        "micro": {"preset": "micro", "steps": 40, "checkpoint": {"interval": 10}},
        "mha": {"preset": "tiny-cpu", "steps": 20,
                "model": {"attention": {"kind": "mha"}}, "optimizer": {"lr": 0.001}},
        "iha-options": {"preset": "tiny-cpu", "steps": 10,
                        "model": {"attention": {"kind": "iha", "options": {"p": 2}}}},
        "eval": {"kind": "eval", "init_from": "job-000001.10", "eval": {"batches": 2}},
        "sft": {"kind": "sft", "preset": "tiny-cpu", "data": {"source": "chat", "task": "arithmetic",
                                                                "task_options": {"ops": "1-3"}}},
        "bad-type": {"preset": "micro", "steps": "ten"},
        "unknown-field": {"preset": "micro", "stepz": 1},
    }
    for label, spec in specs.items():
        put("job_spec", f"{label}.json", b"j" + json.dumps(spec).encode())
    put("job_spec", "yaml-anchors", b"y" + b"preset: &p micro\nsteps: 5\nname: *p\n")


def overrides():
    put("set_overrides", "basic", "steps=10\noptimizer.lr=1e-3\nmicro_batch=4\n")
    put("set_overrides", "model", "model.attention.kind=iha\nmodel.attention.options.p=2\n"
                                  "model.n_layers=2\n")
    put("set_overrides", "data", "data.task=arithmetic\ndata.task_options.ops=2-3\n"
                                 "data.source=chat\nkind=sft\n")
    put("set_overrides", "lists", "eval.lengths=[64,128]\ncheckpoint.keep_last=2\n")
    put("set_overrides", "bad", "steps=-1\nnot.a.field=3\n=\n")


def safetensors_file(tensors, metadata=None):
    header, data = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def safetensors():
    f32 = struct.pack("<6f", *range(6))
    put("safetensors", "f32", safetensors_file([("w", "F32", [2, 3], f32)]))
    put("safetensors", "mixed", safetensors_file(
        [("a", "BF16", [4], b"\x80\x3f" * 4), ("b", "I64", [1], struct.pack("<q", 7)),
         ("c", "U8", [3], b"abc"), ("d", "BOOL", [2], b"\x00\x01"), ("e", "F16", [0], b"")],
        {"format": "pt", "step": "10"}))
    put("safetensors", "scalar", safetensors_file([("s", "F64", [], struct.pack("<d", 1.5))]))
    put("safetensors", "empty", safetensors_file([]))


def manifests():
    m = {"format_version": 1, "step": 150, "tokens_seen": 76800, "world_size": 2,
         "spec_hash": "0123456789abcdef", "parent": "", "kind": "pretrain",
         "created_unix_ms": 1764979200000,
         "state": {"data_cursor": "12", "rng": "abc", "spec": json.dumps(
             {"preset": "micro", "steps": 40, "model": {"vocab_size": 256}})},
         "shards": [{"rank": 0, "file": "shard-00000-of-00002.safetensors", "bytes": 1024,
                     "crc32c": "0a1b2c3d"},
                    {"rank": 1, "file": "shard-00001-of-00002.safetensors", "bytes": 1024,
                     "crc32c": "deadbeef"}]}
    put("checkpoint_manifest", "two-ranks", json.dumps(m, indent=1))
    m2 = dict(m, world_size=1, shards=m["shards"][:1], parent="job-000001/step-00000100",
              kind="sft")
    put("checkpoint_manifest", "sft", json.dumps(m2))
    put("checkpoint_manifest", "missing-field", json.dumps({"format_version": 1, "step": 1}))


def s3_xml():
    put("s3_xml", "listing", '<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult '
        'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>ckpt</Name><Prefix>jobs/</Prefix>'
        '<IsTruncated>true</IsTruncated><NextContinuationToken>t1</NextContinuationToken><Contents>'
        '<Key>jobs/a/step-00000001/manifest.json</Key><Size>812</Size><ETag>"e1"</ETag></Contents>'
        '<CommonPrefixes><Prefix>jobs/b/</Prefix></CommonPrefixes></ListBucketResult>')
    put("s3_xml", "upload-id", "<InitiateMultipartUploadResult><Bucket>b</Bucket><Key>k</Key>"
        "<UploadId>u-1</UploadId></InitiateMultipartUploadResult>")
    put("s3_xml", "error", '<?xml version="1.0"?><Error><Code>SlowDown</Code>'
        "<Message>Reduce your request rate.</Message></Error>")
    put("s3_xml", "dtd", '<!DOCTYPE a [<!ENTITY b "c">]><Error><Code>&b;</Code></Error>')


def tiny_tokenizer():
    vocab, nxt = {}, 256
    for b in range(256):
        direct = ord("!") <= b <= ord("~") or 0xA1 <= b <= 0xAC or b >= 0xAE
        cp = b if direct else nxt
        if not direct:
            nxt += 1
        vocab[chr(cp)] = b
    vocab.update({"ab": 256, "abc": 257, "bc": 258, "\u0120ab": 259, "xyz": 260})
    return {"version": "1.0", "normalizer": None,
            "added_tokens": [{"id": 300, "content": "<|end_of_text|>", "special": True}],
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": r" ?\p{L}+|\p{N}{1,3}|\s+|[^\s\p{L}\p{N}]+"},
                 "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]},
            "model": {"type": "BPE", "ignore_merges": True, "vocab": vocab,
                      "merges": ["b c", "a b", "ab c", "\u0120 ab"]}}


def tokenizers():
    t = json.dumps(tiny_tokenizer()).encode()
    texts = {"ascii": b"abc abcd xyz 123 4567!", "special": b"ab<|end_of_text|>bc",
             "utf8": "héllo wörld ✓ 日本".encode(), "invalid-utf8": b"a\xff\xfeb\xc3",
             "empty": b""}
    for label, text in texts.items():
        put("tokenizer_json", label, t + SEP + text)
    t2 = tiny_tokenizer()
    t2["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
    t2["model"]["merges"] = [["a", "b"], ["b", "c"]]
    put("tokenizer_json", "gpt2-regex-pair-merges", json.dumps(t2).encode() + SEP + b"abc ab  c\n")
    t3 = tiny_tokenizer()
    t3["added_tokens"][0]["id"] = 4294967295
    put("tokenizer_json", "huge-id", json.dumps(t3).encode() + SEP + b"ab")


def varint(data, i):
    shift = value = 0
    while True:
        b = data[i]
        value |= (b & 0x7F) << shift
        shift += 7
        i += 1
        if b < 0x80:
            return value, i


def fields(data):
    """(number, wire type, raw bytes of the whole field) of a protobuf message."""
    i = 0
    while i < len(data):
        start = i
        key, i = varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, i = varint(data, i)
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        elif wire == 2:
            n, i = varint(data, i)
            i += n
        yield number, wire, data[start:i]


def identity_normalizer(model):
    """The model with its NormalizerSpec (field 3) replaced by name "identity" and no
    precompiled charsmap: 2 KB instead of 240 (the charsmap is the NFKC table)."""
    spec = b"\x0a\x08identity"  # NormalizerSpec.name = "identity"
    out = b"".join(raw for number, _, raw in fields(model) if number != 3)
    return out + b"\x1a" + bytes([len(spec)]) + spec


def sentencepiece():
    loom_data = ROOT / "build" / "bin" / "loom-data"
    if not loom_data.exists():
        print("sentencepiece_model: build/bin/loom-data missing; seeds left as they are")
        return
    with tempfile.TemporaryDirectory() as tmp:
        text = pathlib.Path(tmp) / "text.txt"
        text.write_text("the quick brown fox jumps over the lazy dog\n" * 20 +
                        "pack my box with five dozen liquor jugs\n" * 20)
        subprocess.run([str(loom_data), "train-tokenizer", "--input", str(text), "--vocab-size",
                        "30", "--output", f"{tmp}/sp"], check=True, capture_output=True)
        model = identity_normalizer(pathlib.Path(f"{tmp}/sp.model").read_bytes())
    put("sentencepiece_model", "small", model + SEP + b"the lazy fox jumps")
    put("sentencepiece_model", "unknown-chars", model + SEP + "日本 ✓ zzz".encode())


def events():
    lines = {
        "step": {"event": "step", "step": 1, "loss": 5.5, "lr": 0.001, "grad_norm": 1.2,
                 "step_seconds": 0.1, "tokens_per_second": 1000.0, "mfu": 0, "tokens_seen": 512,
                 "skipped": False, "loss_scale": 65536.0, "overflowed": False,
                 "time_unix_ms": 1764979200000},
        "step-null": {"event": "step", "step": 2, "loss": None, "grad_norm": None},
        "eval": {"event": "eval", "step": 10, "split": "validation", "epoch": 1, "length": 128,
                 "eval_loss": 2.5, "accuracy": 0.5, "exact_match": 0.1},
        "checkpoint": {"event": "checkpoint", "step": 10},
        "checkpoint-skipped": {"event": "checkpoint_skipped", "step": 11},
        "resumed": {"event": "resumed", "step": 10},
        "reasoning-eval": {"event": "reasoning_eval", "step": 100},
        "unknown": {"event": "nope"},
    }
    for label, line in lines.items():
        put("trainer_events", label, json.dumps(line))


def hf():
    llama = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 172,
             "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
             "vocab_size": 256, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
             "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32"}
    index = {"metadata": {"total_size": 100}, "weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors"}}
    put("hf_import", "llama", json.dumps(llama) + SEP.decode() + json.dumps(index))
    mistral = dict(llama, architectures=["MistralForCausalLM"], sliding_window=32)
    put("hf_import", "mistral", json.dumps(mistral) + SEP.decode() + "{}")
    iha = dict(llama, architectures=["LoomIhaForCausalLM"],
               loom={"attention": {"kind": "iha", "options": {"p": 2}}})
    put("hf_import", "loom-iha", json.dumps(iha) + SEP.decode() +
        json.dumps({"weight_map": {"x": "../escape.safetensors"}}))


def chat():
    put("chat_jsonl", "openthoughts", json.dumps({"system": "You reason.", "conversations": [
        {"from": "user", "value": "What is 2+3?"},
        {"from": "assistant", "value": "<think>2+3=5</think> 5"}]}))
    put("chat_jsonl", "messages", json.dumps({"messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": "hi ✓"},
        {"role": "assistant", "content": "hello"}]}))
    put("chat_jsonl", "human-gpt", json.dumps({"conversations": [
        {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}))
    put("chat_jsonl", "ops-range", "2-4")
    put("chat_jsonl", "ops-one", "3")


def token_index():
    index = {"format": "loom-tokens", "version": 1, "dtype": "uint16", "vocab_size": 256,
             "tokenizer": "byte", "documents": 3, "total_tokens": 300,
             "shards": [{"file": "shard-00000.bin", "tokens": 200, "crc32c": "0a1b2c3d"},
                        {"file": "shard-00001.bin", "tokens": 100, "crc32c": "deadbeef"}]}
    put("token_index", "two-shards", json.dumps(index, indent=1))
    put("token_index", "bpe", json.dumps(dict(index, dtype="uint32", vocab_size=128256,
                                              tokenizer="bpe:tokenizer.json")))
    put("token_index", "bad-sum", json.dumps(dict(index, total_tokens=301)))


def serve():
    put("serve_request", "completion", b"p" + json.dumps({
        "model": "m", "prompt": "Once upon", "max_tokens": 8, "temperature": 0.7, "top_p": 0.9,
        "n": 2, "stop": ["\n"], "seed": 3, "logprobs": 2, "echo": True}).encode())
    put("serve_request", "completion-ids", b"p" + json.dumps({
        "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 0, "echo": True, "logprobs": 0}).encode())
    put("serve_request", "completion-batch", b"p" + json.dumps({
        "prompt": ["a", "b"], "stream": True, "stream_options": {"include_usage": True}}).encode())
    put("serve_request", "chat", b"c" + json.dumps({
        "model": "m", "messages": [{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": "2+2?"}],
        "max_completion_tokens": 16, "logprobs": True, "top_logprobs": 3, "n": 1}).encode())
    put("serve_request", "chat-bad", b"c" + json.dumps({
        "messages": [{"role": "tool", "content": 1}], "temperature": -1}).encode())


def rest():
    spec = {"spec": {"preset": "micro", "steps": 40, "checkpoint": {"interval": 10}},
            "world_size": 1}
    reqs = {
        "submit": ("POST /v1/jobs", json.dumps(spec)),
        "submit-bad": ("POST /v1/jobs", json.dumps({"spec": {"preset": "nope"}, "world_size": 0})),
        "list": ("GET /v1/jobs?state=QUEUED&page_size=2&page_token=abc", ""),
        "get": ("GET /v1/jobs/job-000001", ""),
        "metrics": ("GET /v1/jobs/job-000001/metrics?series=loss&after_step=3", ""),
        "logs": ("GET /v1/jobs/job-000001/logs?offset=0&limit=100", ""),
        "cancel": ("POST /v1/jobs/job-000001/cancel", "{}"),
        "sweep": ("POST /v1/sweeps", (ROOT / "examples" / "sweep-lr.yaml").read_text()),
        "sweeps": ("GET /v1/sweeps?page_size=1", ""),
        "sweep-report": ("GET /v1/sweeps/sweep-000001/report", ""),
        "checkpoints": ("GET /v1/checkpoints?job=job-000001", ""),
        "workers": ("GET /v1/workers", ""),
        "healthz": ("GET /healthz", ""),
        "prom": ("GET /metrics", ""),
        "console": ("GET /", ""),
        "agent": ("POST /v1/agent/heartbeat", "{}"),
        "encoded": ("GET /v1/jobs/job%2D000001?x=%zz&y=a+b", ""),
        "update": ("PATCH /v1/jobs/job-000001", json.dumps({"priority": 3, "keep_last": 2})),
        "update-bad": ("PATCH /v1/jobs/job-000001", json.dumps({"priority": 1e12, "keep_every": "x"})),
        "quota": ("PUT /v1/quotas/user/bob", json.dumps({"slots": 4, "weight": 2.5})),
        "quota-nan": ("PUT /v1/quotas/user/bob", '{"weight": "NaN"}'),
        "quotas": ("GET /v1/quotas", ""),
        "quota-delete": ("DELETE /v1/quotas/user/bob", ""),
    }
    for label, (head, body) in reqs.items():
        put("rest_routes", label, head + "\n" + body)


if __name__ == "__main__":
    for f in [job_specs, overrides, safetensors, manifests, s3_xml, tokenizers, sentencepiece, events, hf,
              chat, token_index, serve, rest]:
        f()

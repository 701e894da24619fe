#!/usr/bin/env python3
"""Loom's byte-level BPE (data/bpe_tokenizer.cc, `loom-data encode`) against Hugging Face's own
tokenizers, the Rust library from PyPI (tokenizers 0.23, pinned in scripts/pins/torch.txt), on the
real Llama-3 tokenizer.json: identical ids on 6 000 generated strings and edge cases (ASCII,
whitespace runs, digits, punctuation and contractions, CJK, combining marks, other scripts, emoji,
special tokens, invalid UTF-8), and Loom's decode giving each input back.

Invalid UTF-8 (docs/interop.md, "Byte-level BPE"): Loom encodes bytes, decoding invalid sequences
the WHATWG / Unicode way (each maximal invalid subpart -> U+FFFD); Python's
bytes.decode("utf-8", "replace") does the same, and the Rust library gets that text. Unlike the
JavaScript twin (tests/bpe_parity_test.js), U+0085 and U+FEFF are in: Python passes them through
unchanged and both libraries follow Unicode's White_Space.

A failure names the string (its index, kind and text) and the first token index that differs.
"""
import argparse
import base64
import json
import os
import random
import subprocess
import sys
import tempfile

from tokenizers import Tokenizer

WORDS = ["the", "The", "attention", "Interleaved", "heads", "model", "tokenizer", "don't", "it's",
         "WE'LL", "they're", "I've", "she'd", "naïve", "café", "über", "Straße", "ﬁnance"]
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|reserved_special_token_7|>", "<|eot", "<|", "|>"]
SPACES = [" ", "  ", "\t", "\n", "\r\n", "\n\n", " \n ", "\u00a0", "\u2003", "\u3000", "\u2028",
          "\u200b", "\u000b", "\f", "\u0085", "\ufeff", "    ", "\t\t "]
SCRIPTS = [(0x410, 0x44F), (0x391, 0x3C9), (0x627, 0x64A), (0x5D0, 0x5EA), (0xE01, 0xE3A)]  # Cyrillic .. Thai
BAD_BYTES = [b"\x80", b"\xbf", b"\xc0\x80", b"\xc1\xbf", b"\xe0\x80\x80", b"\xed\xa0\x80",
             b"\xf0\x8f\xbf\xbf", b"\xf4\x90\x80\x80", b"\xf5", b"\xff", b"\xe2\x82", b"\xf0\x9f\x98",
             b"\xc3", b"\xe4\xbd\x41"]


class Corpus:
    """Seeded generators: the same strings on every run."""

    def __init__(self, seed):
        self.r = random.Random(seed)

    def cp(self, lo, hi):
        return chr(self.r.randint(lo, hi))

    def rep(self, n, f):
        return "".join(f() for _ in range(1 + self.r.randrange(n)))

    def pick(self, xs):
        return self.r.choice(xs)

    def text(self, kind):
        r, pick, cp = self.r, self.pick, self.cp
        if kind == "ascii":
            return self.rep(12, lambda: pick(WORDS) + pick([" ", " ", ", ", ". ", "\n"]))
        if kind == "printable":
            return self.rep(40, lambda: cp(0x20, 0x7E))
        if kind == "whitespace":
            return self.rep(8, lambda: pick(SPACES) + (pick(WORDS) if r.random() < 0.5 else ""))
        if kind == "digits":
            return self.rep(5, lambda: pick(["", " ", "-", ".", ",", "x"]) + str(r.randrange(10 ** r.randint(1, 13))))
        if kind == "punctuation":
            return self.rep(10, lambda: pick(["!!", "?", "...", "---", '"', "''", "(", ")]", "{", "}", "<", ">",
                                              "@#$", "%", "^&*", "~", "`", ";:", "'s", "'S", "'ll", "'Re"])
                            + pick(["", " "]))
        if kind == "cjk":
            return self.rep(20, lambda: pick([lambda: cp(0x4E00, 0x9FFF), lambda: cp(0x3040, 0x309F),
                                              lambda: cp(0xAC00, 0xD7A3), lambda: "。", lambda: "，",
                                              lambda: " "])())
        if kind == "combining":
            return self.rep(10, lambda: pick(["e", "a", "o", "न", "क", "ا"]) + self.rep(3, lambda: cp(0x300, 0x36F))
                            + pick(["", " "]))
        if kind == "scripts":
            return self.rep(10, lambda: self.rep(6, lambda: cp(*pick(SCRIPTS))) + " ")
        if kind == "emoji":
            return self.rep(8, lambda: pick([lambda: cp(0x1F600, 0x1F64F), lambda: cp(0x1F300, 0x1F5FF),
                                             lambda: "👩\u200d💻", lambda: "👍🏽", lambda: "🇫🇷", lambda: "❤️",
                                             lambda: " ", lambda: pick(WORDS)])())
        if kind == "specials":
            return self.rep(6, lambda: pick([pick(SPECIALS), pick(WORDS), " ", "\n"]))
        return self.rep(6, lambda: self.text(pick(KINDS[:-1])))  # mixed

    def invalid(self):
        data = self.text(self.pick(["ascii", "cjk", "emoji", "combining"])).encode()
        for _ in range(1 + self.r.randrange(3)):
            at = self.r.randrange(len(data) + 1)
            data = data[:at] + self.pick(BAD_BYTES) + data[at:]
        if self.r.random() < 0.3:
            data = data[:max(0, len(data) - 1 - self.r.randrange(3))]
        return data


KINDS = ["ascii", "printable", "whitespace", "digits", "punctuation", "cjk", "combining", "scripts",
         "emoji", "specials", "mixed"]
EDGES = [b"", b" ", b"a" * 5000, b"9" * 1000, b" \n" * 500, b"<|eot_id|><|eot_id|>", b"\xef\xbb\xbfBOM",
         "\u0085next line".encode(), b"\t" * 300, "😀" * 200, b"\xff" * 10]


def strings(n):
    corpus = Corpus(0x10011)
    out = []
    for i in range(n):
        if i % 12 == 11:
            out.append(("invalid", corpus.invalid()))
        else:
            kind = KINDS[i % len(KINDS)]
            out.append((kind, corpus.text(kind).encode()))
    return out + [("edge", e if isinstance(e, bytes) else e.encode()) for e in EDGES]


def loom_encode(loom_data, tokenizer_json, inputs, tmp):
    path = os.path.join(tmp, "strings.b64")
    with open(path, "w") as f:
        f.write("".join(base64.b64encode(b).decode() + "\n" for _, b in inputs))
    out = subprocess.run([loom_data, "encode", "--tokenizer", tokenizer_json, "--input", path],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"loom-data encode: exit {out.returncode}: {out.stderr[-2000:]}"
    return [json.loads(line) for line in out.stdout.splitlines() if line]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loom-data", required=True)
    ap.add_argument("--source-dir", required=True)
    a = ap.parse_args()
    tokenizer_json = os.path.join(a.source_dir, ".tools", "node_modules", "@lenml", "tokenizer-llama3",
                                  "models", "tokenizer.json")
    assert os.path.exists(tokenizer_json), f"{tokenizer_json}: scripts/install-deps installs it"
    reference = Tokenizer.from_file(tokenizer_json)
    inputs = strings(6000)
    with tempfile.TemporaryDirectory(prefix="loom-hf-tokenizers-") as tmp:
        got = loom_encode(a.loom_data, tokenizer_json, inputs, tmp)
    assert len(got) == len(inputs), (len(got), len(inputs))
    mismatches, round_trips, per_kind, tokens = [], [], {}, 0
    for i, ((kind, data), loom) in enumerate(zip(inputs, got)):
        text = data.decode("utf-8", "replace")
        want = reference.encode(text, add_special_tokens=False).ids
        per_kind[kind] = per_kind.get(kind, 0) + 1
        tokens += len(want)
        if want != loom["ids"]:
            at = next((j for j, (x, y) in enumerate(zip(want, loom["ids"])) if x != y),
                      min(len(want), len(loom["ids"])))
            mismatches.append(f"string {i} ({kind}) {text[:120]!r}: first difference at token {at}: "
                              f"tokenizers {want[at:at + 5]}, Loom {loom['ids'][at:at + 5]}")
        if base64.b64decode(loom["decoded"]).decode("utf-8", "replace") != text:
            round_trips.append(f"string {i} ({kind}) {text[:120]!r} does not decode back")
    for line in (mismatches + round_trips)[:8]:
        print(line, file=sys.stderr)
    assert not mismatches, f"{len(mismatches)} of {len(inputs)} strings tokenize differently"
    assert not round_trips, f"{len(round_trips)} strings do not decode back"
    kinds = ", ".join(f"{k} {n}" for k, n in per_kind.items())
    print(f"ok: {len(inputs)} strings ({kinds}), {tokens} tokens: ids identical to Hugging Face tokenizers "
          f"{__import__('tokenizers').__version__} (Rust) on Llama 3's tokenizer.json; Loom's decode gives every "
          "input back")


if __name__ == "__main__":
    main()

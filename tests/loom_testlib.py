"""Helpers shared by the end-to-end test scripts: reading safetensors files and checkpoints from
the published format, parsing the trainer's JSON-lines log, picking free ports."""
import json
import os
import re
import socket
import struct


def safetensors_raw(path):
    """{name: (dtype, shape, bytes)} read with the published format alone (8-byte length, JSON
    header, data), so the test does not trust Loom's own reader."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    return {name: (e["dtype"], e["shape"], data[e["data_offsets"][0]:e["data_offsets"][1]])
            for name, e in header.items() if name != "__metadata__"}


def shard_path(checkpoint_dir, rank=0):
    prefix = f"shard-{rank:05d}-of-"
    return os.path.join(checkpoint_dir, next(f for f in os.listdir(checkpoint_dir) if f.startswith(prefix)))


def step_losses(jsonl):
    """step -> the loss exactly as the trainer logged it (17 significant digits)."""
    out = {}
    with open(jsonl) as f:
        for line in f:
            m = re.search(r'"event":"step","step":(\d+),"loss":([^,]+)', line)
            if m:
                out[int(m.group(1))] = m.group(2)
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_all(procs):
    """Kills every child process still running (tests must not leave ranks or trainers behind)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)

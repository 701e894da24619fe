#!/usr/bin/env python3
"""GPU worker pools without a GPU (docs/control-plane.md, "GPU nodes"): two loom-worker agents on
loopback aliases, node-a on 127.0.0.2 with --gpus 0,1,2,3 and node-b on 127.0.0.3 with --gpus 0,1,
run one 6-rank Gloo job that spans both. While it runs, the test reads every rank process's
environment and checks the binding: a GPU of its own per rank (CUDA_VISIBLE_DEVICES distinct on a
node, one of that node's GPUs), LOCAL_RANK 0..n-1 and LOCAL_WORLD_SIZE n per node, the torchrun
names (RANK, WORLD_SIZE), one rendezvous (MASTER_ADDR = rank 0's node, one MASTER_PORT) and each
node's own address for Gloo (LOOM_NODE_ADDR). Then it SIGKILLs node-b's ranks: the whole gang
restarts (node-a's ranks are replaced too, new attempt) and the job succeeds. Its final loss must
equal that of the same job run as 6 ranks on one CPU node (--gpus none). The workers API lists
the GPUs; a registration claiming more slots than GPUs is refused. Each node's /metrics lists its
GPUs (loom_worker_gpu_info{gpu, UUID, modelName}) and, while the job runs, which rank of which
job holds each one (loom_worker_gpu_assigned{job_id, rank, gpu, UUID}: the join key for
dcgm-exporter's series), matching the ranks' CUDA_VISIBLE_DEVICES; the series go when the ranks
do. Every process is killed on exit."""
import json
import os
import re
import signal
import sys
import tempfile
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loom_testlib import Service, control_plane_arg_parser, loom_trainers, stop_all, wait_for  # noqa: E402

PROCS = []
USER_TOKEN = "alice-token-0123456789abcdef"
WORKER_TOKEN = "worker-token-0123456789abcdef"
NODES = {"node-a": ("127.0.0.2", "0,1,2,3"), "node-b": ("127.0.0.3", "0,1")}


def spec(steps=60):
    return {"preset": "micro", "steps": steps, "micro_batch": 2, "seq_len": 32, "threads": 1,
            "dist_timeout_seconds": 30, "data": {"corpus_bytes": 65536}, "eval": {"batches": 1},
            "checkpoint": {"interval": 10, "keep_last": 2}, "metrics": {"log_every": 10}}


def rank_envs(root, job_id, attempt=None):
    """pid -> environment (str -> str) of the live loom-train ranks of a job that this test's
    agents started (under root): every suite's coordinator numbers its jobs from job-000001, so
    under ctest -j another suite's job-000001 attempt 1 would match on the ids alone."""
    out = {}
    for t in loom_trainers(root):
        if t["job"] != job_id or (attempt is not None and t["attempt"] != attempt):
            continue
        try:
            with open(f"/proc/{t['pid']}/environ", "rb") as f:
                env = dict(kv.decode().split("=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except (OSError, UnicodeDecodeError):
            continue
        out[t["pid"]] = env
    return out


def check_binding(envs):
    """The binding of one attempt's 6 ranks across node-a and node-b."""
    by_node = {}
    for env in envs.values():
        by_node.setdefault(env["LOOM_WORKER_NAME"], []).append(env)
    assert sorted((n, len(e)) for n, e in by_node.items()) == [("node-a", 4), ("node-b", 2)], by_node.keys()
    ranks = sorted(int(e["RANK"]) for e in envs.values())
    assert ranks == list(range(6)) and all(e["RANK"] == e["LOOM_RANK"] and e["WORLD_SIZE"] == "6"
                                           for e in envs.values()), ranks
    rendezvous = {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs.values()}
    assert len(rendezvous) == 1, rendezvous
    rank0 = next(e for e in envs.values() if e["RANK"] == "0")
    assert rank0["MASTER_ADDR"] == NODES[rank0["LOOM_WORKER_NAME"]][0], rank0
    for node, envs_of_node in by_node.items():
        address, gpus = NODES[node]
        visible = [e["CUDA_VISIBLE_DEVICES"] for e in envs_of_node]
        assert len(set(visible)) == len(visible) and set(visible) <= set(gpus.split(",")), (node, visible)
        assert sorted(int(e["LOCAL_RANK"]) for e in envs_of_node) == list(range(len(envs_of_node))), node
        assert all(e["LOCAL_WORLD_SIZE"] == str(len(envs_of_node)) for e in envs_of_node), node
        assert all(e["LOOM_NODE_ADDR"] == address for e in envs_of_node), node
    return {n: sorted(e["CUDA_VISIBLE_DEVICES"] for e in v) for n, v in by_node.items()}


def metrics_url(tmp, node):
    """The node's /metrics, from the file_sd target list its agent wrote."""
    path = os.path.join(tmp, f"{node}.sd.json")
    target = wait_for(f"{node}'s metrics target", lambda: os.path.exists(path) and json.load(open(path)), 30)
    return f"http://{target[0]['targets'][0]}/metrics"


def gpu_series(url, family):
    """[labels dict] of one gauge family's series whose value is 1."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = []
    for m in re.finditer(r"^" + family + r"\{([^}]*)\} 1$", text, re.M):
        out.append(dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))))
    return out


def check_gpu_metrics(urls, job_id, envs):
    """Each node's gpu_info lists its GPUs; gpu_assigned names, for every rank, the GPU its
    CUDA_VISIBLE_DEVICES holds (an index: --gpus lists have no UUIDs)."""
    for node, (_, gpus) in NODES.items():
        info = sorted(int(g["gpu"]) for g in gpu_series(urls[node], "loom_worker_gpu_info"))
        assert info == [int(x) for x in gpus.split(",")], (node, info)
    for node in NODES:
        want = sorted((e["RANK"], e["CUDA_VISIBLE_DEVICES"]) for e in envs.values() if e["LOOM_WORKER_NAME"] == node)
        got = wait_for(f"{node}'s gpu_assigned series", lambda: (lambda g: g if len(g) == len(want) else None)(
            sorted((s["rank"], s["gpu"]) for s in gpu_series(urls[node], "loom_worker_gpu_assigned")
                   if s.get("job_id") == job_id)), 10)
        assert got == want, (node, got, want)


def final_loss(c, job_id):
    job = c.api.wait_end(job_id, timeout=300)
    assert job["state"] == "succeeded", job
    return job["progress"]["loss"], job


def main():
    args = control_plane_arg_parser().parse_args()
    tmp = tempfile.mkdtemp(prefix="loom-gpu-binding-")
    c = Service(args, tmp, {"alice": USER_TOKEN}, WORKER_TOKEN,
                ["--heartbeat-ms", "200", "--lost-after-ms", "4000", "--term-grace-ms", "2000"], PROCS)
    try:
        c.start_coordinator()
        for node, (address, gpus) in NODES.items():
            c.start_worker(node, labels="pool=gpu", slots=len(gpus.split(",")),
                           extra=("--gpus", gpus, "--address", address, "--metrics-port", "-1",
                                  "--prometheus-sd-file", os.path.join(tmp, f"{node}.sd.json")))
        c.start_worker("node-cpu", labels="pool=cpu", slots=6)  # --gpus none
        c.wait_alive(["node-a", "node-b", "node-cpu"])
        records = c.worker_records()
        assert [g["index"] for g in records["node-a"]["gpus"]] == [0, 1, 2, 3], records["node-a"]
        assert [g["index"] for g in records["node-b"]["gpus"]] == [0, 1], records["node-b"]
        assert not records["node-cpu"].get("gpus"), records["node-cpu"]
        code, _, message = c.agent.register({
            "address": "127.0.0.9", "slots": 3, "name": "liar", "gpus": [{"index": 0}, {"index": 1}]}, WORKER_TOKEN)
        assert code == "INVALID_ARGUMENT" and "slots" in message and "GPUs" in message, (code, message)
        print("ok: the workers API lists each node's GPUs; more slots than GPUs is refused")

        job_id = c.api.ok("POST", "/v1/jobs", {"spec": spec(), "world_size": 6, "pool": {"pool": "gpu"}})["id"]
        envs = wait_for("6 ranks of attempt 1", lambda: (lambda e: len(e) == 6 and e)(rank_envs(tmp, job_id, 1)), 60)
        bound = check_binding(envs)
        print(f"ok: 6 ranks over two nodes, one GPU each: {bound}, one rendezvous")
        urls = {node: metrics_url(tmp, node) for node in NODES}
        check_gpu_metrics(urls, job_id, envs)
        print("ok: each node's /metrics lists its GPUs and which rank of the job holds each")

        c.api.wait(job_id, lambda j: int(j.get("progress", {}).get("step", 0)) >= 10, "step 10", 120)
        first = set(envs)
        victims = [pid for pid, e in envs.items() if e["LOOM_WORKER_NAME"] == "node-b"]
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        again = wait_for("the gang restarted as attempt 2",
                         lambda: (lambda e: len(e) == 6 and e)(rank_envs(tmp, job_id, 2)), 90)
        assert not set(again) & first, "node-a's ranks of attempt 1 must be replaced too"
        assert not rank_envs(tmp, job_id, 1), "no rank of attempt 1 may survive"
        check_binding(again)
        gang_loss, job = final_loss(c, job_id)
        assert int(job["attempt"]) >= 2, job
        for node in NODES:
            wait_for(f"{node}'s gpu_assigned series gone", lambda: not gpu_series(urls[node], "loom_worker_gpu_assigned"), 10)
        print(f"ok: SIGKILL of node-b's ranks restarted the whole gang (attempt {job['attempt']}), "
              f"succeeded at loss {gang_loss}")

        one_node = c.api.ok("POST", "/v1/jobs", {"spec": spec(), "world_size": 6, "pool": {"pool": "cpu"}})["id"]
        one_loss, _ = final_loss(c, one_node)
        assert abs(one_loss - gang_loss) <= 1e-5 * abs(one_loss), (one_loss, gang_loss)
        print(f"ok: the two-node gang ends at the loss of 6 ranks on one node ({one_loss} vs {gang_loss})")
    except BaseException:
        c.dump_logs()
        raise
    finally:
        stop_all(PROCS, tmp)
    os.system(f"rm -rf {tmp}")
    print("gpu_binding_test: ok")


if __name__ == "__main__":
    sys.exit(main())

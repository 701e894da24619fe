#!/usr/bin/env python3
"""Data parallelism with real processes over c10d Gloo on loopback: W ranks with micro-batch b
train exactly like one rank with W*b (float64, tolerance 1e-10 absolute on losses and weights),
a checkpoint written by 2 ranks resumes on 1 and on 3, checkpoints by wall-clock time
(checkpoint.interval_seconds) are taken at the same step by every rank however their clocks differ
(rank 1 is SIGSTOPped 1.5 s) and resume exactly, and kill -9 of one rank makes the other
exit with a clear error within the timeout. Every process is killed on exit."""
import argparse
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loom_testlib import free_port, kill_all, safetensors_raw, shard_path, step_losses  # noqa: E402

PROCS = []
TOL = 1e-10


def write_spec(tmp, name, micro_batch, steps=6, **extra):
    spec = {"preset": "micro", "steps": steps, "micro_batch": micro_batch, "seq_len": 32, "threads": 1,
            "precision": "fp64", "optimizer": {"warmup_steps": 1}, "dist_timeout_seconds": 20,
            "data": {"corpus_bytes": 65536}, "eval": {"batches": 1},
            "checkpoint": {"dir": os.path.join(tmp, name), "interval": 3},
            "metrics": {"jsonl": os.path.join(tmp, name + ".jsonl"), "log_every": 1}}
    spec.update(extra)
    path = os.path.join(tmp, name + ".json")
    with open(path, "w") as f:
        json.dump(spec, f)
    return path


def launch(loom, world, spec_path, extra_args=(), port=None):
    port = port or free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "LOOM_RANK": str(rank), "LOOM_WORLD_SIZE": str(world),
               "LOOM_MASTER_ADDR": "127.0.0.1", "LOOM_MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        p = subprocess.Popen([loom, "train", "--spec", spec_path, *extra_args], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        PROCS.append(p)
        procs.append(p)
    return procs


def wait_all(procs, timeout=300):
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise AssertionError(f"rank exited {p.returncode}:\n{out}\n{err}")
        outs.append(out)
    return outs


def wait_for_step(rank0, step, timeout=120):
    """Reads rank 0's progress lines until it reports `step`."""
    deadline = time.time() + timeout
    for line in rank0.stdout:
        if re.match(rf"step {step}/", line.strip()):
            return
        assert time.time() < deadline, "rank 0 never made progress"
    raise AssertionError(f"rank 0 exited before step {step}")


def losses(jsonl):
    return {step: float(loss) for step, loss in step_losses(jsonl).items()}


def weights(ckpt):
    """float64 parameters of a checkpoint (rank 0's shard holds them)."""
    return {name: struct.unpack(f"<{len(data) // 8}d", data)
            for name, (dtype, _, data) in safetensors_raw(shard_path(ckpt)).items()
            if name.startswith("model.") and dtype == "F64"}


def assert_close(a, b, what):
    assert a.keys() == b.keys(), what
    for k in a:
        worst = max(abs(x - y) for x, y in zip(a[k], b[k])) if a[k] else 0.0
        assert worst < TOL, f"{what}: {k} differs by {worst}"


def test_ranks_match_one_big_batch(loom, tmp):
    wait_all(launch(loom, 1, write_spec(tmp, "w1", 6)))
    ref_loss = losses(os.path.join(tmp, "w1.jsonl"))
    ref_w = weights(os.path.join(tmp, "w1", "step-00000006"))
    # 2 ranks: 4 KiB buckets, so many all-reduces start while backward still runs. 3 ranks with
    # micro-batch 1 and 2 accumulation steps: only the last micro-batch communicates.
    for world, b, extra in ((2, 3, {"dist_bucket_bytes": 4096}), (3, 1, {"grad_accum": 2})):
        name = f"w{world}"
        outs = wait_all(launch(loom, world, write_spec(tmp, name, b, **extra)))
        assert f"{world} rank(s)" in outs[0], outs[0]
        m = re.search(r"gradient all-reduce: (\d+) bucket\(s\) of <= (\d+) bytes, (\d+) started during backward",
                      outs[0])
        assert m, outs[0]
        if world == 2:
            assert int(m.group(1)) > 5 and int(m.group(3)) >= int(m.group(1)) // 2, m.group(0)
        got = losses(os.path.join(tmp, name + ".jsonl"))
        assert sorted(got) == sorted(ref_loss)
        for step in ref_loss:
            assert abs(got[step] - ref_loss[step]) < TOL, (world, step, got[step], ref_loss[step])
        assert_close(weights(os.path.join(tmp, name, "step-00000006")), ref_w, f"{world} ranks")
        print(f"{world} gloo ranks x micro-batch {b} {extra} == 1 rank x 6: losses and weights within {TOL} "
              f"({m.group(0)})")


def test_resume_on_other_world_sizes(loom, tmp):
    ref_w = weights(os.path.join(tmp, "w1", "step-00000006"))
    ref_loss = losses(os.path.join(tmp, "w1.jsonl"))
    wait_all(launch(loom, 2, write_spec(tmp, "saved2", 3), ["--stop-after", "3"]))
    for world, b in ((1, 6), (3, 2)):
        name = f"resume{world}"
        shutil.copytree(os.path.join(tmp, "saved2"), os.path.join(tmp, name))
        outs = wait_all(launch(loom, world, write_spec(tmp, name, b), ["--resume", os.path.join(tmp, name)]))
        assert "at step 3" in outs[0], outs[0]
        got = losses(os.path.join(tmp, name + ".jsonl"))
        for step in (4, 5, 6):
            assert abs(got[step] - ref_loss[step]) < TOL, (world, step)
        assert_close(weights(os.path.join(tmp, name, "step-00000006")), ref_w, f"resume on {world}")
        print(f"checkpoint of 2 ranks resumed on {world}: matches the uninterrupted run")


def test_zero1_and_resharding(loom, tmp):
    ref_loss = losses(os.path.join(tmp, "w1.jsonl"))
    ref_w = weights(os.path.join(tmp, "w1", "step-00000006"))
    wait_all(launch(loom, 2, write_spec(tmp, "zero2", 3, zero_stage=1)))
    got = losses(os.path.join(tmp, "zero2.jsonl"))
    for step in ref_loss:
        assert abs(got[step] - ref_loss[step]) < TOL, ("zero", step)
    assert_close(weights(os.path.join(tmp, "zero2", "step-00000006")), ref_w, "ZeRO-1 on 2 ranks")
    with open(os.path.join(tmp, "zero2", "step-00000003", "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["world_size"] == 2 and len(manifest["shards"]) == 2, manifest["shards"]
    print("ZeRO-1 on 2 ranks == 1 rank; its checkpoint has one shard per rank")
    # Reshard: the 2-shard checkpoint at step 3 continues on 3 ZeRO ranks and on 1 plain rank.
    for world, b, zero in ((3, 2, 1), (1, 6, 0)):
        name = f"zres{world}"
        os.makedirs(os.path.join(tmp, name))
        shutil.copytree(os.path.join(tmp, "zero2", "step-00000003"), os.path.join(tmp, name, "step-00000003"))
        outs = wait_all(launch(loom, world, write_spec(tmp, name, b, zero_stage=zero),
                               ["--resume", os.path.join(tmp, name)]))
        assert "at step 3" in outs[0], outs[0]
        got = losses(os.path.join(tmp, name + ".jsonl"))
        for step in (4, 5, 6):
            assert abs(got[step] - ref_loss[step]) < TOL, (world, step)
        assert_close(weights(os.path.join(tmp, name, "step-00000006")), ref_w, f"reshard onto {world}")
        print(f"2-shard ZeRO-1 checkpoint resumed on {world} rank(s) (zero_stage {zero}): identical")


def committed(ckpt_root):
    return sorted(int(d[len("step-"):]) for d in os.listdir(ckpt_root)
                  if d.startswith("step-") and os.path.exists(os.path.join(ckpt_root, d, "manifest.json")))


def test_timed_checkpoints_agree(loom, tmp):
    """Only rank 0's clock decides; a rank stalled by SIGSTOP must still checkpoint with it (ZeRO-1:
    each rank writes its own shard, so a disagreement would hang or leave one shard)."""
    steps = 200
    timed = {"interval": 0, "interval_seconds": 1, "keep_last": 1000}
    spec = write_spec(tmp, "timed", 3, steps=steps, zero_stage=1,
                      checkpoint={"dir": os.path.join(tmp, "timed"), **timed})
    r0, r1 = launch(loom, 2, spec)
    wait_for_step(r0, 5)
    os.kill(r1.pid, signal.SIGSTOP)
    time.sleep(1.5)
    os.kill(r1.pid, signal.SIGCONT)
    out0, err0 = r0.communicate(timeout=300)
    out1, err1 = r1.communicate(timeout=60)
    assert r0.returncode == 0 and r1.returncode == 0, err0 + err1
    saved = committed(os.path.join(tmp, "timed"))
    early = [s for s in saved if s < steps]
    assert early and saved[-1] == steps, f"no checkpoint by time before step {steps}: {saved}"
    for s in saved:
        with open(os.path.join(tmp, "timed", f"step-{s:08d}", "manifest.json")) as f:
            m = json.load(f)
        assert m["world_size"] == 2 and len(m["shards"]) == 2, (s, m["shards"])
    first = early[0]
    name = "timed-resume1"
    resume_spec = write_spec(tmp, name, 6, steps=steps, checkpoint={"dir": os.path.join(tmp, name), **timed})
    wait_all(launch(loom, 1, resume_spec,
                    ["--resume", os.path.join(tmp, "timed", f"step-{first:08d}")]))
    assert_close(weights(os.path.join(tmp, name, f"step-{steps:08d}")),
                 weights(os.path.join(tmp, "timed", f"step-{steps:08d}")), "resume of a timed checkpoint")
    print(f"checkpoints by time on 2 ZeRO ranks, rank 1 SIGSTOPped 1.5 s: steps {saved}, every one with both "
          f"shards; step {first} resumed on 1 rank ends within {TOL} of the 2-rank run")


def test_mpirun(loom, tmp):
    mpirun = shutil.which("mpirun")
    assert mpirun, "mpirun not found (install openmpi-bin)"
    ref_loss = losses(os.path.join(tmp, "w1.jsonl"))
    ref_w = weights(os.path.join(tmp, "w1", "step-00000006"))
    spec = write_spec(tmp, "mpi", 3, dist_backend="mpi")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMPI_MCA_btl": "self,tcp", "OMPI_MCA_rmaps_base_oversubscribe": "1"}
    p = subprocess.run([mpirun, "--allow-run-as-root", "-np", "2", "-x", "LOOM_PLUGIN_PATH", "-x", "OMP_NUM_THREADS",
                        loom, "train", "--spec", spec], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 rank(s)" in p.stdout, p.stdout
    got = losses(os.path.join(tmp, "mpi.jsonl"))
    for step in ref_loss:
        assert abs(got[step] - ref_loss[step]) < TOL, (step, got[step], ref_loss[step])
    assert_close(weights(os.path.join(tmp, "mpi", "step-00000006")), ref_w, "mpirun -np 2")
    print(f"mpirun -np 2 x micro-batch 3 == 1 rank x 6: losses and weights within {TOL}")


def test_nccl_without_gpu(loom, tmp):
    """dist_backend nccl on a machine without a GPU: every rank refuses clearly and quickly
    (the NCCL path is compiled in whenever the CUDA toolkit is; GPU runs: scripts/gpu-check)."""
    spec = write_spec(tmp, "nccl", 3, dist_backend="nccl", dist_timeout_seconds=10)
    start = time.time()
    procs = launch(loom, 2, spec)
    outs = [p.communicate(timeout=60) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode != 0, out
        assert ("no CUDA device is visible" in err or "this build has no NCCL" in err), err
    assert time.time() - start < 30
    print("nccl without a GPU: both ranks refused with a clear error")


def test_killed_rank_fails_the_other(loom, tmp):
    spec = write_spec(tmp, "kill", 2, steps=100000, dist_timeout_seconds=10, checkpoint={"dir": ""})
    r0, r1 = launch(loom, 2, spec)
    wait_for_step(r0, 3)
    os.kill(r1.pid, signal.SIGKILL)
    killed_at = time.time()
    try:
        _, err = r0.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError("rank 0 hung after its peer was killed")
    elapsed = time.time() - killed_at
    assert r0.returncode != 0, "rank 0 should fail"
    assert "rank 0" in err and ("all-reduce failed" in err or "barrier failed" in err), err
    assert elapsed < 30, f"took {elapsed:.1f}s"
    print(f"kill -9 of rank 1: rank 0 failed in {elapsed:.1f}s: {err.strip().splitlines()[-1][:120]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loom-train", required=True)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="loom_dist_")
    try:
        test_ranks_match_one_big_batch(args.loom_train, tmp)
        test_resume_on_other_world_sizes(args.loom_train, tmp)
        test_zero1_and_resharding(args.loom_train, tmp)
        test_timed_checkpoints_agree(args.loom_train, tmp)
        test_mpirun(args.loom_train, tmp)
        test_nccl_without_gpu(args.loom_train, tmp)
        test_killed_rank_fails_the_other(args.loom_train, tmp)
    finally:
        kill_all(PROCS)
        shutil.rmtree(tmp, ignore_errors=True)
    print("distributed: ok")


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""The naive peer for loom-bench-attention: IHA as a straightforward PyTorch module computes it
(written from docs/iha.md, not taken from any third-party code): mix the H heads into P pseudo-
heads each, interleave them into an N·P sequence, run materialising causal attention over it,
un-interleave and collapse. Runs under Debian's python3-torch, one thread, fp32.

Seed 004 (the third-party module the issue names) cannot run as distributed: its text lost its
indentation and it imports a package-relative BitLinear; this is the same materialising
algorithm it implements, so it stands in as the peer.

Prints one line: "<forward seconds> <forward+backward seconds> <peak RSS growth bytes>" (best of
--reps), so loom-bench-attention can put it in its table.
"""
import argparse
import math
import resource
import time

import torch


def naive_iha(q, k, v, aq, ak, av, r, p):
    b, n, h, d = q.shape

    def mix(x, a):  # [B, N, H, d] x [H, H, P] -> [B, H, N*P, d], token-major
        return torch.einsum("bnmd,mhj->bhnjd", x, a).reshape(b, h, n * p, d)

    qi, ki, vi = mix(q, aq), mix(k, ak), mix(v, av)
    scores = qi @ ki.transpose(-2, -1) / math.sqrt(d)
    causal = torch.ones(n * p, n * p, dtype=torch.bool).tril()
    weights = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
    out = (weights @ vi).view(b, h, n, p, d).permute(0, 2, 1, 3, 4)  # [B, N, H, P, d]
    return torch.einsum("bngjd,hgj->bnhd", out, r.view(h, h, p))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--p", type=int, required=True)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    b, n, h, d, p = a.batch, a.n, a.heads, a.dim, a.p
    q, k, v = (torch.randn(b, n, h, d, requires_grad=True) for _ in range(3))
    eye = torch.eye(h).unsqueeze(-1).repeat(1, 1, p)
    aq, ak, av = ((eye + 0.02 * torch.randn(h, h, p)).requires_grad_() for _ in range(3))
    r = (torch.randn(h, h * p) / math.sqrt(h * p)).requires_grad_()
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    best_fwd = best_total = float("inf")
    for _ in range(a.reps):
        t0 = time.perf_counter()
        out = naive_iha(q, k, v, aq, ak, av, r, p)
        t1 = time.perf_counter()
        out.sum().backward()
        t2 = time.perf_counter()
        best_fwd, best_total = min(best_fwd, t1 - t0), min(best_total, t2 - t0)
        del out
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_rss
    print(f"{best_fwd:.6f} {best_total:.6f} {peak}")


if __name__ == "__main__":
    main()

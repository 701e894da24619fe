#!/usr/bin/env bash
# Runs CMD with every running trainer rank (loom-train) stopped by SIGSTOP, and continues them
# when CMD ends, however it ends: benchmarks and CI get the machine's cores while a long sweep
# waits, and its jobs go on where they stopped (their agent keeps heartbeating, so nothing is
# fenced). `renice` does not keep the ranks' OpenMP threads off a benchmark's cores.
# usage: experiments/pause_jobs.sh CMD [ARGS…]
set -uo pipefail
[[ $# -ge 1 ]] || { sed -n '2,6p' "$0"; exit 2; }
pids=$(pgrep -x loom-train || true)
resume() { [[ -n $pids ]] && kill -CONT $pids 2>/dev/null; }
trap resume EXIT
[[ -n $pids ]] && kill -STOP $pids
"$@"

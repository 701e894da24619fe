#!/usr/bin/env bash
# Writes a finished k-hop or relation sweep's results as docs/results.md uses them: the raw
# per-job CSV and every held-out evaluation (experiments/export_sweep.py), five reports as JSON
# (final accuracy and exact match, mean accuracy over the run, steps until 80 % and 95 %), the
# accuracy plot in docs/results/, and the Markdown tables of each report on stdout.
#
# usage: experiments/report_sweep.sh SWEEP_ID NAME RESULTS_DIR [loom sweep report flags…]
#   e.g. experiments/report_sweep.sh sweep-000001 khop-simple-hops2-heads2 experiments/khop/results
#        experiments/report_sweep.sh sweep-000002 NAME-vs-x DIR --baseline sweep-000001/mha
# With extra flags (--baseline, --merge) the raw CSVs are not written: they belong to the sweep
# alone. Environment: LOOM (default build/bin/loom), LOOM_COORDINATOR (default
# http://127.0.0.1:8470), TOKEN_FILE (default: the token `loom up --data-dir DIR` wrote, found
# through LOOM_DATA_DIR).
set -euo pipefail
[[ $# -ge 3 ]] || { sed -n '7,13p' "$0"; exit 2; }
sweep=$1 name=$2 dir=$3
shift 3
cd "$(dirname "$0")/.."
loom=${LOOM:-build/bin/loom}
url=${LOOM_COORDINATOR:-http://127.0.0.1:8470}
token_file=${TOKEN_FILE:-${LOOM_DATA_DIR:?set TOKEN_FILE or LOOM_DATA_DIR}/tokens/user-token}
mkdir -p "$dir" docs/results

sweep_report() {  # the sweep's report with the caller's flags and the script's extra ones
  "$loom" --coordinator "$url" --token-file "$token_file" sweep report "$sweep" "$@" "${extra[@]}"
}

report() {  # report SUFFIX FLAGS…: one JSON report and its tables
  local out="$dir/$name.report-$1.json"
  shift
  sweep_report "$@" --format json > "$out"
  echo "### $(basename "$out")"
  python3 experiments/report_table.py "$out" --scale 100
  echo
}

extra=("$@")
if [[ ${#extra[@]} -eq 0 ]]; then
  python3 experiments/export_sweep.py --coordinator "$url" --token-file "$token_file" \
    --sweep "$sweep" --out "$dir/$name.raw.csv" --solved-accuracy 0.8 \
    --curves "$dir/$name.curves.csv"
fi
report accuracy --metric accuracy --select final
report exact_match --metric exact_match --select final
report mean --metric accuracy --select mean
report reach80 --metric accuracy --select reach --threshold 0.8
report reach95 --metric accuracy --select reach --threshold 0.95
sweep_report --metric accuracy --select final --plot "docs/results/$name-accuracy.png" > /dev/null
echo "plot: docs/results/$name-accuracy.png"

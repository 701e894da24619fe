#!/usr/bin/env bash
# Writes a finished needle sweep's results as docs/results.md uses them: the raw per-job CSVs at
# the training length and at the sweep's extra eval.lengths length, reports as JSON for answer-byte
# accuracy, exact match and held-out loss at both lengths, the accuracy and loss plots in
# docs/results/, and the Markdown tables on stdout. With a second sweep's raw CSV (another
# context length), also the change of the hybrid - MHA difference between the two
# (experiments/compare_settings.py: Welch, since two lengths draw different data).
#
# usage: experiments/needle/report_needle.sh SWEEP_ID NAME EXTRA_LENGTH [OTHER.raw.csv]
#   e.g. experiments/needle/report_needle.sh sweep-000001 needle-512 256 \
#          experiments/needle/results/needle-256.raw.csv
# Environment: LOOM (default build/bin/loom), LOOM_COORDINATOR (default http://127.0.0.1:8470),
# TOKEN_FILE (default: the token `loom up --data-dir DIR` wrote, found through LOOM_DATA_DIR).
set -euo pipefail
[[ $# -ge 3 ]] || { sed -n '9,13p' "$0"; exit 2; }
sweep=$1 name=$2 extra_length=$3 other=${4:-}
cd "$(dirname "$0")/../.."
loom=${LOOM:-build/bin/loom}
url=${LOOM_COORDINATOR:-http://127.0.0.1:8470}
token_file=${TOKEN_FILE:-${LOOM_DATA_DIR:?set TOKEN_FILE or LOOM_DATA_DIR}/tokens/user-token}
dir=experiments/needle/results
mkdir -p "$dir" docs/results

sweep_report() {
  "$loom" --coordinator "$url" --token-file "$token_file" sweep report "$sweep" "$@"
}

export_raw() {  # export_raw OUT [--length N]
  local out=$1
  shift
  python3 experiments/export_sweep.py --coordinator "$url" --token-file "$token_file" \
    --sweep "$sweep" --out "$out" "$@"
}

report() {  # report METRIC SUFFIX [--length N]: one JSON report and its tables
  local metric=$1 out="$dir/$name.report-$1$2.json"
  shift 2
  sweep_report --metric "$metric" --select final --format json "$@" > "$out"
  echo "### $(basename "$out")"
  python3 experiments/report_table.py "$out" $([[ $metric == eval_loss ]] || echo --scale 100)
  echo
}

export_raw "$dir/$name.raw.csv" --curves "$dir/$name.curves.csv"
export_raw "$dir/$name-len$extra_length.raw.csv" --length "$extra_length"
for metric in accuracy exact_match eval_loss; do
  report "$metric" ""
  report "$metric" "-len$extra_length" --length "$extra_length"
done
sweep_report --metric accuracy --select final --plot "docs/results/$name-accuracy.png" > /dev/null
sweep_report --metric eval_loss --select final --plot "docs/results/$name-eval-loss.png" > /dev/null
echo "plots: docs/results/$name-accuracy.png docs/results/$name-eval-loss.png"

if [[ -n $other ]]; then
  for column in accuracy exact_match eval_loss; do
    echo "### hybrid - mha: $(basename "$dir/$name.raw.csv") against $(basename "$other"), $column"
    python3 experiments/compare_settings.py "$other" "$dir/$name.raw.csv" --baseline mha \
      --cell hybrid-iha-p2 --column "$column" $([[ $column == eval_loss ]] || echo --scale 100)
    echo
  done
fi

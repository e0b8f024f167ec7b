#!/usr/bin/env bash
# Several stages of benchmarks/h200_run.sh in one device call, each under its own time limit and
# all inside one deadline (a device call may run 10 minutes), with a summary table printed last.
#
#   DEADLINE_S=570 bash benchmarks/gpu_batch.sh conformance:200 "quant:300" "alone:150:--max-num-seqs 512"
#
# A stage is NAME[:SECONDS[:ARGS]] (ARGS go to h200_run.sh after the stage name); a stage gets
# SECONDS or whatever is left before the deadline, and is skipped when under 20 s are left. Each
# stage's output goes to $OUT/NAME.log (the same name twice: NAME-2.log, ...); the card's name is in
# the table, so every figure says which device gave it. At the end everything under $OUT but the
# summary is packed into $OUT/logs.tgz (a device call returns at most 8 files).
set -uo pipefail
OUT="${OUT:-h200-logs}"
mkdir -p "$OUT"
DEADLINE=$((SECONDS + ${DEADLINE_S:-570}))
SUMMARY="$OUT/summary.txt"
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
echo "card: ${card:-unknown}  started $(date -u +%H:%M:%S)" > "$SUMMARY"
declare -A seen=()
for spec in "$@"; do
  IFS=: read -r name secs args <<< "$spec"
  secs=${secs:-300}
  left=$((DEADLINE - SECONDS))
  n=$(( ${seen[$name]:-0} + 1 )); seen[$name]=$n
  log="$OUT/$name$([ "$n" -gt 1 ] && echo "-$n").log"
  if [ "$left" -lt 20 ]; then
    printf '%-14s %-8s %s\n' "$name" skipped "deadline" >> "$SUMMARY"; continue
  fi
  [ "$secs" -gt "$left" ] && secs=$left
  start=$SECONDS
  # shellcheck disable=SC2086  # ARGS are several words on purpose
  timeout "$secs" bash benchmarks/h200_run.sh "$name" $args > "$log" 2>&1
  rc=$?
  printf '%-14s rc=%-4s %4ss  %s\n' "$name" "$rc" "$((SECONDS - start))" \
    "$(grep -E 'passed|failed|tok/s|FAILED|Error|error' "$log" | tail -2 | tr '\n' ' ' | cut -c1-150)" \
    >> "$SUMMARY"
done
cat "$SUMMARY"
# a device call brings back at most 8 files: everything but the summary goes into one archive
(cd "$OUT" && find . -mindepth 1 -maxdepth 1 ! -name summary.txt ! -name logs.tgz -print0 \
  | tar czf logs.tgz --null -T - --remove-files) || echo "could not pack the logs in $OUT"

#!/usr/bin/env bash
# Tuning on a quiet machine, then under a CPU-burning background process (one busy loop per core): the second must
# give a profile within 15 % of the first or refuse to cache it and say why. The cached profile is kept aside during
# the busy run and restored after it. Usage: bash benchmarks/tune_under_load.sh [MODEL] [THREADS]
set -euo pipefail
MODEL=${1:-smollm2-135m-instruct}
THREADS=${2:-2}
OUT=${OUT:-benchmarks/tune-under-load}
mkdir -p "$OUT"
eagle-fsd tune --model "$MODEL" --threads "$THREADS" --force 2>&1 | tr '\r' '\n' \
    | grep -v "Loading weights\|acceptance replay" | tee "$OUT/quiet.log"
PROFILE=$(grep -o '^cost profile: .*' "$OUT/quiet.log" | cut -d' ' -f3)
cp "$PROFILE" "$OUT/quiet.json"
mv "$PROFILE" "$PROFILE.quiet"
BURNERS=()
for _ in $(seq "$(nproc)"); do python -c "while True: pass" & BURNERS+=($!); done
trap 'kill "${BURNERS[@]}" 2>/dev/null || true; mv "$PROFILE.quiet" "$PROFILE" 2>/dev/null || true' EXIT
eagle-fsd tune --model "$MODEL" --threads "$THREADS" 2>&1 | tr '\r' '\n' \
    | grep -v "Loading weights\|acceptance replay" | tee "$OUT/busy.log"
if [ -f "$PROFILE" ]; then cp "$PROFILE" "$OUT/busy.json"; echo "busy profile cached"; else echo "busy profile not cached"; fi

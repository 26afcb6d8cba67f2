#!/usr/bin/env bash
# The FSD frontier of Qwen2.5-Coder-1.5B-Instruct drafted by the 0.5B, all engine settings at their defaults (auto).
# Resumable: every step appends to its out-dir's records.jsonl and skips what is there, so rerun this script after a
# stop (or in a later session) and it continues. Time it on a quiet machine (nothing else running).
# About 15 s per (arm, problem) at 2 threads on a 2 vCPU AMD EPYC: 414 problems x 4 arms ~ 7 h, the HumanEval extras
# ~ 1.4 h.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/frontier/qwen}
# The tree is pinned to what `auto` chose from the quiet 2-thread tune profile when the run began ((5, 1, 4), draft
# vocabulary 37,888): a later load-time check of that profile may re-pick among near-tied shapes, and one frontier
# must run one tree. Pinned, the speed guard is off; the first 35 HumanEval problems ran with it on (`auto`), the
# same tree.
TREE=(--total-token 5 --depth 1 --top-k 4 --draft-vocab 37888)
# The target keeps its float (bf16) weights: the frontier began before --target-quant auto could round it to int8.
# bf16 is pinned too: every record so far is bf16 (dtype auto chose it on the AVX-512 BF16 / AMX machines), and an
# AVX2-only CPU would resolve auto to fp32, another model.
COMMON=(--model qwen2.5-coder-1.5b-instruct "${TREE[@]}" --target-quant off --dtype bf16 --threads 2 --max-new-token 512
        --plain-limit 20 --resume)
# lossless and three thresholds of the best divergence from the pilot, HumanEval (all 164) and GSM8K (250, seed 0)
eagle-fsd sweep "${COMMON[@]}" --bench humaneval gsm8k --sample 250 --fsd kl_qp:0.5,2,8 --out-dir "$OUT"
# a second divergence and the original rule at one threshold each, HumanEval
eagle-fsd sweep "${COMMON[@]}" --bench humaneval --sample 250 --fsd kl_qp:0.5,2,8 --fsd jsd:0.5 \
    --fsd kl_qp/original:2 --out-dir "$OUT"

#!/usr/bin/env bash
# The FSD frontier at defaults: Qwen2.5-Coder-1.5B-Instruct drafted by the 0.5B, every engine setting auto (the
# quantized target users run, the tuned tree, the speed guard). Resumable: each step appends to its out-dir and skips
# what is there, so rerun this script after a stop (or in a later session) and it continues where it ended.
# Time it on a quiet machine (nothing else running). Each rule runs on its own draft tree (eagle_fsd.tune.follow),
# recorded per answer ("trees"). mtbench-lossless-tree/ holds chat arms run before rules had trees of their own:
# every arm on the lossless rule's tuned tree (5, 3, 1), draft vocabulary 37,888.
# Chat: all 80 MT-Bench first turns, label-free (the target's extra NLL per token of FSD replies over lossless ones),
# 256 new tokens. Math: GSM8K 250 (seed 0), 512 new tokens, plain decoding on the first 20 as the speed reference.
# Summaries: python benchmarks/frontier/chat_summary.py OUT/mtbench-low; eagle-fsd sweep ... --summary-only.
# Math with guards: GSM8K 250 again, lossless and kl_qp T = 2 with the stop tokens kept plus the rank guard (top 4)
# or the entropy gate (1 nat). Code: HumanEval 164, the math arms and both guarded arms.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/frontier/qwen-defaults}
COMMON=(--model qwen2.5-coder-1.5b-instruct --threads 2 --resume)
PROMPTS="$OUT/mtbench_first_turns.jsonl"
python -c "import json, sys; from eagle_fsd.eval.data import load_questions
sys.stdout.writelines(json.dumps({'prompt': q['turns'][0]}) + '\n' for q in load_questions())" > "$PROMPTS"
# chat, thresholds low enough for a small fuzzy share, on each rule's own tree
eagle-fsd calibrate "${COMMON[@]}" --max-new-tokens 256 --prompts "$PROMPTS" --nll-bound 0.05 \
    --fsd kl_qp:0.1,0.3,1 --fsd kl_qp+stop:1 --out-dir "$OUT/mtbench-low"
# math
eagle-fsd sweep "${COMMON[@]}" --max-new-tokens 512 --bench gsm8k --sample 250 --fsd kl_qp:0.3,1,2 \
    --fsd kl_qp+stop:1,2 --plain-limit 20 --out-dir "$OUT/gsm8k"
# chat, the thresholds of mtbench-lossless-tree/, on each rule's own tree
eagle-fsd calibrate "${COMMON[@]}" --max-new-tokens 256 --prompts "$PROMPTS" --nll-bound 0.05 \
    --fsd kl_qp:2,8 --fsd kl_qp+stop:2,8 --fsd kl_qp+stop+r4:8 --out-dir "$OUT/mtbench"
# math, the rank and entropy guards at T = 2 (where the unguarded rule loses 8 points), with lossless again: the
# arms of a problem run together, so their times pair within this out-dir
eagle-fsd sweep "${COMMON[@]}" --max-new-tokens 512 --bench gsm8k --sample 250 --fsd kl_qp+stop+r4:2 \
    --fsd kl_qp+stop+h1:2 --plain-limit 1 --out-dir "$OUT/gsm8k-guards"
# code: all 164 HumanEval problems at defaults
eagle-fsd sweep "${COMMON[@]}" --max-new-tokens 512 --bench humaneval --fsd kl_qp:0.3,1,2 --fsd kl_qp+stop:1,2 \
    --fsd kl_qp+stop+r4:2 --fsd kl_qp+stop+h1:2 --plain-limit 20 --out-dir "$OUT/humaneval"

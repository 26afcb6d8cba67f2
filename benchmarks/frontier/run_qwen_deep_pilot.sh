#!/usr/bin/env bash
# Does FSD pay on a deeper tree? The main frontier's tree (5, 1, 4) holds at most 2 draft tokens a step and lossless
# already reaches tau 2.83 of 3 there, so FSD has nothing left to accept. Here lossless on that tree (the reference
# of every speedup) runs beside lossless and FSD on deeper trees, interleaved problem by problem, on the first 20
# problems of each benchmark. Resumable like run_qwen.sh; time it on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/frontier/qwen-deep-pilot}
eagle-fsd sweep --model qwen2.5-coder-1.5b-instruct --total-token 5 --depth 1 --top-k 4 --draft-vocab 37888 --target-quant off \
    --threads 2 --max-new-token 512 --bench humaneval gsm8k --sample 250 --limit 20 --plain-limit 5 --resume \
    --fsd lossless@16/5/2/37888 --fsd kl_qp:2,8@16/5/2/37888 \
    --fsd lossless@10/3/2/37888 --fsd kl_qp:2,8@10/3/2/37888 --out-dir "$OUT"

"""Per-phase time of one eagle-fsd install (FSD kl_qp T = 2 on the (5, 3, 1) tree, 37,888-token draft vocabulary,
MT-Bench q81-83, 96 tokens, 2 threads), to compare two versions phase by phase:

    python benchmarks/plan_phases_probe.py after
    /tmp/venv-before/bin/python benchmarks/plan_phases_probe.py before
"""
import sys, torch
from eagle_fsd.model import EaFsdModel
from eagle_fsd.fsd import FsdConfig
from eagle_fsd.eval.data import load_questions
from eagle_fsd.prompts import PromptFormat
torch.set_num_threads(2)
model = EaFsdModel.from_pretrained("qwen2.5-coder-1.5b-instruct", total_token=5, depth=3, top_k=1, draft_vocab=37888, tune_progress=False)
fmt = PromptFormat(model.tokenizer)
qs = load_questions()[:3]
model.generate(fmt.encode([{"role": "user", "content": qs[0]["turns"][0]}])[:, :16], max_new_tokens=8)
tot = {}; steps = 0; toks = 0; wall = 0
for q in qs:
    ids = fmt.encode([{"role": "user", "content": q["turns"][0]}])
    out = model.generate(ids, max_new_tokens=96, return_dict=True, fsd=FsdConfig(threshold=2.0))
    for k, v in out.phase_seconds.items(): tot[k] = tot.get(k, 0) + v
    steps += out.verify_steps; toks += out.new_tokens; wall += out.wall_time
print(sys.argv[1], f"{toks / wall:.2f} tok/s", "ms/step", {k: round(1000 * v / steps, 2) for k, v in tot.items()}, flush=True)

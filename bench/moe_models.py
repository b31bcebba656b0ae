"""The mixture-of-experts benchmark models and records (bench/moe_step.sh, bench/moe_ep.sh).

Written by transformers' save_pretrained with random initialisation, so every side loads the same
weights. MoE-dominated (the experts hold 80% of the parameters), vocabulary 8000 so the head does
not hide the experts:
  mixtral:  8 experts of intermediate 1024, top 2 renormalised;
  qwen3moe: 32 smaller experts (256), top 4, norm_topk_prob, every layer sparse.
The records: random ids, `records` of `seq` tokens each.

    python bench/moe_models.py OUT AUX(on|off) SEQ RECORDS [NAMES...]
"""
import json
import random
import sys

import torch
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig


def configs(aux, seq):
    common = dict(vocab_size=8000, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=max(seq, 1024),
                  output_router_logits=aux, router_aux_loss_coef=0.001, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    return {
        "mixtral": MixtralConfig(**common, intermediate_size=1024, num_local_experts=8,
                                 num_experts_per_tok=2, sliding_window=None),
        "qwen3moe": Qwen3MoeConfig(**common, head_dim=64, intermediate_size=1024,
                                   moe_intermediate_size=256, num_experts=32,
                                   num_experts_per_tok=4, norm_topk_prob=True,
                                   decoder_sparse_step=1, mlp_only_layers=[])}


def main():
    out, aux, seq, records = sys.argv[1], sys.argv[2] == "on", int(sys.argv[3]), int(sys.argv[4])
    names = sys.argv[5:]
    for name, config in configs(aux, seq).items():
        if names and name not in names:
            continue
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).float().save_pretrained(f"{out}/{name}")
    rng = random.Random(0)
    with open(f"{out}/records.jsonl", "w") as f:
        for _ in range(records):
            f.write(json.dumps({"input_ids": [rng.randrange(4, 8000) for _ in range(seq)]}) + "\n")


if __name__ == "__main__":
    main()

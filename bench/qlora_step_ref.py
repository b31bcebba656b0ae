"""The transformers side of bench/qlora_step.sh, and the model both sides train.

--make DIR: writes a random-init Llama-shaped model (transformers' init, fp32, save_pretrained) to
DIR/base and random pre-tokenized records to DIR/records.jsonl, then exits.

Otherwise: one QLoRA training step as transformers + PEFT + bitsandbytes (its CPU backend) run it:
the base loaded with BitsAndBytesConfig(load_in_4bit, nf4, compute dtype fp32) on the CPU, a PEFT
LoRA adapter (r 16, alpha 32, no dropout) on every projection, sdpa attention, forward with labels,
backward, global-norm clip 1.0, torch.optim.AdamW(fused=True) over the adapters, gradients set to
none. --compile wraps the model in torch.compile. Prints one JSON line: median and minimum step
time after the warm-up steps, tokens/s, peak resident memory."""
import argparse
import json
import os
import resource
import sys
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--make", help="write the model and records here and exit")
p.add_argument("--model", help="the fp32 base model directory")
p.add_argument("--data", help="JSONL of {\"input_ids\": [...]}")
for name, default in [("batch", 2), ("seq", 512), ("steps", 5), ("warmup", 2), ("threads", 0),
                      ("records", 32), ("hidden", 1024), ("layers", 8), ("inter", 2816),
                      ("vocab", 8000)]:
    p.add_argument("--" + name, type=int, default=default)
p.add_argument("--double-quant", action="store_true")
p.add_argument("--compile", action="store_true")
a = p.parse_args()
if a.threads > 0:
    torch.set_num_threads(a.threads)

if a.make:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.inter,
                      num_hidden_layers=a.layers, num_attention_heads=a.hidden // 64,
                      num_key_value_heads=a.hidden // 256, max_position_embeddings=max(a.seq, 512),
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).float().save_pretrained(os.path.join(a.make, "base"))
    gen = torch.Generator().manual_seed(1)
    with open(os.path.join(a.make, "records.jsonl"), "w") as f:
        for _ in range(a.records):
            f.write(json.dumps({"input_ids": torch.randint(4, a.vocab, (a.seq,), generator=gen)
                                .tolist()}) + "\n")
    sys.exit(0)

import warnings  # noqa: E402

warnings.filterwarnings("ignore")
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402

bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                         bnb_4bit_use_double_quant=a.double_quant,
                         bnb_4bit_compute_dtype=torch.float32)
model = AutoModelForCausalLM.from_pretrained(a.model, quantization_config=bnb, dtype=torch.float32,
                                             device_map="cpu", attn_implementation="sdpa")
model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=16, lora_alpha=32,
                                         lora_dropout=0.0, bias="none",
                                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                         "gate_proj", "up_proj", "down_proj"]))
model.train()
trained = [q for q in model.parameters() if q.requires_grad]
opt = torch.optim.AdamW(trained, lr=1e-4, weight_decay=0.0, fused=True)
records = [torch.tensor(json.loads(line)["input_ids"]) for line in open(a.data)]
step_model = torch.compile(model) if a.compile else model
cursor = 0


def step():
    global cursor
    ids = torch.stack([records[(cursor + i) % len(records)] for i in range(a.batch)])
    cursor += a.batch
    t0 = time.perf_counter()
    out = step_model(input_ids=ids, labels=ids)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(trained, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, out.loss.item(), ids.numel()


times, losses = [], []
for i in range(a.warmup + a.steps):
    t, loss, tokens = step()
    losses.append(loss)
    if i >= a.warmup:
        times.append(t)
times.sort()
median = times[len(times) // 2]
print(json.dumps({"impl": "transformers+peft+bitsandbytes" + (" + torch.compile" if a.compile else ""),
                  "step_time_s": {"median": median, "min": times[0]},
                  "tokens_per_s": round(tokens / median, 1), "tokens": tokens,
                  "first_loss": losses[0], "last_loss": losses[-1],
                  "trained_parameters": sum(q.numel() for q in trained),
                  "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}))

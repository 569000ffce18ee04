"""PEFT's side of section 12: one AdamW step of a Llama (transformers) fine-tuned in full and
with a PEFT LoRA adapter (r 16, alpha 32 on every projection), on this machine's cores; the
medians in ms, and the process's peak RSS growth over each step, as JSON.

    python lora.py VOCAB D HEADS KV LAYERS FF SEQ BATCH REPS
"""

import json
import resource
import statistics
import sys
import time

import peft
import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

vocab, d, heads, kv, layers, ff, seq, batch, reps = map(int, sys.argv[1:10])


def model():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=ff,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).train()


def step_ms(m):
    ids = torch.tensor([[(j * 7 + 3) % vocab for j in range(seq)]] * batch)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:]) * 1e3


full = step_ms(model())
lora = get_peft_model(
    model(),
    LoraConfig(
        r=16,
        lora_alpha=32,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        lora_dropout=0.0,
    ),
)
lora_ms = step_ms(lora)
print(
    json.dumps(
        {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "peft": peft.__version__,
            "threads": torch.get_num_threads(),
            "full_ms": full,
            "lora_ms": lora_ms,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
    )
)

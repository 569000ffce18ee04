"""transformers' batched greedy generate (left padding, an attention mask) on the benchmark's
model and prompts: prints `tokens/s` of the new tokens (every row's), best of ROUNDS, and each
row's new ids (to compare with burn-tp's)."""
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM

model_dir, prompts_file, new, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(int(sys.argv[5]) if len(sys.argv) > 5 else torch.get_num_threads())
prompts = [[int(t) for t in line.split(",")] for line in open(prompts_file) if line.strip()]
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
longest = max(map(len, prompts))
ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
best = 0.0
with torch.inference_mode():
    for _ in range(rounds):
        t = time.perf_counter()
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
            do_sample=False, pad_token_id=0,
        )
        best = max(best, len(prompts) * new / (time.perf_counter() - t))
print(json.dumps({"tokens_per_s": best, "new_ids": out[:, longest:].tolist(),
                  "torch": torch.__version__, "threads": torch.get_num_threads()}))

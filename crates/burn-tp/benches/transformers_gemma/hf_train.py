"""transformers' training step on the benchmark's Gemma (run.sh): forward with labels (its own
cross-entropy), backward, AdamW; random token batches. Prints tokens/s over the steps after the
first (the warm-up)."""
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM

model_dir, batch, seq, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(int(sys.argv[5]) if len(sys.argv) > 5 else torch.get_num_threads())
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
vocab = model.config.vocab_size
start = None
for step in range(steps):
    if step == 1:
        start = time.perf_counter()
    ids = torch.randint(0, 256, (batch, seq))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
elapsed = time.perf_counter() - start
print(json.dumps({"tokens_per_s": (steps - 1) * batch * seq / elapsed, "loss": loss.item(),
                  "torch": torch.__version__, "threads": torch.get_num_threads()}))

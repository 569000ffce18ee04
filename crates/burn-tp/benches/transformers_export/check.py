"""One export read back by transformers (run.sh): its last logits and greedy tokens against
burn-tp's, printed as one line; exits non-zero where they differ."""
import json
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM

name, model_dir, logits_file, generated_file = sys.argv[1:5]
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
ours = json.loads(open(generated_file).readline())
ids = list(ours["prompt_ids"])
with torch.no_grad():
    last = model(torch.tensor([ids])).logits[0, -1]
    for _ in range(len(ours["new_ids"])):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
theirs_new = ids[len(ours["prompt_ids"]):]
diff = (last - torch.tensor(json.load(open(logits_file)))).abs().max().item()
same = theirs_new == ours["new_ids"]
print(f"{name}: {type(model).__name__} (transformers {transformers.__version__}, torch "
      f"{torch.__version__}): last logits max |diff| {diff:.1e} (largest |logit| "
      f"{last.abs().max().item():.1f}); greedy tokens {'equal' if same else 'DIFFER'}: "
      f"{theirs_new}")
sys.exit(0 if same and diff < 1e-4 else 1)

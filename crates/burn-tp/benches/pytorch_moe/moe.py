"""transformers' MixtralSparseMoeBlock (the layer burn-tp's section 11 times) forward + backward
on one process with all cores, and its expert GEMMs alone on a balanced load: median ms of each.

    python3 moe.py TOKENS D FF EXPERTS TOPK ROUNDS
"""
import json
import statistics
import sys
import time

import torch
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

t, d, f, e, k, rounds = (int(a) for a in sys.argv[1:7])
torch.manual_seed(0)
config = MixtralConfig(hidden_size=d, intermediate_size=f, num_local_experts=e, num_experts_per_tok=k)
block = MixtralSparseMoeBlock(config).float()
for p in block.parameters():
    torch.nn.init.normal_(p, std=0.02)
x = torch.randn(1, t, d, requires_grad=True)


def median_ms(step):
    step()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def layer():
    out = block(x)
    y = out[0] if isinstance(out, tuple) else out
    y.sum().backward()


rows = t * k // e
xs = [torch.randn(rows, d, requires_grad=True) for _ in range(e)]
gu = [torch.randn(d, 2 * f, requires_grad=True) for _ in range(e)]
dn = [torch.randn(f, d, requires_grad=True) for _ in range(e)]


def floor():
    loss = sum(((xi @ g)[:, :f] @ w).sum() for xi, g, w in zip(xs, gu, dn))
    loss.backward()


print(json.dumps({
    "torch": torch.__version__,
    "threads": torch.get_num_threads(),
    "layer_ms": median_ms(layer),
    "floor_ms": median_ms(floor),
}))

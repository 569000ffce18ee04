"""The peer of `train_gpt --tp 1` in plain single-process PyTorch: the same GPT (learned
positions, pre-norm blocks with biased attention and a GELU MLP of 4 d, a final layer norm, an
untied head), AdamW at the same learning rate, random token batches, scaled_dot_product_attention
(PyTorch's fused CPU attention). Not part of CI: a benchmark peer (docs/PERFORMANCE.md records its
command and version).

    pip install torch
    /usr/bin/time -v python3 crates/burn-tp/benches/pytorch_gpt/gpt.py \\
        --d-model 256 --heads 4 --layers 4 --vocab 27 --batch 8 --seq 1024 --steps 10

Prints one line: tokens/s over the steps after the first (the warm-up), and the loss.
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        heads = lambda t: t.view(b, s, self.heads, d // self.heads).transpose(1, 2)
        a = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Gpt(nn.Module):
    def __init__(self, vocab, seq, d, heads, layers):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.tok(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=27)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    # bf16: autocast (f32 master weights, bf16 matmuls), as `train_gpt --dtype bf16` keeps f32
    # master weights and computes in bf16.
    p.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = Gpt(a.vocab, a.seq, a.d_model, a.heads, a.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    start = None
    for step in range(a.steps):
        if step == 1:
            start = time.perf_counter()
        ids = torch.randint(0, a.vocab, (a.batch, a.seq + 1))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, a.vocab), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    elapsed = time.perf_counter() - start
    tokens = (a.steps - 1) * a.batch * a.seq
    print(
        f"pytorch {torch.__version__} {a.dtype} threads {a.threads}: {tokens / elapsed:.0f} tokens/s, "
        f"loss {loss.item():.4f}"
    )


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""PyTorch's side of the GPU check (issue 36), run by `gpu-check run` beside bin/gpu_check on
the same GPU: the figures burn-tp's are compared with.

1. The 8192 x 8192 linear layer, forward + backward (three GEMMs), in TFLOP/s: bf16, f32
   strict, f32 with TF32 (torch.backends.cuda.matmul.allow_tf32).
2. A whole training step of transformers' LlamaForCausalLM (bf16 weights, AdamW, SDPA
   attention) of the issue's Llama, in tokens/s and model TFLOP/s.

Writes a JSON object to the path given (or stdout). `--small` runs tiny shapes (on the CPU too:
how this script is checked without a GPU).

    python3 gpu_torch.py OUT.json [--small]
"""
import json
import sys
import time

import torch


def timed(fn, warmup, runs, sync):
    for _ in range(warmup):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(runs):
        fn()
    sync()
    return (time.perf_counter() - start) / runs


def linear(n, dtype, tf32, device, sync):
    torch.backends.cuda.matmul.allow_tf32 = tf32
    layer = torch.nn.Linear(n, n, device=device, dtype=dtype)
    x = torch.randn(n, n, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(n, n, device=device, dtype=dtype)

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        (layer(x) * g).sum().backward()

    secs = timed(step, 2, 5, sync)
    return 3 * 2 * n**3 / secs / 1e12


def llama_step(cfg, batch, seq, steps, device, sync):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=cfg["vocab"],
        hidden_size=cfg["d_model"],
        intermediate_size=cfg["d_ff"],
        num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["kv_heads"],
        max_position_embeddings=seq,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, cfg["vocab"], (batch, seq), device=device)

    def step():
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    secs = timed(step, 1, steps, sync)
    params = sum(p.numel() for p in model.parameters())
    tokens = batch * seq / secs
    # Megatron's count per token: 6 N, plus the attention's scores and values (causal: half).
    flops = 6 * params + 6 * cfg["layers"] * seq * cfg["d_model"]
    return {"tokens_per_s": tokens, "model_tflops": tokens * flops / 1e12, "params": params}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("--") else None
    small = "--small" in sys.argv
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    figures = {
        "torch.version": torch.__version__,
        "torch.device": torch.cuda.get_device_name() if cuda else "cpu",
    }
    n = 256 if small else 8192
    for name, dtype, tf32 in [
        ("bf16", torch.bfloat16, False),
        ("f32_strict", torch.float32, False),
        ("f32_tf32", torch.float32, True),
    ]:
        try:
            figures[f"torch.linear_{n}.{name}.tflops"] = round(linear(n, dtype, tf32, device, sync), 1)
        except Exception as e:  # a figure missing says why, the others still come
            figures[f"torch.linear_{n}.{name}.error"] = str(e)
    torch.backends.cuda.matmul.allow_tf32 = False
    if small:
        cfg = dict(vocab=128, d_model=64, d_ff=172, layers=2, heads=4, kv_heads=2)
        batch, seq, steps = 2, 32, 2
    else:
        cfg = dict(vocab=128, d_model=2048, d_ff=5632, layers=8, heads=16, kv_heads=8)
        batch, seq, steps = 2, 2048, 3
    try:
        step = llama_step(cfg, batch, seq, steps, device, sync)
        for k, v in step.items():
            figures[f"torch.llama_step.{k}"] = round(v, 1) if isinstance(v, float) else v
        figures["torch.llama_step.shape"] = f"{cfg} batch {batch} seq {seq}"
    except Exception as e:
        figures["torch.llama_step.error"] = str(e)
    text = json.dumps(figures, indent=2, sort_keys=True)
    if out:
        with open(out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()

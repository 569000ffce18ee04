"""A random Llama for the generation benchmark (run.sh): saved by transformers, read by both."""
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

out, d, layers, heads, kv, ff, vocab = sys.argv[1], *map(int, sys.argv[2:8])
torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=vocab,
    hidden_size=d,
    intermediate_size=ff,
    num_hidden_layers=layers,
    num_attention_heads=heads,
    num_key_value_heads=kv,
    max_position_embeddings=1024,
    pad_token_id=0,
    bos_token_id=None,
    eos_token_id=None,
)
LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)

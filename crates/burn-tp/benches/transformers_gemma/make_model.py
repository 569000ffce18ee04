"""A random Gemma 3 of the 270M shape (google/gemma-3-270m's config: 18 layers, width 640, 4
heads and 1 key / value head of 256, GeGLU 2,048, vocabulary 262,144, sliding window 512 on five
layers of six, rotary bases 1e6 / 1e4, tied) for run.sh: saved by transformers, read by both."""
import sys

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

out = sys.argv[1]
torch.manual_seed(0)
config = Gemma3TextConfig(
    vocab_size=262_144,
    hidden_size=640,
    intermediate_size=2048,
    num_hidden_layers=18,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    max_position_embeddings=32_768,
    query_pre_attn_scalar=256,
    sliding_window=512,
    rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=None,
)
Gemma3ForCausalLM(config).save_pretrained(out, safe_serialization=True)

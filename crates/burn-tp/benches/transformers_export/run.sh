#!/usr/bin/env bash
# burn-tp's Hugging Face export read back by transformers: each fixture fine-tuned for a few
# steps at tp 2 (`train_gpt --init-from ... --export-hf`), the export loaded by transformers'
# AutoModelForCausalLM, its last logits and greedy tokens against burn-tp's `generate` on the
# same export. Not part of CI (it needs the peer).
#
#   pip install torch transformers   # the peer
#   crates/burn-tp/benches/transformers_export/run.sh [FIXTURE ...]
#
# Defaults: the Gemma fixtures (gemma2, gemma3, gemma3_capped), two of the Llama family and the
# three mixtures of experts (mixtral, qwen3_moe, qwen2_moe).
set -euo pipefail
cd "$(dirname "$0")/../../../.."
here=crates/burn-tp/benches/transformers_export
fixtures=("$@")
[ ${#fixtures[@]} -gt 0 ] || fixtures=(gemma2 gemma3 gemma3_capped qwen3 phi3 mixtral qwen3_moe qwen2_moe)
cargo build --release --example train_gpt --example generate -q
for name in "${fixtures[@]}"; do
  out=/tmp/burn-tp-export-$name
  rm -rf "$out" "$out-run"
  target/release/examples/train_gpt --quiet --tp 2 --batch 4 --seq 8 --steps 5 --lr 1e-2 \
    --init-from tests/fixtures/hf/$name --export-hf "$out" --out "$out-run" > /dev/null
  target/release/examples/generate --model "$out" --tp 2 --prompt-ids 1,5,9,13,2,7 \
    --max-new-tokens 6 --logits-out "$out-run/logits.json" > "$out-run/generate.json"
  python3 $here/check.py "$name" "$out" "$out-run/logits.json" "$out-run/generate.json"
done

#!/usr/bin/env bash
# Gemma 3 of the 270M shape (make_model.py, random weights) in burn-tp and in transformers on the
# same cores: batched and single-prompt greedy generation (`generate` vs transformers'
# `generate`, pytorch_generate/hf_generate.py), then a training step (`train_gpt --init-from`
# vs transformers' forward / backward / AdamW, hf_train.py), tokens/s and peak RSS. Best of ROUNDS
# for generation. Not part of CI.
#
#   pip install torch transformers   # the peer
#   crates/burn-tp/benches/transformers_gemma/run.sh [ROUNDS]
#
# Defaults: 8 prompts of 16 to 128 tokens (and the first alone), NEW=32 new tokens each;
# training at batch B=2 x seq S=128, STEPS=3 (the first a warm-up); burn-tp at tp 1 and 2.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
rounds=${1:-2}
here=crates/burn-tp/benches/transformers_gemma
gen=crates/burn-tp/benches/pytorch_generate
model=/tmp/burn-tp-gemma-270m
new=${NEW:-32}
[ -d "$model" ] || python3 $here/make_model.py "$model"
prompts=/tmp/burn-tp-gemma-prompts.txt
python3 - "$prompts" <<'PY'
import random, sys
random.seed(1)
with open(sys.argv[1], "w") as f:
    for n in [16, 128, 40, 96, 24, 64, 112, 80]:
        f.write(",".join(str(random.randrange(3, 32000)) for _ in range(n)) + "\n")
PY
head -1 "$prompts" > "$prompts.1"
cargo build --release --example generate --example train_gpt -q
for set in "$prompts.1" "$prompts"; do
  n=$(wc -l < "$set")
  args=()
  while read -r line; do args+=(--prompt-ids "$line"); done < "$set"
  /usr/bin/time -f "%M" -o /tmp/burn-tp-rss python3 $gen/hf_generate.py "$model" "$set" "$new" \
    "$rounds" > /tmp/burn-tp-hf-gen.json
  hf_rss=$(( $(cat /tmp/burn-tp-rss) / 1024 ))
  for tp in 1 2; do
    best=0
    for r in $(seq 1 "$rounds"); do
      /usr/bin/time -f "%M" -o /tmp/burn-tp-rss target/release/examples/generate --model "$model" \
        --tp $tp "${args[@]}" --max-new-tokens "$new" > /tmp/burn-tp-gen.jsonl
      best=$(python3 -c "import json; t=json.loads(open('/tmp/burn-tp-gen.jsonl').readline())['tokens_per_s']; print(max(t, $best))")
    done
    python3 - "$tp" "$best" "$n" "$(( $(cat /tmp/burn-tp-rss) / 1024 ))" "$hf_rss" <<'PY'
import json, sys
hf = json.load(open("/tmp/burn-tp-hf-gen.json"))
rows = [json.loads(l)["new_ids"] for l in open("/tmp/burn-tp-gen.jsonl")]
same = sum(r == h for r, h in zip(rows, hf["new_ids"]))
tp, ours, n, rss, hf_rss = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
print(f"generate, batch {n}: burn-tp tp {tp} {ours:.1f} tokens/s ({rss} MiB), transformers "
      f"{hf['tokens_per_s']:.1f} ({hf_rss} MiB; torch {hf['torch']}, {hf['threads']} threads): "
      f"{ours / hf['tokens_per_s']:.2f}x; rows with transformers' ids: {same} of {len(rows)}")
PY
  done
done
b=${B:-2}; s=${S:-128}; steps=${STEPS:-3}
/usr/bin/time -f "%M" -o /tmp/burn-tp-rss python3 $here/hf_train.py "$model" "$b" "$s" "$steps" \
  > /tmp/burn-tp-hf-train.json
hf_rss=$(( $(cat /tmp/burn-tp-rss) / 1024 ))
for tp in 1 2; do
  /usr/bin/time -f "%M" -o /tmp/burn-tp-rss target/release/examples/train_gpt --tp $tp \
    --init-from "$model" --batch "$b" --seq "$s" --steps "$steps" --lr 1e-4 --dropout 0 \
    --sample-len 0 --eval-every 1000 --quiet --out /tmp/burn-tp-gemma-train > /tmp/burn-tp-train.log
  tps=$(grep -o '([0-9]* in the steps' /tmp/burn-tp-train.log | tr -dc 0-9)
  python3 - "$tp" "$tps" "$(( $(cat /tmp/burn-tp-rss) / 1024 ))" "$hf_rss" <<'PY'
import json, sys
hf = json.load(open("/tmp/burn-tp-hf-train.json"))
tp, ours, rss, hf_rss = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
print(f"train step: burn-tp tp {tp} {ours:.0f} tokens/s ({rss} MiB peak RSS), transformers "
      f"{hf['tokens_per_s']:.0f} ({hf_rss} MiB; torch {hf['torch']}, {hf['threads']} threads): "
      f"{ours / hf['tokens_per_s']:.2f}x")
PY
done

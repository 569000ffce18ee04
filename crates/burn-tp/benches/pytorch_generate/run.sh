#!/usr/bin/env bash
# Batched generation: burn-tp's `generate` example and transformers' `generate` on the same random
# Llama (make_model.py) and the same 8 prompts of 16 to 128 tokens (left-padded by both), greedy,
# NEW tokens each; best of ROUNDS runs each. Not part of CI.
#
#   pip install torch transformers   # the peer
#   crates/burn-tp/benches/pytorch_generate/run.sh [ROUNDS]
#
# Defaults: d_model 512, 8 layers, 8 heads, 4 key / value heads, SwiGLU 1,408, vocabulary 32,000
# (D, L, H, KV, FF, V), 64 new tokens (NEW), f32, burn-tp at tp 1 and 2 (threads); BATCH=1..8 takes
# the first prompts only (default all 8).
set -euo pipefail
cd "$(dirname "$0")/../../../.."
rounds=${1:-3}
here=crates/burn-tp/benches/pytorch_generate
model=/tmp/burn-tp-generate-model
new=${NEW:-64}
[ -d "$model" ] || python3 $here/make_model.py "$model" "${D:-512}" "${L:-8}" "${H:-8}" "${KV:-4}" \
  "${FF:-1408}" "${V:-32000}"
prompts=/tmp/burn-tp-generate-prompts.txt
python3 - "$prompts" "${BATCH:-8}" <<'PY'
import random, sys
random.seed(1)
with open(sys.argv[1], "w") as f:
    for n in [16, 128, 40, 96, 24, 64, 112, 80][: int(sys.argv[2])]:
        f.write(",".join(str(random.randrange(1, 32000)) for _ in range(n)) + "\n")
PY
cargo build --release --example generate -q
args=()
while read -r line; do args+=(--prompt-ids "$line"); done < "$prompts"
python3 $here/hf_generate.py "$model" "$prompts" "$new" "$rounds" > /tmp/burn-tp-hf-gen.json
for tp in 1 2; do
  best=0
  for r in $(seq 1 "$rounds"); do
    target/release/examples/generate --model "$model" --tp $tp "${args[@]}" \
      --max-new-tokens "$new" > /tmp/burn-tp-gen.jsonl
    best=$(python3 -c "import json,sys; t=json.loads(open('/tmp/burn-tp-gen.jsonl').readline())['tokens_per_s']; print(max(t, $best))")
  done
  python3 - "$tp" "$best" <<'PY'
import json, sys
hf = json.load(open("/tmp/burn-tp-hf-gen.json"))
rows = [json.loads(l)["new_ids"] for l in open("/tmp/burn-tp-gen.jsonl")]
same = sum(r == h for r, h in zip(rows, hf["new_ids"]))
tp, ours = int(sys.argv[1]), float(sys.argv[2])
print(f"batch {len(rows)}: burn-tp tp {tp} {ours:.0f} tokens/s, transformers {hf['tokens_per_s']:.0f} "
      f"(torch {hf['torch']}, {hf['threads']} threads): {ours / hf['tokens_per_s']:.2f}x; "
      f"rows with transformers' ids: {same} of {len(rows)}")
PY
done

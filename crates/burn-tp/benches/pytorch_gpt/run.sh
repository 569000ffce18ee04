#!/usr/bin/env bash
# burn-tp's train_gpt and the same GPT in PyTorch (gpt.py), alternated ROUNDS times on this
# machine: peak RSS (/usr/bin/time) and tokens/s of the steps after the first. Not part of CI.
#
#   pip install torch   # the peer
#   crates/burn-tp/benches/pytorch_gpt/run.sh [ROUNDS] [-- extra train_gpt flags]
#
# Defaults: the issue-32 shape, d_model 256, 4 heads, 4 layers, batch 8, seq 1,024, f32, tp 1.
# DTYPE=bf16 runs both in bf16 with f32 master weights (train_gpt --dtype bf16, PyTorch's
# autocast).
set -euo pipefail
cd "$(dirname "$0")/../../../.."
rounds=${1:-3}
shift || true
[ "${1:-}" = "--" ] && shift
shape=(--d-model "${D:-256}" --heads "${H:-4}" --layers "${L:-4}" --batch "${B:-8}" --seq "${S:-1024}"
  --dtype "${DTYPE:-f32}")
cargo build --release --example train_gpt -q
for r in $(seq 1 "$rounds"); do
  for att in fused materialized; do
    [ "$att" = materialized ] && [ "${MATERIALIZED:-1}" = 0 ] && continue
    /usr/bin/time -f "%M" -o /tmp/burn-tp-rss target/release/examples/train_gpt --tp "${TP:-1}" \
      "${shape[@]}" --steps "${STEPS:-4}" --sample-len 0 --eval-every 1000 --quiet \
      --attention "$att" --out /tmp/burn-tp-peer-out "$@" > /tmp/burn-tp-peer.log
    tps=$(grep -o '([0-9]* in the steps' /tmp/burn-tp-peer.log | tr -dc 0-9)
    echo "round $r burn-tp $att: $(( $(cat /tmp/burn-tp-rss) / 1024 )) MiB, $tps tokens/s"
  done
  /usr/bin/time -f "%M" -o /tmp/burn-tp-rss python3 crates/burn-tp/benches/pytorch_gpt/gpt.py \
    "${shape[@]}" --vocab 27 --steps "${STEPS:-4}" > /tmp/burn-tp-peer.log
  echo "round $r $(cat /tmp/burn-tp-peer.log | cut -d, -f1): $(( $(cat /tmp/burn-tp-rss) / 1024 )) MiB"
done

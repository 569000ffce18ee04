#!/usr/bin/env bash
# The mixture-of-experts layer against PyTorch on the same cores: burn-tp's section 11 at ep 1
# (one rank, all cores) and transformers' MixtralSparseMoeBlock (moe.py), each forward +
# backward, with each side's expert GEMMs alone as its floor. Not part of CI.
#
#   pip install torch transformers   # the peer
#   crates/burn-tp/benches/pytorch_moe/run.sh
#
# The shape is section 11's (benches/tp/moe.rs): 2,048 tokens x d 512, 8 experts of width 1,024,
# top 2, f32.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
here=crates/burn-tp/benches/pytorch_moe
py=${PYTHON:-python3}
burn=$(cargo bench -q -p burn-tp --bench tp -- --only=moe 2>/dev/null)
echo "$burn"
torch=$($py $here/moe.py 2048 512 1024 8 2 7)
echo "$torch"
layer=$(echo "$burn" | awk -F'|' '$2 ~ /^ 1 $/ {print $4; exit}')
floor=$(echo "$burn" | awk -F'|' '$2 ~ /^ 1 $/ {print $5; exit}')
$py - "$layer" "$floor" "$torch" <<'PY'
import json, sys
layer, floor, torch = float(sys.argv[1]), float(sys.argv[2]), json.loads(sys.argv[3])
print(f"\n| side | layer ms | its GEMM floor ms | layer / floor |")
print(f"|---|---:|---:|---:|")
print(f"| burn-tp ep 1 | {layer:.1f} | {floor:.1f} | {layer / floor:.2f} |")
print(f"| PyTorch {torch['torch']} ({torch['threads']} threads) | {torch['layer_ms']:.1f} | {torch['floor_ms']:.1f} | {torch['layer_ms'] / torch['floor_ms']:.2f} |")
print(f"\nPyTorch layer / burn-tp layer: {torch['layer_ms'] / layer:.2f} (> 1: burn-tp faster)")
PY

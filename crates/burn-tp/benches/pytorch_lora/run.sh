#!/usr/bin/env bash
# A LoRA fine-tune's step against PEFT on the same cores: burn-tp's section 12 at tp 1 (one
# rank, all cores) and transformers + peft (lora.py), each the full fine-tune's step beside the
# LoRA one's, the same Llama shape and batch. Not part of CI.
#
#   pip install torch transformers peft   # the peer
#   crates/burn-tp/benches/pytorch_lora/run.sh
set -euo pipefail
cd "$(dirname "$0")/../../../.."
here=crates/burn-tp/benches/pytorch_lora
py=${PYTHON:-python3}
burn=$(cargo bench -q -p burn-tp --bench tp -- --only=lora 2>/dev/null)
echo "$burn"
torch=$($py $here/lora.py 4096 512 8 2 4 1408 256 4 5)
echo "$torch"
full=$(echo "$burn" | awk -F'|' '$2 ~ /^ 1 $/ {print $3; exit}')
lora=$(echo "$burn" | awk -F'|' '$2 ~ /^ 1 $/ {print $4; exit}')
$py - "$full" "$lora" "$torch" <<'PY'
import json, sys
full, lora, t = float(sys.argv[1]), float(sys.argv[2]), json.loads(sys.argv[3])
print("\n| side | full fine-tune ms | LoRA ms | full / LoRA |")
print("|---|---:|---:|---:|")
print(f"| burn-tp tp 1 | {full:.1f} | {lora:.1f} | {full / lora:.2f} |")
print(f"| PyTorch {t['torch']} + peft {t['peft']} ({t['threads']} threads) | {t['full_ms']:.1f} | {t['lora_ms']:.1f} | {t['full_ms'] / t['lora_ms']:.2f} |")
print(f"\nPEFT LoRA step / burn-tp LoRA step: {t['lora_ms'] / lora:.2f} (> 1: burn-tp faster)")
PY

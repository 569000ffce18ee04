#!/usr/bin/env bash
# burn-tp's section 6 against nanotron on PyTorch + gloo, alternated in one session.
#
#   crates/burn-tp/benches/nanotron/run.sh [--rounds N] [--quick]
#
# Makes a venv with torch from PyPI (once, in $TORCH_VENV, default target/torch-venv; ~3 GB:
# PyPI's Linux torch carries the CUDA libraries, unused here), then runs
# `cargo bench -p burn-tp --bench tp -- --only=floor` and `bench.py` one after the other, N
# rounds (default 2), so the machine's drift hits both alike.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../../.." && pwd)
rounds=2
quick=()
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) rounds=$2; shift 2 ;;
    --quick) quick=(--quick); shift ;;
    *) echo "usage: $0 [--rounds N] [--quick]" >&2; exit 2 ;;
  esac
done
venv=${TORCH_VENV:-$root/target/torch-venv}
if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet torch numpy
fi
cd "$root"
cargo bench -p burn-tp --bench tp --no-run
for r in $(seq 1 "$rounds"); do
  echo "=== round $r: burn-tp"
  cargo bench -q -p burn-tp --bench tp -- --only=floor "${quick[@]}" 2>/dev/null
  echo "=== round $r: nanotron + PyTorch + gloo"
  "$venv/bin/python" "$here/bench.py" "${quick[@]}"
done

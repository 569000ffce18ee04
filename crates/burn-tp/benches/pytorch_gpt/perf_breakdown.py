"""Where a `train_gpt` step's CPU time goes, by op: `perf record --call-graph dwarf` on the
release example (the unwinder reads the binary's .eh_frame; no rebuild), each sample put in the
first class whose pattern its call chain matches (leaf first, so a GEMM under the attention kernel
counts as the attention's GEMM). Not part of CI: the breakdown behind issue 48's figures in
docs/PERFORMANCE.md.

    cargo build --release --example train_gpt
    python3 crates/burn-tp/benches/pytorch_gpt/perf_breakdown.py [-- train_gpt flags]

Defaults: the issue-32 shape (d 256, 4 heads, 4 layers, batch 8, seq 1,024, tp 1, 4 steps).
Needs `perf` (`-e cpu-clock`: no hardware counters needed, so it runs in a VM).
Prints a Markdown table: each class's share of the CPU samples (every thread, the warm-up step
included), and the run's tokens/s.
"""

import collections
import os
import re
import subprocess
import sys
import tempfile

# (class, pattern on a frame's symbol); a sample's class is decided by the chain from its
# leaf up: the first frame that matches any "leaf" class wins, else the first "context" match.
LEAF = [
    ("GEMM", r"\bgemm_common::|\bgemm_f32::|\bgemm_f16::|\bnano_gemm|\bgemm::"),
    ("memcpy / memset", r"__memmove|__memcpy|__memset|memcpy|memset"),
    ("page faults, kernel", r"^\[k\]|page_fault|clear_page|do_anonymous_page|asm_exc"),
    ("rayon waiting", r"rayon_core::sleep|rayon_core::registry::WorkerThread::wait|sched_yield|futex|crossbeam_epoch"),
]
CONTEXT = [
    ("attention kernel", r"attention::flash_cpu|attention::flash::"),
    ("GELU / gate kernel", r"fused::activation_cpu"),
    ("norm kernel", r"fused::norm_cpu|layer_norm"),
    ("AdamW", r"burn_optim::"),
    ("cross-entropy", r"cross_entropy|log_softmax|softmax"),
    ("embedding", r"embedding"),
    ("host collectives", r"collective::host|burn_tp_comm::"),
    ("Flex elementwise / reductions", r"burn_flex::"),
]


def classify(frames):
    """The class of one sample from its frames (leaf first)."""
    leaf = frames[0] if frames else ""
    inside = None
    for name, pattern in CONTEXT:
        if any(re.search(pattern, f) for f in frames):
            inside = name
            break
    for name, pattern in LEAF:
        if re.search(pattern, leaf):
            if name == "GEMM" and inside == "attention kernel":
                return "attention kernel: its GEMMs"
            if name == "GEMM":
                return "GEMM (the linears, the head)"
            return name
    return inside or "other"


def main():
    args = sys.argv[1:]
    if args[:1] == ["--"]:
        args = args[1:]
    binary = os.environ.get("TRAIN_GPT", "target/release/examples/train_gpt")
    flags = [
        "--tp", "1", "--d-model", "256", "--heads", "4", "--layers", "4", "--batch", "8",
        "--seq", "1024", "--steps", os.environ.get("STEPS", "4"), "--sample-len", "0",
        "--eval-every", "1000", "--quiet", "--out", tempfile.mkdtemp(),
    ] + args
    data = tempfile.mktemp(suffix=".perf")
    run = subprocess.run(
        ["perf", "record", "-q", "-e", "cpu-clock", "-F", os.environ.get("FREQ", "250"),
         "--call-graph", "dwarf,16384", "-o", data, binary] + flags,
        capture_output=True, text=True, check=True,
    )
    tps = re.search(r"\((\d+) in the steps", run.stdout + run.stderr)
    script = subprocess.run(
        ["perf", "script", "-i", data, "-F", "comm,sym", "--no-inline"],
        capture_output=True, text=True, check=True,
    ).stdout
    os.remove(data)
    counts = collections.Counter()
    frames = []
    for line in script.splitlines() + [""]:
        if not line.strip():
            if frames:
                counts[classify(frames)] += 1
            frames = []
            continue
        if line.startswith(("\t", " ")):
            parts = line.strip().split(None, 1)
            frames.append(parts[1] if len(parts) > 1 else parts[0])
    total = sum(counts.values())
    print(f"train_gpt {' '.join(flags)}: {total} samples"
          + (f", {tps.group(1)} tokens/s after the first step" if tps else ""))
    print("\n| class | share of CPU samples |\n|---|---:|")
    for name, n in counts.most_common():
        print(f"| {name} | {100 * n / total:.1f} % |")


if __name__ == "__main__":
    main()

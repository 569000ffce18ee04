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
    # The kernels' loops are inlined into `cpu_math::simd`'s target-feature functions; on a
    # rayon worker that stole the task the unwound chain ends there, without the kernel's name.
    in_simd = any(re.search(r"cpu_math::avx", f) for f in frames)
    for name, pattern in LEAF:
        if re.search(pattern, leaf):
            # Only the attention's tasks call a GEMM from inside `simd` (one tile each).
            if name == "GEMM" and (inside == "attention kernel" or in_simd):
                return "attention kernel: its GEMMs"
            if name == "GEMM":
                return "GEMM (the linears, the head)"
            return name
    if inside is None and in_simd:
        return "CPU kernels' loops, caller not unwound (attention, GELU, norms)"
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
        ["perf", "script", "-i", data, "-F", "comm,ip,sym", "--no-inline"],
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
        # A sample: a header line (the thread's name), then its frames, leaf first, each a
        # tab, the address and the symbol; kernel addresses begin with ffffffff.
        if line.startswith("\t"):
            ip, _, sym = line.strip().partition(" ")
            if ip != "ffffffffffffffff":
                frames.append(("[k] " if ip.startswith("ffffffff") else "") + sym)
    total = sum(counts.values())
    print(f"train_gpt {' '.join(flags)}: {total} samples"
          + (f", {tps.group(1)} tokens/s after the first step" if tps else ""))
    print("\n| class | share of CPU samples |\n|---|---:|")
    for name, n in counts.most_common():
        print(f"| {name} | {100 * n / total:.1f} % |")


if __name__ == "__main__":
    main()

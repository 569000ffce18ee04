//! Section 5: context parallelism's bytes per rank. The Llama of PERFORMANCE's long-sequence
//! section (d 512, 8 heads, 2 key / value heads, 4 layers, batch 1, f32) over one forward and
//! backward of a sequence split over cp ranks (each a thread whose allocations carry its own
//! tag, `main.rs`'s counting allocator): what the graph keeps after the forward and the step's
//! peak, above the parameters, against cp 1 at the same tp (target: divided by cp, within
//! 1.2x). From the peak per position, the longest sequence whose step fits a rank of this
//! machine's 24 GiB (with the parameters, their gradients and AdamW's two moments).

use std::sync::atomic::Ordering;

use burn::module::Module;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_tp::comm::LocalGroup;
use burn_tp::context::{ContextParallel, CpLayout};
use burn_tp::llama::LlamaConfig;
use burn_tp::local::{RunOptions, run_ranks_with};
use burn_tp::mesh::DeviceMesh;
use burn_tp::model::LanguageModel;

use super::{TAG, TAGGED, TAGGED_PEAK, mb, start_peak};

/// The machine's memory a rank may fill in the extrapolation.
const BUDGET: f64 = 24.0 * 1024.0 * 1024.0 * 1024.0;

/// The most any rank's graph keeps after the forward and holds at the step's peak (bytes above
/// what it held before the forward), at tp x cp on a sequence of `seq`.
fn measure(config: &LlamaConfig, [tp, cp]: [usize; 2], seq: usize) -> (f64, f64) {
    let config = config.clone();
    let vocab = config.n_vocab;
    let options = RunOptions {
        threads_per_rank: Some(1),
        keep_freed_memory: Some(false),
    };
    let out = run_ranks_with(LocalGroup::new(tp * cp).unwrap(), options, move |world| {
        let rank = world.rank();
        TAG.set(rank);
        let device = Device::flex().autodiff();
        let mesh = DeviceMesh::new(world, tp).unwrap();
        let ctx = (cp > 1).then(|| {
            ContextParallel::new(mesh.context_group(cp).unwrap(), CpLayout::LoadBalanced).unwrap()
        });
        let model = config.init(mesh.tp_group(), &device).unwrap();
        let model = model.with_context_parallel(ctx.clone());
        let ids = |shift: usize| {
            let v: Vec<i64> = (0..seq).map(|j| ((j * 7 + shift) % vocab) as i64).collect();
            let t = Tensor::<2, Int>::from_data(TensorData::new(v, [seq, 1]), &device);
            match &ctx {
                Some(c) => c.split(t, 0).unwrap(),
                None => t,
            }
        };
        let (x, y) = (ids(0), ids(1));
        mesh.world().barrier().unwrap();
        let before = start_peak(rank);
        let loss = LanguageModel::loss(&model, x, y, None).unwrap();
        let kept = TAGGED[rank].load(Ordering::SeqCst) - before;
        let grads = loss.backward();
        let peak = TAGGED_PEAK[rank].load(Ordering::SeqCst) - before;
        drop(grads);
        TAG.set(usize::MAX);
        (kept as f64, peak as f64)
    })
    .unwrap();
    let most = |f: fn(&(f64, f64)) -> f64| out.iter().map(f).fold(0.0, f64::max);
    (most(|o| o.0), most(|o| o.1))
}

pub(super) fn context_memory(quick: bool) {
    let seq = std::env::args()
        .find_map(|a| a.strip_prefix("--seq=").and_then(|s| s.parse().ok()))
        .unwrap_or(if quick { 512 } else { 32768 });
    let (vocab, d, heads, kv, layers, ff) = (256, 512, 8, 2, 4, 1376);
    let config = LlamaConfig::new(vocab, seq, d, heads, kv, layers, ff);
    let solo = LocalGroup::new(1).unwrap().remove(0);
    let params = (config.init(&solo, &Device::flex()).unwrap().num_params() * 4) as f64;
    println!(
        "\n## Context parallelism: bytes per rank over one forward and backward (MB; Llama d {d}, \
         {heads} heads, {kv} kv heads, {layers} layers, vocabulary {vocab}, batch 1 x seq {seq}, \
         f32, load-balanced chunks; ranks as threads of one core each)\n"
    );
    println!(
        "parameters (unsplit): {} MB. Per position: the slope of the peak between seq {} and \
         {seq} (what grows with the sequence; the parameters' gradients do not).\n",
        mb(params),
        seq / 2
    );
    println!(
        "| tp | cp | kept after the forward | step peak | peak / cp 1's | per position (KB) | \
         / cp 1's | target 1 / cp | longest seq in 24 GiB a rank |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let (mut base_peak, mut base_slope) = (0.0, 0.0);
    for (tp, cp) in [(1usize, 1usize), (1, 2), (1, 4), (2, 1), (2, 2)] {
        let (kept, peak) = measure(&config, [tp, cp], seq);
        let (_, half) = measure(&config, [tp, cp], seq / 2);
        // Bytes per position of the whole sequence, on the rank.
        let slope = (peak - half) / (seq / 2) as f64;
        let intercept = peak - slope * seq as f64;
        if cp == 1 {
            (base_peak, base_slope) = (peak, slope);
        }
        // The parameters, their gradients and AdamW's two moments: 4 x the rank's shards.
        let longest = (BUDGET - 4.0 * params / tp as f64 - intercept) / slope;
        println!(
            "| {tp} | {cp} | {} | {} | {:.3} | {:.1} | {:.3} | {:.3} | {:.0}k |",
            mb(kept),
            mb(peak),
            peak / base_peak,
            slope / 1e3,
            slope / base_slope,
            1.0 / cp as f64,
            longest / 1024.0
        );
    }
}

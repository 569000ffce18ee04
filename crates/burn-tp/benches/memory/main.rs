//! What the autodiff graph keeps for the backward, per transformer layer, counted exactly: every
//! allocation of the process goes through a counting allocator, and a layer's share is the bytes
//! still allocated after the forward of a 2-layer model minus those after the forward of a
//! 1-layer model (same shapes, same rank), each measured before its backward. Per rank: the
//! ranks are threads of one process, so the process's count is divided by tp (every rank holds
//! the same shapes). The parts (each norm, the attention, the MLP) are the same difference for
//! the part alone on a tracked input.
//!
//! The reference is Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
//! Transformer Models": with sequence parallelism and selective recompute a layer keeps
//! `34 s b h / t` bytes in 16-bit, twice that in f32 (GELU MLP, attention dropout; the SwiGLU
//! MLP of the Llama keeps more: its formula is printed beside it).
//!
//! Section 2 counts each pipeline stage's bytes alone: its rank thread's allocations carry a
//! tag, kept in a header in front of each block, so a block freed on another thread still comes
//! off the right count. Section 3 counts a MoE model's rank the same way at ep 1, 2, 4: the
//! parameters and AdamW state it holds after a step. Section 4 sets a LoRA fine-tune beside the
//! full one (`--only=lora`). Section 5 counts a context-parallel rank's bytes over a step at a
//! long sequence (`--only=context`). Section 6 counts a fully sharded data-parallel rank's bytes
//! against plain dp and the distributed optimizer, and times its step (`--only=fsdp`).
//!
//! ```text
//! cargo bench -p burn-tp --bench memory            # the issue's shapes
//! cargo bench -p burn-tp --bench memory -- --quick # small shapes (CI smoke)
//! cargo bench -p burn-tp --bench memory -- --only=pipeline # section 2 alone
//! cargo bench -p burn-tp --bench memory -- --only=moe      # section 3 alone
//! cargo bench -p burn-tp --bench memory -- --only=lora     # section 4 alone
//! cargo bench -p burn-tp --bench memory -- --only=context  # section 5 alone (--seq=N)
//! cargo bench -p burn-tp --bench memory -- --only=fsdp     # section 6 alone
//! cargo bench -p burn-tp --bench memory -- --only=fsdp-pipeline  # its prefetch under pp
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicI64, Ordering};

use burn::module::Module;
use burn::tensor::{Device, FloatDType, Int, Tensor, TensorData};
use burn_tp::attention::ParallelAttentionConfig;
use burn_tp::comm::{LocalGroup, ProcessGroup};
use burn_tp::dropout::{DropoutKey, DropoutStep};
use burn_tp::gpt::{Gpt, GptConfig};
use burn_tp::linear::{TpMode, TpSettings};
use burn_tp::llama::{Llama, LlamaConfig, ParallelSwiGluConfig};
use burn_tp::local::{RunOptions, run_ranks_with};
use burn_tp::model::LanguageModel;
use burn_tp::norm::{TpLayerNorm, TpRmsNorm};
use burn_tp::pipeline::{
    Pipeline, PipelineSchedule, drop_unused_ends, loss_and_grads, virtual_stage_layers,
};
use burn_tp::precision::cast_params;
use burn_tp::transformer::ParallelMlpConfig;

/// Bytes the process holds (all threads).
static LIVE: AtomicI64 = AtomicI64::new(0);

/// Tags a thread's allocations can carry (a pipeline stage's rank thread: its own count).
const TAGS: usize = 8;
/// Per tag: bytes held, and the most held since [`start_peak`].
static TAGGED: [AtomicI64; TAGS] = [const { AtomicI64::new(0) }; TAGS];
static TAGGED_PEAK: [AtomicI64; TAGS] = [const { AtomicI64::new(0) }; TAGS];

thread_local! {
    /// This thread's tag (`usize::MAX`: none).
    static TAG: Cell<usize> = const { Cell::new(usize::MAX) };
}

struct Counting;

/// Room in front of each block for its tag: the alignment, at least 16 bytes.
fn header(align: usize) -> usize {
    align.max(16)
}

// SAFETY: every block is the system allocator's, `header` bytes larger at the front (a multiple
// of the alignment, so the block handed out is aligned); the tag of the thread that allocated
// it sits in the 8 bytes before it, so a block freed on another thread is taken off the right
// count. realloc and alloc_zeroed are the trait's defaults (through these two).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let pad = header(layout.align());
        let Ok(outer) = Layout::from_size_align(layout.size() + pad, pad) else {
            return std::ptr::null_mut();
        };
        let base = unsafe { System.alloc(outer) };
        if base.is_null() {
            return base;
        }
        let size = layout.size() as i64;
        LIVE.fetch_add(size, Ordering::Relaxed);
        let tag = TAG.try_with(Cell::get).unwrap_or(usize::MAX);
        if tag < TAGS {
            let now = TAGGED[tag].fetch_add(size, Ordering::Relaxed) + size;
            TAGGED_PEAK[tag].fetch_max(now, Ordering::Relaxed);
        }
        unsafe {
            let ptr = base.add(pad);
            (ptr.sub(8) as *mut usize).write(tag);
            ptr
        }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let pad = header(layout.align());
        let size = layout.size() as i64;
        LIVE.fetch_sub(size, Ordering::Relaxed);
        let tag = unsafe { (ptr.sub(8) as *const usize).read() };
        if tag < TAGS {
            TAGGED[tag].fetch_sub(size, Ordering::Relaxed);
        }
        let outer = Layout::from_size_align(layout.size() + pad, pad).expect("as allocated");
        unsafe { System.dealloc(ptr.sub(pad), outer) }
    }
}

/// Bytes this tag holds now; the peak restarts from here.
fn start_peak(tag: usize) -> i64 {
    let now = TAGGED[tag].load(Ordering::SeqCst);
    TAGGED_PEAK[tag].store(now, Ordering::SeqCst);
    now
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Bytes held by tensors and everything else: allocated, less the free blocks the collectives'
/// buffer pool keeps for reuse.
fn live() -> i64 {
    LIVE.load(Ordering::SeqCst) - burn_tp::backend::pool_free_bytes() as i64
}

#[derive(Clone, Copy, Debug)]
enum Arch {
    Gpt,
    Llama,
}

#[derive(Clone, Copy, Debug)]
struct Case {
    arch: Arch,
    d: usize,
    heads: usize,
    kv_heads: usize,
    seq: usize,
    batch: usize,
    tp: usize,
    dtype: FloatDType,
}

impl Case {
    fn settings(&self) -> TpSettings {
        TpSettings::new().with_mode(if self.tp > 1 {
            TpMode::ReduceScatter
        } else {
            TpMode::AllReduce
        })
    }

    /// Megatron's bytes per layer (sequence parallel, selective recompute) in this dtype, for a
    /// layer with `per` bytes per `s b h` in 16-bit.
    fn megatron(&self, per: f64) -> f64 {
        let sbh = (self.seq * self.batch * self.d) as f64;
        let scale = match self.dtype {
            FloatDType::F32 => 2.0,
            _ => 1.0,
        };
        per * sbh * scale / self.tp as f64
    }

    /// Korthikanti et al.'s count for this very layer, in 16-bit bytes per `s b h`: the two norms'
    /// inputs (4); the attention's input (2), q (2), k and v (`4 kv / heads`), the projection's
    /// input (2), the dropout mask (1); the MLP's input (2), then GELU's input and output (8 + 8)
    /// or SwiGLU's gate, up and product (8 + 8 + 8, d_ff = 4h), and its dropout mask (1). The
    /// GPT's is the paper's 34.
    fn own_count(&self) -> f64 {
        let attention = 7.0 + 4.0 * self.kv_heads as f64 / self.heads as f64;
        let mlp = match self.arch {
            Arch::Gpt => 19.0,
            Arch::Llama => 27.0,
        };
        4.0 + attention + mlp
    }
}

/// `f` on every rank of a tp group of `case` (one thread each, the allocator's settings left
/// alone), on the autodiff Flex device: rank 0's value.
fn rank_zero(case: Case, f: impl Fn(ProcessGroup, Device) -> f64 + Send + Sync + 'static) -> f64 {
    let options = RunOptions {
        threads_per_rank: Some(1),
        keep_freed_memory: Some(false),
    };
    let groups = LocalGroup::new(case.tp).unwrap();
    run_ranks_with(groups, options, move |g| f(g, Device::flex().autodiff())).unwrap()[0]
}

/// The bytes the forward of a `layers`-layer model (its loss, before the backward) adds,
/// divided by tp.
fn model_forward_bytes(case: Case, layers: usize) -> f64 {
    rank_zero(case, move |g, dev| match case.arch {
        Arch::Gpt => {
            let config = GptConfig::new(27, case.seq, case.d, case.heads, layers)
                .with_settings(case.settings());
            measure(case, Gpt::init(&config, &g, &dev).unwrap(), &g, &dev)
        }
        Arch::Llama => {
            let config = LlamaConfig::new(
                27,
                case.seq,
                case.d,
                case.heads,
                case.kv_heads,
                layers,
                4 * case.d,
            )
            .with_dropout(0.1)
            .with_settings(case.settings());
            measure(case, Llama::init(&config, &g, &dev).unwrap(), &g, &dev)
        }
    })
}

fn measure<M: LanguageModel>(case: Case, model: M, g: &ProcessGroup, dev: &Device) -> f64 {
    let model = cast_params(model, case.dtype);
    let ids = Tensor::<1, Int>::arange(0..(case.seq * case.batch) as i64, dev)
        .remainder_scalar(27)
        .reshape([case.seq, case.batch]);
    let targets = ids.clone();
    g.barrier().unwrap();
    let before = live();
    g.barrier().unwrap();
    let loss = model.loss(ids, targets, Some(DropoutStep::new(1))).unwrap();
    g.barrier().unwrap();
    let after = live();
    g.barrier().unwrap();
    drop(loss.backward());
    (after - before) as f64 / case.tp as f64
}

/// Bytes the forward of one part adds (the input made before the count), divided by tp.
fn part_bytes(case: Case, part: &'static str) -> f64 {
    rank_zero(case, move |g, dev| {
        let settings = case.settings();
        let rows = case.seq / if case.tp > 1 { case.tp } else { 1 };
        let x = Tensor::<3>::ones([rows, case.batch, case.d], &dev)
            .cast(case.dtype)
            .require_grad();
        let llama = matches!(case.arch, Arch::Llama);
        let f: Box<dyn Fn(Tensor<3>) -> Tensor<3>> = match part {
            "norm" if llama => {
                let n = TpRmsNorm::new(case.d, 1e-5, settings.mode, &g, &dev);
                let n = cast_params(n, case.dtype);
                Box::new(move |x| n.forward(x))
            }
            "norm" => {
                let n = cast_params(
                    TpLayerNorm::new(case.d, settings.mode, &g, &dev),
                    case.dtype,
                );
                Box::new(move |x| n.forward(x))
            }
            "attention" => {
                let mut config = ParallelAttentionConfig::new(case.d, case.heads)
                    .with_n_kv_heads(Some(case.kv_heads))
                    .with_settings(settings);
                if llama {
                    config = config
                        .with_rope_theta(Some(10000.0))
                        .with_max_seq(case.seq)
                        .with_dropout(0.1);
                }
                let a = cast_params(config.init(&g, &dev).unwrap(), case.dtype);
                let key = DropoutKey {
                    seed: 0,
                    at: DropoutStep::new(1),
                };
                Box::new(move |x| a.try_forward(x, Some(key), 1).unwrap())
            }
            _ if llama => {
                let m = ParallelSwiGluConfig::new(case.d, 4 * case.d)
                    .with_settings(settings)
                    .init(&g, &dev)
                    .unwrap();
                let m = cast_params(m, case.dtype);
                Box::new(move |x| m.forward(x))
            }
            _ => {
                let m = cast_params(
                    ParallelMlpConfig::new(case.d, 4 * case.d)
                        .with_settings(settings)
                        .init(&g, &dev)
                        .unwrap(),
                    case.dtype,
                );
                Box::new(move |x| m.forward(x))
            }
        };
        // One step first: what the first call allocates once (pools, caches) is not the
        // part's.
        drop(f(x.clone()).sum().backward());
        g.barrier().unwrap();
        let before = live();
        g.barrier().unwrap();
        let y = f(x);
        g.barrier().unwrap();
        let after = live();
        g.barrier().unwrap();
        drop(y.sum().backward());
        (after - before) as f64 / case.tp as f64
    })
}

fn mb(x: f64) -> String {
    format!("{:.1}", x / 1e6)
}

mod context;
mod experts;
mod fsdp;

use experts::{lora_memory, moe_memory};

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    if std::env::args().any(|a| a == "--only=pipeline") {
        pipeline_memory(quick);
        return;
    }
    if std::env::args().any(|a| a == "--only=moe") {
        moe_memory(quick);
        return;
    }
    if std::env::args().any(|a| a == "--only=lora") {
        lora_memory(quick);
        return;
    }
    if std::env::args().any(|a| a == "--only=context") {
        context::context_memory(quick);
        return;
    }
    if std::env::args().any(|a| a == "--only=fsdp") {
        fsdp::fsdp_memory(quick);
        fsdp::fsdp_step_time(quick);
        fsdp::fsdp_pipeline_time(quick);
        return;
    }
    if std::env::args().any(|a| a == "--only=fsdp-pipeline") {
        fsdp::fsdp_pipeline_time(quick);
        return;
    }
    let (seq, batch) = if quick { (128, 2) } else { (1024, 8) };
    let mut cases = Vec::new();
    for dtype in [FloatDType::F32, FloatDType::BF16] {
        for tp in [1, 4] {
            cases.push(Case {
                arch: Arch::Gpt,
                d: 256,
                heads: 4,
                kv_heads: 4,
                seq,
                batch,
                tp,
                dtype,
            });
        }
    }
    for tp in [1, 4] {
        cases.push(Case {
            arch: Arch::Llama,
            d: 512,
            heads: 8,
            kv_heads: 2,
            seq,
            batch,
            tp,
            dtype: FloatDType::F32,
        });
    }
    println!(
        "## Activation bytes per layer, per rank (MB; s {seq}, b {batch}; tp > 1 sequence parallel)\n"
    );
    println!(
        "| model | dtype | tp | layer | 34 s b h / t | Megatron's count of this layer | layer / count | parts: norm, attention, MLP |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---|");
    for case in cases {
        let one = model_forward_bytes(case, 1);
        let two = model_forward_bytes(case, 2);
        let layer = two - one;
        let parts = format!(
            "{}, {}, {}",
            mb(part_bytes(case, "norm")),
            mb(part_bytes(case, "attention")),
            mb(part_bytes(case, "mlp"))
        );
        let count = case.megatron(case.own_count());
        println!(
            "| {:?} d {} | {:?} | {} | {} | {} | {} ({}) | {:.2} | {} |",
            case.arch,
            case.d,
            case.dtype,
            case.tp,
            mb(layer),
            mb(case.megatron(34.0)),
            mb(count),
            case.own_count(),
            layer / count,
            parts
        );
    }
    pipeline_memory(quick);
    moe_memory(quick);
    lora_memory(quick);
    context::context_memory(quick);
    fsdp::fsdp_memory(quick);
    fsdp::fsdp_step_time(quick);
    fsdp::fsdp_pipeline_time(quick);
}

/// Section 2: bytes per pipeline stage over one step, each stage a rank thread whose
/// allocations carry its tag (one thread per rank, so all of a stage's work is on it): the
/// parameters it holds before the step (a stage keeps its blocks, the first the embedding, the
/// last the final norm and the head: `drop_unused_ends`), beside the whole model's / pp, and the
/// most it held during the step above that, beside the micro-batches it held at once (1F1B at
/// most `pp - stage`, GPipe all of them). The last column is that peak per micro-batch held; it
/// also carries the gradients (as large as the parameters) and the step's temporaries.
fn pipeline_memory(quick: bool) {
    let (seq, micro, layers, m): (usize, usize, usize, usize) =
        if quick { (64, 2, 4, 4) } else { (256, 2, 8, 8) };
    let (vocab, d, ff) = (8192, 256, 688);
    let config = LlamaConfig::new(vocab, seq, d, 4, 2, layers, ff);
    let solo = LocalGroup::new(1).unwrap().remove(0);
    let whole = {
        let model = config.init(&solo, &Device::flex()).unwrap();
        (model.num_params() * 4) as f64
    };
    println!(
        "\n## Pipeline stages: bytes per stage over one step (MB; Llama vocab {vocab}, d {d}, \
         {layers} blocks, seq {seq}, {micro} sequences per micro-batch, {m} micro-batches, f32; \
         ranks as threads, one each)\n"
    );
    println!(
        "| pp | schedule | stage | parameters | whole model / pp | step peak above them | \
         micro-batches held | peak / held |"
    );
    println!("|---:|---|---:|---:|---:|---:|---:|---:|");
    let pps: &[usize] = if quick { &[2] } else { &[2, 4] };
    for &pp in pps {
        for schedule in [
            PipelineSchedule::GPipe,
            PipelineSchedule::OneFOneB,
            PipelineSchedule::Interleaved { virtual_stages: 2 },
        ] {
            if schedule.virtual_stages() > 1 && (!m.is_multiple_of(pp) || pp * 2 > layers) {
                continue;
            }
            let options = RunOptions {
                threads_per_rank: Some(1),
                keep_freed_memory: Some(false),
            };
            let config = config.clone();
            let out = run_ranks_with(LocalGroup::new(pp).unwrap(), options, move |g| {
                let stage = g.rank();
                TAG.set(stage);
                let device = Device::flex().autodiff();
                let solo = LocalGroup::new(1).unwrap().remove(0);
                let held: Vec<usize> = virtual_stage_layers(layers, pp, schedule, stage)
                    .unwrap()
                    .into_iter()
                    .flatten()
                    .collect();
                let model = config.init_layers(&solo, &device, &held).unwrap();
                let model = drop_unused_ends(model, stage, pp).unwrap();
                let pipe = Pipeline::new(&g).unwrap();
                let ids = |i: usize| {
                    let v: Vec<i64> = (0..seq * micro)
                        .map(|j| ((i * 31 + j * 7) % vocab) as i64)
                        .collect();
                    Tensor::<2, Int>::from_data(TensorData::new(v, [seq, micro]), &device)
                };
                let batches: Vec<_> = (0..m).map(|i| (ids(i), ids(i + 1))).collect();
                g.barrier().unwrap();
                let before = start_peak(stage);
                let out = loss_and_grads(&model, &pipe, &batches, schedule, None).unwrap();
                let peak = TAGGED_PEAK[stage].load(Ordering::SeqCst) - before;
                let held = out.peak_in_flight;
                drop(out);
                let params = (model.num_params() * 4) as f64;
                TAG.set(usize::MAX);
                (params, peak as f64, held)
            })
            .unwrap();
            for (stage, (params, peak, held)) in out.into_iter().enumerate() {
                println!(
                    "| {pp} | {schedule:?} | {stage} | {} | {} | {} | {held} | {} |",
                    mb(params),
                    mb(whole / pp as f64),
                    mb(peak),
                    mb(peak / held as f64)
                );
            }
        }
    }
}

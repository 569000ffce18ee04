//! Sharded checkpoints: where each rank's shards lie in the full parameters (the layout a
//! sharded checkpoint writes), checked against the gathered full model.

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;
use burn_tp::gpt::GptConfig;
use burn_tp::linear::{TpMode, TpSettings};
use burn_tp::llama::LlamaConfig;
use burn_tp::local::run_local;
use burn_tp::reshard::{ParamLayout, Reshard};

use crate::common::{device, f64s, rng_lock};

/// `(shape, values)` of every float parameter, in visiting order.
fn params<M: Module>(module: &M) -> Vec<(Vec<usize>, Vec<f64>)> {
    struct Collect(Vec<(Vec<usize>, Vec<f64>)>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let t = param.val();
            self.0.push((t.dims().to_vec(), f64s(t)));
        }
    }
    let mut c = Collect(Vec::new());
    module.visit(&mut c);
    c.0
}

/// The values of `values` (row-major `shape`) at `range` along `dim`.
fn slice(shape: &[usize], values: &[f64], dim: usize, range: std::ops::Range<usize>) -> Vec<f64> {
    let inner: usize = shape[dim + 1..].iter().product();
    let outer: usize = shape[..dim].iter().product();
    let mut out = Vec::new();
    for o in 0..outer {
        let base = o * shape[dim] * inner;
        out.extend_from_slice(&values[base + range.start * inner..base + range.end * inner]);
    }
    out
}

/// Every rank's layout of `model` (built at `tp` by `build`) against the gathered full model:
/// one layout per parameter; each piece is that slice of the full parameter; the written pieces
/// tile every full parameter exactly once.
fn check_layouts<M: Module + Reshard + 'static>(
    tp: usize,
    tag: &str,
    build: impl Fn(&burn_tp::ProcessGroup) -> M + Send + Sync + 'static,
) {
    type RankOut = (
        Vec<ParamLayout>,
        Vec<(Vec<usize>, Vec<f64>)>,
        Vec<(Vec<usize>, Vec<f64>)>,
    );
    let out: Vec<RankOut> = run_local(tp, move |g| {
        let model = build(&g);
        let full = model.to_full_module().unwrap();
        (model.layout(g.rank()), params(&model), params(&full))
    })
    .unwrap();
    let full = &out[0].2;
    for (r, (layouts, local, _)) in out.iter().enumerate() {
        assert_eq!(
            layouts.len(),
            local.len(),
            "{tag} rank {r}: a layout per parameter"
        );
        for (k, (layout, (shape, values))) in layouts.iter().zip(local).enumerate() {
            let (full_shape, full_values) = &full[k];
            assert_eq!(
                &layout.global_shape, full_shape,
                "{tag} rank {r} parameter {k}"
            );
            for (d, (&n, &g)) in shape.iter().zip(full_shape).enumerate() {
                if d != layout.dim {
                    assert_eq!(n, g, "{tag} rank {r} parameter {k}: dim {d} is whole");
                }
            }
            for p in &layout.pieces {
                assert_eq!(
                    slice(shape, values, layout.dim, p.local.clone()),
                    slice(full_shape, full_values, layout.dim, p.global.clone()),
                    "{tag} rank {r} parameter {k}: piece {p:?}"
                );
            }
        }
    }
    for (k, (full_shape, _)) in full.iter().enumerate() {
        let dim = out[0].0[k].dim;
        let mut written: Vec<_> = out
            .iter()
            .flat_map(|(layouts, _, _)| layouts[k].pieces.iter().filter(|p| p.writes))
            .map(|p| p.global.clone())
            .collect();
        written.sort_by_key(|r| r.start);
        let mut next = 0;
        for range in written {
            assert_eq!(
                range.start, next,
                "{tag} parameter {k}: written {:?}",
                range
            );
            next = range.end;
        }
        assert_eq!(
            next, full_shape[dim],
            "{tag} parameter {k}: the written pieces end early"
        );
    }
}

#[test]
fn every_rank_knows_where_its_shards_lie_in_the_full_parameters() {
    let _rng = rng_lock();
    // A vocabulary of 13: padded to 14 at tp 2 and 16 at tp 4, rank 3's rows partly padding.
    for tp in [1usize, 2, 4] {
        for (tied, fused) in [(false, true), (true, false)] {
            for mode in [TpMode::AllReduce, TpMode::ReduceScatter] {
                device().seed(5);
                check_layouts(
                    tp,
                    &format!("gpt tp {tp} tied {tied} fused {fused} {mode:?}"),
                    move |g| {
                        GptConfig::new(13, 8, 16, 4, 2)
                            .with_settings(TpSettings::new().with_mode(mode))
                            .with_tie_embeddings(tied)
                            .with_fused_qkv(fused)
                            .init(g, &device())
                            .unwrap()
                    },
                );
            }
        }
        // Key / value heads sharded (4), replicated on pairs of ranks (2 at tp 4) and on every
        // rank (1): replicas are written by the lowest rank holding them.
        for n_kv in [1usize, 2, 4] {
            device().seed(6);
            check_layouts(tp, &format!("llama tp {tp} kv {n_kv}"), move |g| {
                LlamaConfig::new(13, 8, 16, 4, n_kv, 2, 32)
                    .init(g, &device())
                    .unwrap()
            });
        }
    }
}

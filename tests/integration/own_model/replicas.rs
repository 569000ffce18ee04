//! Data-parallel replicas: identical by construction (a fresh model at tp 2 x dp 2, a MoE
//! model built at ep 2), and refused by every dp helper where they differ.

use burn::module::{Module, ModuleMapper, Param};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::Tensor;
use burn_tp::TpError;
use burn_tp::comm::LocalGroup;
use burn_tp::dp::{
    DistributedAdamW, DpOptimizer, GradReducer, ReplicaPolicy, check_replicas, sync_replicas,
};
use burn_tp::fsdp::Fsdp;
use burn_tp::gpt::GptConfig;
use burn_tp::linear::{TpMode, TpSettings};
use burn_tp::local::run_ranks;
use burn_tp::mesh::DeviceMesh;
use burn_tp::reshard::Reshard;

use super::{MyMlp, batch, loss_of};
use crate::common::{device, param_values, rng_lock};

/// A fresh model at tp 2 x dp 2, each replica drawing its own (no broadcast, no ordering of
/// the replicas' draws): the replicas hold the same values, and a second run the same again;
/// at tp 1 the same full model (its shards cut from the same draws).
#[test]
fn a_fresh_model_is_identical_on_every_replica_and_every_run_without_a_broadcast() {
    let _rng = rng_lock();
    let run = |tp: usize, dp: usize| {
        device().seed(5);
        run_ranks(LocalGroup::new(tp * dp).unwrap(), move |world| {
            let mesh = DeviceMesh::new(world, tp).unwrap();
            let gpt = GptConfig::new(12, 8, 16, 2, 2)
                .with_settings(TpSettings::new().with_mode(TpMode::ReduceScatter))
                .init(mesh.tp_group(), &device())
                .unwrap();
            let mine = MyMlp::new(TpMode::ReduceScatter, mesh.tp_group());
            let check = check_replicas(&gpt, mesh.dp_group(), None)
                .and_then(|()| check_replicas(&mine, mesh.dp_group(), None));
            (
                param_values(&gpt.to_full_module().unwrap()),
                param_values(&mine.to_full_module().unwrap()),
                check,
            )
        })
        .unwrap()
    };
    let first = run(2, 2);
    for (r, (gpt, mine, check)) in first.iter().enumerate() {
        assert_eq!(check, &Ok(()), "rank {r}");
        assert_eq!(gpt, &first[0].0, "rank {r}'s GPT");
        assert_eq!(mine, &first[0].1, "rank {r}'s own model");
    }
    let again = run(2, 2);
    assert_eq!(again[3].0, first[0].0, "a second run's GPT");
    assert_eq!(again[3].1, first[0].1, "a second run's own model");
    let tp1 = run(1, 1);
    assert_eq!(tp1[0].0, first[0].0, "the GPT at tp 1");
    assert_eq!(tp1[0].1, first[0].1, "the own model at tp 1");
    // Another seed, another model.
    device().seed(6);
    let other = run_ranks(LocalGroup::new(1).unwrap(), |g| {
        param_values(&MyMlp::new(TpMode::AllReduce, &g))
    })
    .unwrap();
    assert_ne!(other[0], first[0].1);
}

/// Adds 1e-3 to the first element of the parameter at visiting `slot`.
struct Nudge(usize, usize);

impl ModuleMapper for Nudge {
    fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let k = self.1;
        self.1 += 1;
        if k != self.0 {
            return p;
        }
        p.map(|t| {
            let mut v = t.to_data().convert::<f32>().try_to_vec::<f32>().unwrap();
            v[0] += 1e-3;
            let shape = t.shape();
            Tensor::from_data(burn::tensor::TensorData::new(v, shape), &t.device()).require_grad()
        })
    }
}

/// What each dp helper says at its first step when dp rank 1's parameter `slot` was nudged.
fn refusals(slot: usize) -> Vec<Vec<String>> {
    run_ranks(LocalGroup::new(4).unwrap(), move |world| {
        let mesh = DeviceMesh::new(world, 2).unwrap();
        let (tp_g, dp_g) = (mesh.tp_group().clone(), mesh.dp_group().clone());
        let mut model = MyMlp::new(TpMode::AllReduce, &tp_g);
        if mesh.dp_rank() == 1 {
            model = model.map(&mut Nudge(slot, 0));
        }
        let x = batch(0, mesh.dp_rank(), 2);
        let grads =
            |m: &MyMlp| GradientsParams::from_grads(loss_of(m.forward(x.clone())).backward(), m);
        let say = |r: burn_tp::Result<()>| r.err().map(|e| e.to_string()).unwrap_or_default();
        let mut out = Vec::new();
        // DpOptimizer, the gradients averaged after the backward.
        let mut optim = DpOptimizer::new(AdamWConfig::new().init());
        let g = grads(&model);
        out.push(say(optim
            .step(1e-2, model.clone(), &model, g, &dp_g)
            .map(|_| ())));
        // GradReducer (buckets during the backward).
        let reducer = GradReducer::new(&model, &dp_g, 1 << 20);
        let tapped = reducer.attach(model.clone(), true);
        let mut g = grads(&tapped);
        out.push(say(reducer.finish(&model, &mut g)));
        // The distributed optimizer.
        let mut zero = DistributedAdamW::new(&AdamWConfig::new(), &model, &dp_g, 1 << 20);
        let tapped = zero.attach(model.clone(), true);
        let g = grads(&tapped);
        out.push(say(zero.step(1e-2, model.clone(), g).map(|_| ())));
        // Fsdp, on the whole model it was made from.
        let fsdp = Fsdp::new(&model, &dp_g);
        let mut g = GradientsParams::new();
        out.push(say(fsdp.finish_grads(&fsdp.shard(model.clone()), &mut g)));
        // sync_replicas: refused, or broadcast (then checked again: the same).
        out.push(say(sync_replicas(
            model.clone(),
            &dp_g,
            None,
            ReplicaPolicy::Refuse,
        )
        .map(|_| ())));
        let synced = sync_replicas(model, &dp_g, None, ReplicaPolicy::Broadcast).unwrap();
        out.push(say(check_replicas(&synced, &dp_g, None)));
        out
    })
    .unwrap()
}

/// A replica that differs in one parameter (the first, or the last) is refused by every dp
/// helper, naming the parameter, on every rank; `sync_replicas` with `Broadcast` mends it.
#[test]
fn replicas_that_differ_are_refused_by_every_dp_helper_naming_the_parameter() {
    let _rng = rng_lock();
    // Visiting order: offset, norm.gamma, norm.beta, fc1's weight, bias, fc2's weight, bias.
    for (slot, name) in [(0usize, "offset"), (6, "fc2")] {
        device().seed(9);
        let out = refusals(slot);
        for (rank, said) in out.iter().enumerate() {
            for (what, helper) in said.iter().zip([
                "DpOptimizer",
                "GradReducer",
                "DistributedAdamW",
                "Fsdp",
                "check_replicas",
            ]) {
                assert!(
                    what.contains(helper) && what.contains(name) && what.contains("different"),
                    "rank {rank}, slot {slot}: {helper} said {what:?}"
                );
            }
            assert_eq!(said[5], "", "rank {rank}: after the broadcast");
        }
    }
    // Nothing nudged: nothing refused.
    device().seed(9);
    let out = refusals(usize::MAX);
    for said in out {
        assert!(said.iter().all(String::is_empty), "{said:?}");
    }
    let e = TpError::ReplicasDiffer {
        what: "x".into(),
        param: "fc1.weight".into(),
        ranks: 2,
    };
    assert!(e.to_string().contains("broadcast_parameters"));
}

/// A mixture-of-experts Llama built directly at ep 2 (each rank its experts, dp = ep): the
/// dense parameters are the same on both replicas without a broadcast (each ep rank drew the
/// experts' full weights too, so its stream stayed in step), as the replica check verifies,
/// and the model is the ep 1 model's.
#[test]
fn a_moe_model_built_at_ep_2_has_identical_dense_replicas() {
    use burn_tp::llama::LlamaConfig;
    use burn_tp::model::LanguageModel;
    use burn_tp::moe::ExpertsConfig;
    let _rng = rng_lock();
    let config =
        LlamaConfig::new(24, 8, 16, 4, 2, 3, 32).with_experts(Some(ExpertsConfig::new(4, 2, 32)));
    let build = move |ep: usize| {
        let config = config.clone();
        device().seed(12);
        run_ranks(LocalGroup::new(ep).unwrap(), move |world| {
            let mesh = DeviceMesh::new(world.clone(), 1).unwrap();
            let (ep_group, expert_dp) = mesh.expert_groups(ep).unwrap();
            let tp = world.split(world.rank(), 0).unwrap();
            let all: Vec<usize> = (0..3).collect();
            let model = config
                .init_expert_parallel(&tp, &ep_group, &device(), &all)
                .unwrap();
            let experts = burn_tp::dp::Experts {
                params: model.expert_params().into_iter().collect(),
                group: expert_dp,
            };
            let check = check_replicas(&model, mesh.dp_group(), Some(&experts));
            let dense: Vec<Vec<f64>> = {
                let ids: std::collections::HashSet<_> = experts.params.clone();
                dense_values(&model, &ids)
            };
            (check, dense)
        })
        .unwrap()
    };
    let ep2 = build(2);
    let ep1 = build(1);
    for (r, (check, dense)) in ep2.iter().enumerate() {
        assert_eq!(check, &Ok(()), "ep 2 rank {r}");
        assert_eq!(
            dense, &ep1[0].1,
            "ep 2 rank {r}'s dense parameters are the ep 1 model's"
        );
    }
}

/// The values of `model`'s parameters not in `skip`, in visiting order.
fn dense_values<M: Module>(
    model: &M,
    skip: &std::collections::HashSet<burn::module::ParamId>,
) -> Vec<Vec<f64>> {
    use burn::module::ModuleVisitor;
    struct Dense<'a>(
        &'a std::collections::HashSet<burn::module::ParamId>,
        Vec<Vec<f64>>,
    );
    impl ModuleVisitor for Dense<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            if !self.0.contains(&p.id) {
                self.1.push(crate::common::f64s(p.val()));
            }
        }
    }
    let mut v = Dense(skip, Vec::new());
    model.visit(&mut v);
    v.1
}

//! The device mesh: the ranks of a tp x dp x pp run, and their groups, made once.

use burn_tp_comm::{LocalGroup, ProcessGroup};

use crate::{Result, TpError};

/// The ranks of a run as a `dp x tp` grid, with the sub-groups made once (collectively) at
/// construction, for the models (the tp group), the data-parallel reduction and optimizer (the dp
/// group) and the checkpoints.
///
/// Rank order, Megatron's default: the tensor-parallel ranks are adjacent (they exchange the most
/// data), so world rank `r` is tp rank `r % tp` of replica `r / tp`:
///
/// ```text
///  tp = 2, dp = 3      tp rank 0   tp rank 1
///  dp rank 0 (replica)  world 0     world 1      <- one tp group
///  dp rank 1            world 2     world 3
///  dp rank 2            world 4     world 5
///                       ^ one dp group (the ranks holding the same shard)
/// ```
///
/// With pipeline stages ([`with_pipeline`](Self::with_pipeline)) the stage is the slowest
/// axis (Megatron's `tp-dp-pp` order: the stages exchange the least, one activation per
/// micro-batch), so world rank `r` is tp rank `r % tp` of replica `(r / tp) % dp` of stage
/// `r / (tp dp)`:
///
/// ```text
///  tp = 2, dp = 2, pp = 2      stage 0                stage 1
///                          tp 0      tp 1          tp 0      tp 1
///  dp 0                   world 0   world 1       world 4   world 5
///  dp 1                   world 2   world 3       world 6   world 7
///  a pp group: world 1, 5 (the same tp rank of the same replica, one per stage)
/// ```
#[derive(Clone, Debug)]
pub struct DeviceMesh {
    world: ProcessGroup,
    tp: ProcessGroup,
    dp: ProcessGroup,
    pp: ProcessGroup,
    replica: ProcessGroup,
    tp_size: usize,
    pp_size: usize,
}

impl DeviceMesh {
    /// Splits `world` into tp groups of `tp` adjacent ranks and the dp groups across them.
    /// Collective over `world`. With `tp == world size` the world is the tp group and the dp
    /// group is a group of one (no communicator is made).
    ///
    /// # Errors
    /// [`TpError::Config`] when `tp` is 0 or does not divide the world size (naming both); a
    /// communication error.
    pub fn new(world: ProcessGroup, tp: usize) -> Result<Self> {
        Self::with_pipeline(world, tp, 1)
    }

    /// Splits `world` into `pp` pipeline stages of `world / pp` ranks each, each stage into tp
    /// groups of `tp` adjacent ranks and the dp groups across them, and the pp groups (one
    /// rank per stage) across the stages. Collective over `world`.
    ///
    /// # Errors
    /// [`TpError::Config`] when `tp` or `pp` is 0 or `tp * pp` does not divide the world size
    /// (naming them); a communication error.
    pub fn with_pipeline(world: ProcessGroup, tp: usize, pp: usize) -> Result<Self> {
        let n = world.world_size();
        if tp == 0 || pp == 0 || !n.is_multiple_of(tp * pp) {
            return Err(TpError::Config(format!(
                "DeviceMesh: tp {tp} x pp {pp} does not divide the world of {n} ranks"
            )));
        }
        let rank = world.rank();
        let stage = n / pp;
        let solo = || -> Result<ProcessGroup> { Ok(LocalGroup::new(1)?.remove(0)) };
        let dp = n / (tp * pp);
        let (tp_group, dp_group, pp_group) = if tp == n {
            (world.clone(), solo()?, solo()?)
        } else if pp == n {
            (solo()?, solo()?, world.clone())
        } else {
            let tp_group = world.split(rank / tp, rank)?;
            // The same tp rank of the same stage / of the same replica.
            let dp_group = world.split(rank / stage * tp + rank % tp, rank)?;
            let pp_group = world.split(rank % stage, rank)?;
            (tp_group, dp_group, pp_group)
        };
        // Every rank of this replica (all its stages): the tp group without stages, the world
        // with one replica.
        let replica = match (pp, dp) {
            (1, _) => tp_group.clone(),
            (_, 1) => world.clone(),
            _ => world.split(rank / tp % dp, rank)?,
        };
        Ok(Self {
            world,
            tp: tp_group,
            dp: dp_group,
            pp: pp_group,
            replica,
            tp_size: tp,
            pp_size: pp,
        })
    }

    /// Every rank of the run.
    pub fn world(&self) -> &ProcessGroup {
        &self.world
    }

    /// This rank's tensor-parallel group (what the models take).
    pub fn tp_group(&self) -> &ProcessGroup {
        &self.tp
    }

    /// This rank's data-parallel group: the ranks holding the same shard.
    pub fn dp_group(&self) -> &ProcessGroup {
        &self.dp
    }

    /// This rank's pipeline group: one rank per stage, its pp rank the stage
    /// ([`crate::pipeline::Pipeline::new`] takes it).
    pub fn pp_group(&self) -> &ProcessGroup {
        &self.pp
    }

    /// Every rank of this data-parallel replica, all its stages in stage order, tp ranks
    /// adjacent (a pipeline's checkpoint is written by them); the tp group without stages.
    pub fn replica_group(&self) -> &ProcessGroup {
        &self.replica
    }

    /// Pipeline stages.
    pub fn pp_size(&self) -> usize {
        self.pp_size
    }

    /// This rank's stage (`world rank / (tp dp)`).
    pub fn pp_rank(&self) -> usize {
        self.world.rank() / (self.world.world_size() / self.pp_size)
    }

    /// Tensor-parallel size.
    pub fn tp_size(&self) -> usize {
        self.tp_size
    }

    /// Data-parallel size.
    pub fn dp_size(&self) -> usize {
        self.world.world_size() / (self.tp_size * self.pp_size)
    }

    /// This rank's index in its tp group (`world rank % tp`).
    pub fn tp_rank(&self) -> usize {
        self.world.rank() % self.tp_size
    }

    /// The expert-parallel groups, carved out of the data-parallel ranks as Megatron does:
    /// `ep` consecutive dp ranks share the experts of a MoE layer ([`crate::moe`]), and the
    /// ranks holding the same experts (`dp / ep` of them, one per ep group) reduce their
    /// gradients together.
    ///
    /// ```text
    ///  dp ranks:   0   1   2   3        (dp 4, ep 2)
    ///  ep groups: [0   1] [2   3]       each holds every expert once: E / ep per rank
    ///  expert dp:  0 ----- 2            experts 0 .. E/2: their gradients summed here
    ///                  1 ----- 3        experts E/2 .. E
    /// ```
    ///
    /// Returns `(ep group, expert data-parallel group)`. Collective over the dp group.
    ///
    /// # Errors
    /// [`TpError::Config`] naming both when `ep` does not divide dp; a communication error.
    pub fn expert_groups(&self, ep: usize) -> Result<(ProcessGroup, ProcessGroup)> {
        let dp = self.dp_size();
        if ep == 0 || !dp.is_multiple_of(ep) {
            return Err(TpError::Config(format!(
                "DeviceMesh: ep {ep} does not divide dp {dp} (experts are split over data-parallel ranks)"
            )));
        }
        let d = self.dp.rank();
        let ep_group = self.dp.split(d / ep, d)?;
        let expert_dp = self.dp.split(dp + d % ep, d)?;
        Ok((ep_group, expert_dp))
    }

    /// The fully sharded data-parallel groups ([`crate::fsdp`]): each parameter split over
    /// `shard` consecutive dp ranks, replicated over the `dp / shard` ranks holding the same
    /// shard (HSDP; `shard` = dp: plain FSDP, no replicas).
    ///
    /// ```text
    ///  dp ranks:      0   1   2   3        (dp 4, shard 2)
    ///  shard groups: [0   1] [2   3]       each holds every parameter once: 1/2 per rank
    ///  replicas:      0 ----- 2            the same shard, gradients averaged over them
    ///                     1 ----- 3
    /// ```
    ///
    /// Returns `(shard group, replica group)`. Collective over the dp group.
    ///
    /// # Errors
    /// [`TpError::Config`] naming both when `shard` does not divide dp; a communication error.
    pub fn fsdp_groups(&self, shard: usize) -> Result<(ProcessGroup, ProcessGroup)> {
        let dp = self.dp_size();
        if shard == 0 || !dp.is_multiple_of(shard) {
            return Err(TpError::Config(format!(
                "DeviceMesh: the fsdp shard size {shard} does not divide dp {dp} (parameters are \
                 split over data-parallel ranks)"
            )));
        }
        let d = self.dp.rank();
        let shard_group = self.dp.split(d / shard, d)?;
        let replicas = self.dp.split(dp + d % shard, d)?;
        Ok((shard_group, replicas))
    }

    /// Fully sharded data parallelism with expert parallelism: the groups a mixture of
    /// experts' parameters are split and replicated over ([`crate::fsdp::Fsdp::with_experts`],
    /// [`with_expert_replicas`](crate::fsdp::Fsdp::with_expert_replicas)), torchtitan's
    /// layout: the experts' rows split over the ranks of one shard group
    /// ([`fsdp_groups`](Self::fsdp_groups)) holding the same experts
    /// ([`expert_groups`](Self::expert_groups)), replicated over the shard groups, as the
    /// dense parameters are over the HSDP replicas.
    ///
    /// ```text
    ///  dp ranks:         0   1   2   3   4   5   6   7     (dp 8, shard 4, ep 2)
    ///  shard groups:    [0   1   2   3] [4   5   6   7]    the dense rows: 1/4 per rank
    ///  ep groups:       [0   1] [2   3] [4   5] [6   7]    experts E/2 per rank
    ///  experts split:    {0, 2} {1, 3}   {4, 6} {5, 7}     the same experts in a shard group
    ///  experts' replicas:{0, 4} {2, 6}   {1, 5} {3, 7}     the same rows of them
    /// ```
    ///
    /// Without HSDP (`shard` = dp) the experts split over the expert data-parallel group and
    /// have no replicas (a group of one); with `shard` <= `ep` a shard group holds one rank of
    /// each set of experts, whose experts stay whole, replicated over the expert data-parallel
    /// group. Returns `(experts' shard group, experts' replicas)`. Collective over the dp
    /// group.
    ///
    /// # Errors
    /// [`TpError::Config`] naming the sizes when `shard` or `ep` does not divide dp, or neither
    /// of `shard`, `ep` divides the other (the shard groups would hold uneven parts of the
    /// experts); a communication error.
    pub fn fsdp_expert_groups(
        &self,
        shard: usize,
        ep: usize,
    ) -> Result<(ProcessGroup, ProcessGroup)> {
        let dp = self.dp_size();
        let divides = |a: usize| a > 0 && dp.is_multiple_of(a);
        if !divides(shard)
            || !divides(ep)
            || !(shard.is_multiple_of(ep) || ep.is_multiple_of(shard))
        {
            return Err(TpError::Config(format!(
                "DeviceMesh: the fsdp shard size {shard} and ep {ep} must each divide dp {dp} \
                 and one of them the other (each shard group holds the same part of the experts)"
            )));
        }
        let d = self.dp.rank();
        let group = self.dp.split((d / shard) * ep + d % ep, d)?;
        let replicas = self.dp.split(d % ep + ep * group.rank(), d)?;
        Ok((group, replicas))
    }

    /// The context-parallel group, carved out of the data-parallel ranks as Megatron's cp is:
    /// `cp` consecutive dp ranks split every sequence of one batch between them
    /// ([`crate::context`]), so the data-parallel gradient reduction over the dp group spans
    /// dp x cp, and `dp / cp` batches are drawn per step (replica `dp rank / cp`).
    ///
    /// ```text
    ///  dp ranks:   0   1   2   3        (dp 4, cp 2)
    ///  cp groups: [0   1] [2   3]       batch 0 split over dp ranks 0, 1; batch 1 over 2, 3
    ///  gradients:  mean over all 4 (each rank's loss the mean over its chunks' tokens)
    /// ```
    ///
    /// Collective over the dp group.
    ///
    /// # Errors
    /// [`TpError::Config`] naming both when `cp` does not divide dp; a communication error.
    pub fn context_group(&self, cp: usize) -> Result<ProcessGroup> {
        let dp = self.dp_size();
        if cp == 0 || !dp.is_multiple_of(cp) {
            return Err(TpError::Config(format!(
                "DeviceMesh: cp {cp} does not divide dp {dp} (sequences are split over \
                 data-parallel ranks)"
            )));
        }
        let d = self.dp.rank();
        Ok(self.dp.split(d / cp, d)?)
    }

    /// This rank's replica (`(world rank / tp) % dp`).
    pub fn dp_rank(&self) -> usize {
        self.world.rank() / self.tp_size % self.dp_size()
    }
}

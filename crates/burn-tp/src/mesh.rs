//! The device mesh: the ranks of a tp x dp run, and their groups, made once.

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
#[derive(Clone, Debug)]
pub struct DeviceMesh {
    world: ProcessGroup,
    tp: ProcessGroup,
    dp: ProcessGroup,
    tp_size: usize,
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
        let n = world.world_size();
        if tp == 0 || !n.is_multiple_of(tp) {
            return Err(TpError::Config(format!(
                "DeviceMesh: tp {tp} does not divide the world of {n} ranks"
            )));
        }
        let rank = world.rank();
        let (tp_group, dp_group) = if tp == n {
            (world.clone(), LocalGroup::new(1)?.remove(0))
        } else {
            (world.split(rank / tp, rank)?, world.split(rank % tp, rank)?)
        };
        Ok(Self {
            world,
            tp: tp_group,
            dp: dp_group,
            tp_size: tp,
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

    /// Tensor-parallel size.
    pub fn tp_size(&self) -> usize {
        self.tp_size
    }

    /// Data-parallel size.
    pub fn dp_size(&self) -> usize {
        self.world.world_size() / self.tp_size
    }

    /// This rank's index in its tp group (`world rank % tp`).
    pub fn tp_rank(&self) -> usize {
        self.world.rank() % self.tp_size
    }

    /// This rank's replica (`world rank / tp`).
    pub fn dp_rank(&self) -> usize {
        self.world.rank() / self.tp_size
    }
}

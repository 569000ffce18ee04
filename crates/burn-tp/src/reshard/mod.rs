//! Moving a module between tp sizes: gather the full (tp = 1) module on every rank, or shard one.
//! Each module implements [`Reshard`] in its own file.

use burn_tp_comm::{LocalGroup, ProcessGroup};

use crate::Result;

/// Moving a module between tp sizes: gather the full (tp = 1) module, or shard one.
pub trait Reshard: Sized {
    /// The same module at tp = 1 (on a group of its own), on every rank. Collective.
    ///
    /// # Errors
    /// A communication error.
    fn to_full_module(&self) -> Result<Self>;

    /// This rank's shard of a tp = 1 module.
    ///
    /// # Errors
    /// Sizes not divisible by the group's size.
    fn shard_module(full: &Self, group: &ProcessGroup) -> Result<Self>;
}

/// [`Reshard`] for a module made only of fields that implement it: each field moves on its own.
macro_rules! reshard_fields {
    ($ty:ident { $($field:ident),+ $(,)? }) => {
        impl $crate::reshard::Reshard for $ty {
            fn to_full_module(&self) -> $crate::Result<Self> {
                Ok(Self {
                    $($field: $crate::reshard::Reshard::to_full_module(&self.$field)?),+
                })
            }
            fn shard_module(
                full: &Self,
                group: &burn_tp_comm::ProcessGroup,
            ) -> $crate::Result<Self> {
                Ok(Self {
                    $($field: $crate::reshard::Reshard::shard_module(&full.$field, group)?),+
                })
            }
        }
    };
}
pub(crate) use reshard_fields;

/// A group of one: where a full (tp = 1) module lives.
pub(crate) fn solo() -> ProcessGroup {
    LocalGroup::new(1).expect("a group of one").remove(0)
}

mod optimizer;

pub use optimizer::FullOptimizerState;

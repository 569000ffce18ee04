//! Moving a module between tp sizes: gather the full (tp = 1) module on every rank, or shard one.
//! Each module implements [`Reshard`] in its own file.

use burn::module::Param;
use burn::tensor::Tensor;
use burn_tp_comm::{LocalGroup, ProcessGroup};

use crate::Result;
use crate::init::owned;

/// `#[derive(Reshard)]` for a struct of one's own: each field moves on its own
/// (`#[reshard(group)]` the struct's group, `#[reshard(keep)]` or `#[module(skip)]` a setting
/// copied as it is).
pub use burn_tp_derive::Reshard;

/// Moving a module between tp sizes: gather the full (tp = 1) module, or shard one.
///
/// `#[derive(Reshard)]` implements it for a struct whose fields implement it:
///
/// ```
/// use burn::module::Module;
/// use burn_tp::comm::ProcessGroup;
/// use burn_tp::linear::{ColumnParallelLinear, RowParallelLinear, TpMode};
/// use burn_tp::norm::TpLayerNorm;
/// use burn_tp::reshard::Reshard;
///
/// #[derive(Module, Debug, Reshard)]
/// struct Block {
///     norm: TpLayerNorm,
///     fc1: ColumnParallelLinear,
///     fc2: RowParallelLinear,
///     #[module(skip)]
///     mode: TpMode,
///     #[module(skip)]
///     #[reshard(group)]
///     group: ProcessGroup,
/// }
/// ```
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

    /// Where this rank's parameters lie in the full ones: one [`ParamLayout`] per float
    /// parameter, in the order Burn's `Module::visit` meets them. `rank` is this rank in the
    /// module's tensor-parallel group (for parameters that do not hold their group). Local: no
    /// communication.
    fn layout(&self, rank: usize) -> Vec<ParamLayout>;
}

/// Each module of a list moves on its own.
impl<T: Reshard> Reshard for Vec<T> {
    fn to_full_module(&self) -> Result<Self> {
        self.iter().map(Reshard::to_full_module).collect()
    }
    fn shard_module(full: &Self, group: &ProcessGroup) -> Result<Self> {
        full.iter().map(|m| T::shard_module(m, group)).collect()
    }
    fn layout(&self, rank: usize) -> Vec<ParamLayout> {
        self.iter().flat_map(|m| m.layout(rank)).collect()
    }
}

/// An optional module moves when it is there.
impl<T: Reshard> Reshard for Option<T> {
    fn to_full_module(&self) -> Result<Self> {
        self.as_ref().map(Reshard::to_full_module).transpose()
    }
    fn shard_module(full: &Self, group: &ProcessGroup) -> Result<Self> {
        full.as_ref().map(|m| T::shard_module(m, group)).transpose()
    }
    fn layout(&self, rank: usize) -> Vec<ParamLayout> {
        self.as_ref().map(|m| m.layout(rank)).unwrap_or_default()
    }
}

/// A bare parameter of a parallel module is replicated (the sharded ones live inside the
/// parallel layers, which implement [`Reshard`] themselves): every rank keeps its own copy.
impl<const D: usize> Reshard for Param<Tensor<D>> {
    fn to_full_module(&self) -> Result<Self> {
        Ok(Param::from_tensor(owned(self.val())))
    }
    fn shard_module(full: &Self, _group: &ProcessGroup) -> Result<Self> {
        Ok(Param::from_tensor(owned(full.val())))
    }
    fn layout(&self, rank: usize) -> Vec<ParamLayout> {
        vec![ParamLayout::replicated(self.val().dims().to_vec(), rank)]
    }
}

/// [`Reshard`] for a module made of fields that implement it: each field moves on its own.
/// With `group: g, keep: { a, b }`, the module's own group field `g` becomes a group of one
/// (full) or the target group (sharded), and the fields `a, b` (run-time options) are copied.
macro_rules! reshard_fields {
    ($ty:ident { $($field:ident),+ $(,)? }, group: $g:ident, keep: { $($kept:ident),* $(,)? }) => {
        impl $crate::reshard::Reshard for $ty {
            fn to_full_module(&self) -> $crate::Result<Self> {
                Ok($crate::reshard::keep_frozen(self, Self {
                    $($field: $crate::reshard::Reshard::to_full_module(&self.$field)?,)+
                    $g: $crate::reshard::solo(),
                    $($kept: self.$kept.clone(),)*
                }))
            }
            fn shard_module(
                full: &Self,
                group: &burn_tp_comm::ProcessGroup,
            ) -> $crate::Result<Self> {
                Ok($crate::reshard::keep_frozen(full, Self {
                    $($field: $crate::reshard::Reshard::shard_module(&full.$field, group)?,)+
                    $g: group.clone(),
                    $($kept: full.$kept.clone(),)*
                }))
            }
            fn layout(&self, _rank: usize) -> Vec<$crate::reshard::ParamLayout> {
                let rank = self.$g.rank();
                let mut out = Vec::new();
                $(out.extend($crate::reshard::Reshard::layout(&self.$field, rank));)+
                out
            }
        }
    };
    ($ty:ident { $($field:ident),+ $(,)? } $(, keep: { $($kept:ident),* $(,)? })?) => {
        impl $crate::reshard::Reshard for $ty {
            fn to_full_module(&self) -> $crate::Result<Self> {
                Ok($crate::reshard::keep_frozen(self, Self {
                    $($field: $crate::reshard::Reshard::to_full_module(&self.$field)?,)+
                    $($($kept: self.$kept.clone(),)*)?
                }))
            }
            fn shard_module(
                full: &Self,
                group: &burn_tp_comm::ProcessGroup,
            ) -> $crate::Result<Self> {
                Ok($crate::reshard::keep_frozen(full, Self {
                    $($field: $crate::reshard::Reshard::shard_module(&full.$field, group)?,)+
                    $($($kept: full.$kept.clone(),)*)?
                }))
            }
            fn layout(&self, rank: usize) -> Vec<$crate::reshard::ParamLayout> {
                let mut out = Vec::new();
                $(out.extend($crate::reshard::Reshard::layout(&self.$field, rank));)+
                out
            }
        }
    };
}
pub(crate) use reshard_fields;

/// `to` (a resharded `from`: the same parameters in the same order) with `from`'s frozen
/// parameters frozen too (a LoRA model's base, a pipeline stage's unused ends).
pub fn keep_frozen<M: burn::module::Module>(from: &M, to: M) -> M {
    use burn::module::{ModuleMapper, Param};
    use burn::tensor::Tensor;
    struct Set(Vec<bool>, usize);
    impl ModuleMapper for Set {
        fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let k = self.1;
            self.1 += 1;
            match self.0.get(k) {
                Some(false) if p.val().is_require_grad() => p.set_require_grad(false),
                _ => p,
            }
        }
    }
    let flags = trainable(from);
    if flags.iter().all(|&f| f) {
        return to;
    }
    to.map(&mut Set(flags, 0))
}

/// Whether each of a module's float parameters is trainable, in visiting order.
pub(crate) fn trainable<M: burn::module::Module>(module: &M) -> Vec<bool> {
    use burn::module::{ModuleVisitor, Param};
    use burn::tensor::Tensor;
    struct Flags(Vec<bool>);
    impl ModuleVisitor for Flags {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            self.0.push(p.val().is_require_grad());
        }
    }
    let mut flags = Flags(Vec::new());
    module.visit(&mut flags);
    flags.0
}

/// A group of one: where a full (tp = 1) module lives (what `#[derive(Reshard)]`'s
/// `#[reshard(group)]` field holds in a full module).
pub fn solo() -> ProcessGroup {
    LocalGroup::new(1).expect("a group of one").remove(0)
}

mod layout;
pub(crate) mod optimizer;
mod twin;

/// `#[derive(Twin)]`: [`Twin`] for a struct of one's own, field by field (`#[twin(F)]` names
/// the plain twin; `#[twin(mode)]` / `#[twin(default)]` on a setting field).
pub use burn_tp_derive::Twin;
pub use layout::{ParamLayout, Piece};
pub(crate) use optimizer::IndexedState;
pub use optimizer::{FullOptimizerState, move_optimizer_state};
pub use twin::{Twin, TwinContext};

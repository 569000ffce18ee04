//! Mixed precision: a module's parameters in another float dtype (bf16 compute copies of f32
//! master weights, as Megatron trains), and its gradients back to the master dtype.
//!
//! Every burn-tp layer, collective and loss keeps the dtype it is given (the sharded
//! cross-entropy computes in f32 for half-precision logits), so a model cast with
//! [`cast_params`] runs end to end in that dtype. Flex has one device whose default dtype is set
//! once per process, so casting the module is the way to run f32 and bf16 models side by side.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{DType, FloatDType, Tensor};

/// `module` with every float parameter in `dtype`: fresh leaves (detached), with the same
/// parameter ids and the same requires-grad, so gradients of the cast module apply to the
/// original (after [`cast_grads`]). Parameters already in `dtype` are kept as they are.
pub fn cast_params<M: Module>(module: M, dtype: FloatDType) -> M {
    struct Caster(FloatDType);
    impl ModuleMapper for Caster {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let dtype = self.0;
            param.map(|t| {
                // A QLoRA base stays packed: its use dequantizes it.
                if matches!(t.dtype(), DType::QFloat(_)) || FloatDType::from(t.dtype()) == dtype {
                    return t;
                }
                let requires_grad = t.is_require_grad();
                // Cast, then detach: a fresh leaf, which may require grad.
                let cast = t.cast(dtype).detach();
                if requires_grad {
                    cast.require_grad()
                } else {
                    cast
                }
            })
        }
    }
    module.map(&mut Caster(dtype))
}

/// Casts the gradients of `module`'s parameters in `grads` to `dtype` (for example bf16
/// gradients of a [`cast_params`] copy to the f32 master weights before the optimizer step).
pub fn cast_grads<M: Module>(module: &M, grads: &mut GradientsParams, dtype: FloatDType) {
    struct Caster<'a>(&'a mut GradientsParams, FloatDType);
    impl ModuleVisitor for Caster<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.0.remove::<D>(param.id) {
                self.0.register(param.id, g.cast(self.1));
            }
        }
    }
    module.visit(&mut Caster(grads, dtype));
}

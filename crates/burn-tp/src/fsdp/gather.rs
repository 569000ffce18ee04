//! The gathers: each parameter's dim-0 shards all-gathered over the shard group (one collective
//! per parameter, all of a part's posted before the first is waited on), the padding cut off.
//! The all-gather's backward is the reduce-scatter, so a tracked gather brings each rank its
//! shard's gradient summed over the group as soon as the parameter's gradient is complete.

use std::any::Any;
use std::collections::VecDeque;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{FloatDType, Tensor};

use super::Fsdp;
use crate::ops::{Pending, all_gather_async};
use crate::{Result, TpError};

/// A part's gathers in flight, in its parameters' visiting order.
pub(super) struct InFlight {
    pending: VecDeque<Box<dyn Any + Send>>,
}

impl Fsdp {
    /// Posts the all-gather of every sharded parameter of `part` (tracked when its parameters
    /// are).
    pub(super) fn start<X: Module>(&self, part: &X) -> Result<InFlight> {
        struct Start<'a> {
            fsdp: &'a Fsdp,
            pending: VecDeque<Box<dyn Any + Send>>,
            error: Option<TpError>,
        }
        impl ModuleVisitor for Start<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if self.error.is_some() || !self.fsdp.rows.contains_key(&param.id) {
                    return;
                }
                match all_gather_async(param.val(), 0, &self.fsdp.shard) {
                    Ok(p) => self.pending.push_back(Box::new(p)),
                    Err(e) => self.error = Some(e),
                }
            }
        }
        let mut start = Start {
            fsdp: self,
            pending: VecDeque::new(),
            error: None,
        };
        part.visit(&mut start);
        start.error.map_or(
            Ok(InFlight {
                pending: start.pending,
            }),
            Err,
        )
    }

    /// `part` with each sharded parameter replaced by its gathered whole (same id), in the
    /// compute dtype: waits for `flight` (from [`start`](Self::start) of the same `part`).
    pub(super) fn finish<X: Module>(&self, part: X, flight: InFlight) -> Result<X> {
        struct Finish<'a> {
            fsdp: &'a Fsdp,
            pending: VecDeque<Box<dyn Any + Send>>,
            error: Option<TpError>,
        }
        impl ModuleMapper for Finish<'_> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let Some(&rows) = self.fsdp.rows.get(&param.id) else {
                    return param;
                };
                let pending = self
                    .pending
                    .pop_front()
                    .expect("one gather per sharded parameter")
                    .downcast::<Pending<D>>()
                    .expect("the same parameter's rank");
                if self.error.is_some() {
                    // Waited on all the same: the other ranks' calls complete.
                    let _ = pending.wait();
                    return param;
                }
                let compute = self.fsdp.compute;
                match pending.wait() {
                    Ok(whole) => param.map(|_| {
                        let whole = whole.narrow(0, 0, rows);
                        match compute {
                            Some(dtype) if FloatDType::from(whole.dtype()) != dtype => {
                                whole.cast(dtype)
                            }
                            _ => whole,
                        }
                    }),
                    Err(e) => {
                        self.error = Some(e);
                        param
                    }
                }
            }
        }
        let mut finish = Finish {
            fsdp: self,
            pending: flight.pending,
            error: None,
        };
        let part = part.map(&mut finish);
        finish.error.map_or(Ok(part), Err)
    }
}

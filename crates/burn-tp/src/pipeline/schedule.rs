//! The schedules as data: a stage's forwards and backwards in order ([`actions`]), and how the
//! blocks are cut into stages ([`stage_layers`]) and, interleaved, into virtual stages
//! ([`virtual_stage_layers`]).

use std::ops::Range;

use crate::{Result, TpError};

/// The order in which a stage runs its micro-batches' forwards and backwards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PipelineSchedule {
    /// Every forward, then every backward (GPipe): simple, holds every micro-batch's
    /// activations.
    GPipe,
    /// One forward, one backward (Megatron's 1F1B): the same bubble, at most `stages`
    /// micro-batches' activations held.
    OneFOneB,
    /// Megatron's interleaved 1F1B: each rank holds `virtual_stages` runs of blocks (virtual
    /// stage `c * stages + rank` is its virtual stage `c`), so a micro-batch crosses every rank
    /// `virtual_stages` times and the bubble shrinks by that factor, at the cost of as many more
    /// transfers. The micro-batches must be a multiple of the stages.
    Interleaved {
        /// Chunks per rank.
        virtual_stages: usize,
    },
}

impl PipelineSchedule {
    /// Virtual stages per rank: `virtual_stages`, or 1.
    pub fn virtual_stages(self) -> usize {
        match self {
            Self::Interleaved { virtual_stages } => virtual_stages,
            _ => 1,
        }
    }
}

/// One step of a stage's schedule: a micro-batch's forward or backward through one of the
/// rank's virtual stages (always virtual stage 0 but with the interleaved schedule).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// The forward of micro-batch `micro` through its virtual stage `virtual_stage`.
    Forward {
        /// The rank's virtual stage.
        virtual_stage: usize,
        /// The micro-batch.
        micro: usize,
    },
    /// The backward of micro-batch `micro` through its virtual stage `virtual_stage`.
    Backward {
        /// The rank's virtual stage.
        virtual_stage: usize,
        /// The micro-batch.
        micro: usize,
    },
}

/// What stage `stage` of `stages` runs, in order, for `micro_batches` micro-batches.
pub fn actions(
    schedule: PipelineSchedule,
    stage: usize,
    stages: usize,
    micro_batches: usize,
) -> Vec<Action> {
    let (p, m, v) = (stages, micro_batches, schedule.virtual_stages());
    let total = m * v;
    // The k-th forward / backward: in groups of `p` micro-batches, each through the virtual stages in
    // turn (forward: virtual stage 0 first; backward: the last virtual stage first). Without virtual stages, micro k.
    let forward = |k: usize| Action::Forward {
        virtual_stage: k % (p * v) / p,
        micro: if v == 1 { k } else { k / (p * v) * p + k % p },
    };
    let backward = |k: usize| Action::Backward {
        virtual_stage: v - 1 - k % (p * v) / p,
        micro: if v == 1 { k } else { k / (p * v) * p + k % p },
    };
    let warmup = match schedule {
        PipelineSchedule::GPipe => total,
        PipelineSchedule::OneFOneB => (p - stage - 1).min(m),
        // Megatron's: all forwards first when the micro-batches just fill the pipe.
        PipelineSchedule::Interleaved { .. } if m == p => total,
        PipelineSchedule::Interleaved { .. } => ((p - stage - 1) * 2 + (v - 1) * p).min(total),
    };
    let mut out: Vec<Action> = (0..warmup).map(forward).collect();
    for i in 0..total - warmup {
        out.push(forward(warmup + i));
        out.push(backward(i));
    }
    out.extend((total - warmup..total).map(backward));
    out
}

/// The blocks of rank `stage`'s virtual stages (one range, but with the interleaved schedule: its
/// virtual stage `c` is virtual stage `c * stages + stage` of the blocks cut into `stages * virtual stages`).
///
/// # Errors
/// As [`stage_layers`] for `stages * virtual stages` stages.
pub fn virtual_stage_layers(
    n_layers: usize,
    stages: usize,
    schedule: PipelineSchedule,
    stage: usize,
) -> Result<Vec<Range<usize>>> {
    let v = schedule.virtual_stages();
    let all = stage_layers(n_layers, stages * v, None)?;
    Ok((0..v).map(|c| all[c * stages + stage].clone()).collect())
}

/// The blocks of each of `stages` stages: `counts[s]` blocks each when given (uneven cuts),
/// else as even as possible (the first stages one more).
///
/// # Errors
/// [`TpError::Config`] naming the values: no stage, more stages than blocks, counts that are not
/// one per stage, that do not add up to `n_layers` or leave a stage empty.
pub fn stage_layers(
    n_layers: usize,
    stages: usize,
    counts: Option<&[usize]>,
) -> Result<Vec<Range<usize>>> {
    if stages == 0 || stages > n_layers {
        return Err(TpError::Config(format!(
            "pipeline: {stages} stages for {n_layers} blocks (each stage needs one)"
        )));
    }
    let counts: Vec<usize> = match counts {
        Some(c) => {
            if c.len() != stages || c.iter().sum::<usize>() != n_layers || c.contains(&0) {
                return Err(TpError::Config(format!(
                    "pipeline: blocks per stage {c:?} must be {stages} positive counts adding \
                     up to {n_layers}"
                )));
            }
            c.to_vec()
        }
        None => (0..stages)
            .map(|s| n_layers / stages + usize::from(s < n_layers % stages))
            .collect(),
    };
    let mut start = 0;
    Ok(counts
        .into_iter()
        .map(|n| {
            start += n;
            start - n..start
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(micro: usize) -> Action {
        Action::Forward {
            virtual_stage: 0,
            micro,
        }
    }
    fn b(micro: usize) -> Action {
        Action::Backward {
            virtual_stage: 0,
            micro,
        }
    }

    #[test]
    fn one_f_one_b_warms_up_then_alternates_and_runs_every_micro_batch_once() {
        assert_eq!(
            actions(PipelineSchedule::OneFOneB, 1, 4, 4),
            [f(0), f(1), f(2), b(0), f(3), b(1), b(2), b(3)]
        );
        assert_eq!(
            actions(PipelineSchedule::OneFOneB, 3, 4, 4),
            [f(0), b(0), f(1), b(1), f(2), b(2), f(3), b(3)]
        );
        // Fewer micro-batches than stages: the warm-up is all of them.
        assert_eq!(
            actions(PipelineSchedule::OneFOneB, 0, 4, 2),
            [f(0), f(1), b(0), b(1)]
        );
        let interleaved = PipelineSchedule::Interleaved { virtual_stages: 2 };
        for schedule in [
            PipelineSchedule::GPipe,
            PipelineSchedule::OneFOneB,
            interleaved,
        ] {
            let v = schedule.virtual_stages();
            for stage in 0..4 {
                let a = actions(schedule, stage, 4, 8);
                for c in 0..v {
                    for micro in 0..8 {
                        let fw = a.iter().position(|x| {
                            *x == Action::Forward {
                                virtual_stage: c,
                                micro,
                            }
                        });
                        let bw = a.iter().position(|x| {
                            *x == Action::Backward {
                                virtual_stage: c,
                                micro,
                            }
                        });
                        assert!(
                            fw.unwrap() < bw.unwrap(),
                            "{schedule:?} stage {stage}: {c} {micro}"
                        );
                    }
                }
                assert_eq!(a.len(), 16 * v);
            }
        }
    }

    #[test]
    fn the_interleaved_schedule_is_megatrons() {
        use Action::{Backward as B, Forward as F};
        // 2 stages, 2 virtual stages, 4 micro-batches, stage 0: a warm-up of (2 - 0 - 1) * 2 + (2 - 1)
        // * 2 = 4 forwards (micro-batches in groups of 2, each group through virtual stage 0 then 1),
        // then one forward one backward (the backwards from the last virtual stage).
        let a = actions(PipelineSchedule::Interleaved { virtual_stages: 2 }, 0, 2, 4);
        assert_eq!(
            a,
            [
                F {
                    virtual_stage: 0,
                    micro: 0
                },
                F {
                    virtual_stage: 0,
                    micro: 1
                },
                F {
                    virtual_stage: 1,
                    micro: 0
                },
                F {
                    virtual_stage: 1,
                    micro: 1
                },
                F {
                    virtual_stage: 0,
                    micro: 2
                },
                B {
                    virtual_stage: 1,
                    micro: 0
                },
                F {
                    virtual_stage: 0,
                    micro: 3
                },
                B {
                    virtual_stage: 1,
                    micro: 1
                },
                F {
                    virtual_stage: 1,
                    micro: 2
                },
                B {
                    virtual_stage: 0,
                    micro: 0
                },
                F {
                    virtual_stage: 1,
                    micro: 3
                },
                B {
                    virtual_stage: 0,
                    micro: 1
                },
                B {
                    virtual_stage: 1,
                    micro: 2
                },
                B {
                    virtual_stage: 1,
                    micro: 3
                },
                B {
                    virtual_stage: 0,
                    micro: 2
                },
                B {
                    virtual_stage: 0,
                    micro: 3
                },
            ]
        );
        // The virtual stages of a stage: virtual stages c * stages + stage.
        let ranges =
            virtual_stage_layers(8, 2, PipelineSchedule::Interleaved { virtual_stages: 2 }, 1);
        assert_eq!(ranges.unwrap(), [2..4, 6..8]);
    }

    #[test]
    fn stages_are_cut_evenly_or_as_asked() {
        assert_eq!(
            stage_layers(10, 4, None).unwrap(),
            [0..3, 3..6, 6..8, 8..10]
        );
        assert_eq!(stage_layers(4, 2, Some(&[1, 3])).unwrap(), [0..1, 1..4]);
        let e = stage_layers(4, 2, Some(&[2, 3])).unwrap_err().to_string();
        assert!(e.contains("[2, 3]") && e.contains('4'), "{e}");
        assert!(stage_layers(2, 3, None).is_err());
    }
}

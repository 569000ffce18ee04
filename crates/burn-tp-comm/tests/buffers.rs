//! Collectives on caller buffers (inputs read in place, outputs written into the caller's), the
//! all-reduce's bits, and the communication profile.

mod common;

use std::time::Duration;

use burn_tp_comm::{CommError, LocalGroupOptions, ReduceOp};
use common::{run, run_ok};

/// Storage another owner keeps alive (a tensor's, a pool's), read and written in place.
struct Borrowed(std::sync::Arc<Vec<f32>>);

impl burn_tp_comm::SendBuf<f32> for Borrowed {
    fn as_slice(&self) -> &[f32] {
        &self.0
    }
}

struct Into(Box<[f32]>);

impl burn_tp_comm::RecvBuf<f32> for Into {
    fn as_mut_slice(&mut self) -> &mut [f32] {
        &mut self.0
    }
    fn as_slice(&self) -> &[f32] {
        &self.0
    }
}

#[test]
fn in_place_collectives_match_references_at_any_length_and_all_reduce_is_bit_identical() {
    for world in 1..=4 {
        // Lengths the world does not divide, and shorter than the world (empty chunks).
        for len in [1usize, 2, 5, 7, 12, 1001] {
            let inputs: Vec<Vec<f32>> = (0..world)
                .map(|r| {
                    (0..len)
                        .map(|i| ((r * 31 + i * 7) % 13) as f32 * 0.1 - 0.6)
                        .collect()
                })
                .collect();
            // The sum in rank order, in f32, as a plain loop (not the transport's `combine`).
            let want_sum: Vec<f32> = (0..len)
                .map(|i| inputs[1..].iter().fold(inputs[0][i], |acc, x| acc + x[i]))
                .collect();
            let want_gather = inputs.concat();
            let ins = inputs.clone();
            let out = run_ok(world, move |pg| {
                let mine = std::sync::Arc::new(ins[pg.rank()].clone());
                let n = pg.world_size();
                let ar = pg
                    .all_reduce_async(
                        Borrowed(mine.clone()),
                        ReduceOp::Sum,
                        Into(vec![f32::NAN; len].into()),
                    )
                    .unwrap()
                    .wait()
                    .unwrap();
                let ag = pg
                    .all_gather_async(Borrowed(mine.clone()), Into(vec![f32::NAN; len * n].into()))
                    .unwrap()
                    .wait()
                    .unwrap();
                // The input is untouched and still shared with the caller.
                assert_eq!(*mine, ins[pg.rank()]);
                let wrong = pg.all_gather_async(Borrowed(mine), Into(vec![0.0; len].into()));
                let wrong_ok = n == 1;
                assert_eq!(wrong.is_ok(), wrong_ok);
                (ar.0.to_vec(), ag.0.to_vec())
            });
            for (ar, ag) in out {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&ar), bits(&want_sum), "world {world} len {len}");
                assert_eq!(bits(&ag), bits(&want_gather), "world {world} len {len}");
            }
        }
    }
    // Reduce-scatter into a caller buffer; a wrong length is an error before communicating.
    let out = run_ok(2, |pg| {
        let x = vec![pg.rank() as f32 + 1.0; 4];
        let e = pg.reduce_scatter_async(x.clone(), Into(vec![0.0; 3].into()));
        assert!(
            matches!(
                e,
                Err(CommError::BufferSize {
                    expected: 2,
                    got: 3,
                    ..
                })
            ),
            "{e:?}"
        );
        pg.reduce_scatter_async(x, Into(vec![0.0; 2].into()))
            .unwrap()
            .wait()
            .unwrap()
            .0
            .to_vec()
    });
    assert_eq!(out, vec![vec![3.0, 3.0], vec![3.0, 3.0]]);
}

/// The profile counts calls and bytes per label and op, and tells hidden communication (compute
/// between the start and the wait, over a simulated link) from waited communication.
#[test]
fn the_profile_counts_calls_bytes_and_the_hidden_fraction() {
    use burn_tp_comm::{LinkModel, profile::scope};
    let options = LocalGroupOptions {
        // 1 MiB per delivery takes ~20 ms.
        link: Some(LinkModel::new(0.05, 10.0)),
        profile: true,
        ..Default::default()
    };
    let out = run(2, options, |pg| {
        let x = vec![1.0f32; 1 << 18]; // 1 MiB
        {
            let _s = scope("hidden");
            let w = pg.all_gather_async(x.clone(), vec![0.0; 2 << 18]).unwrap();
            std::thread::sleep(Duration::from_millis(150)); // "compute" longer than the transfer
            w.wait().unwrap();
        }
        {
            let _s = scope("waited");
            pg.all_gather(x.clone()).unwrap();
        }
        pg.all_gather(x).unwrap(); // no scope: "direct"
        pg.profile().unwrap()
    });
    for profile in out {
        let profile = profile.unwrap();
        let row = |label: &str| {
            profile
                .rows
                .iter()
                .find(|r| r.label == label)
                .unwrap_or_else(|| panic!("{label} in {profile}"))
                .clone()
        };
        let (hidden, waited) = (row("hidden"), row("waited"));
        assert_eq!(row("direct").calls, 1);
        assert_eq!((hidden.calls, hidden.bytes), (1, 1 << 20), "{profile}");
        assert_eq!(hidden.op, "AllGather");
        // Side by side, not against fixed fractions (a loaded machine shifts both): the
        // collective with compute between its start and its wait shows more of its time hidden
        // than the one waited at once; the link's sleep bounds the waited time from below.
        assert!(hidden.hidden() > waited.hidden(), "{profile}");
        assert!(waited.comm >= Duration::from_millis(15), "{profile}");
        assert!(
            profile.to_csv().lines().count() == 4,
            "{}",
            profile.to_csv()
        );
    }
    // Off by default: no profile.
    let off = run_ok(1, |pg| pg.profile().is_none());
    assert!(off[0]);
}

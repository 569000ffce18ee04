//! Misuse of the parallel linears: typed errors naming the sizes.

use super::*;

#[test]
fn size_errors_are_typed_errors_naming_the_sizes() {
    let _rng = rng_lock();
    let groups = LocalGroup::new(3).unwrap();
    let g: &ProcessGroup = &groups[0];
    let dev = device();
    // Errors before communication: a single rank gets them without the others.
    let e = ColumnParallelLinearConfig::new(4, 8)
        .init(g, &dev)
        .unwrap_err();
    assert_eq!(
        e,
        TpError::NotDivisible {
            what: "ColumnParallelLinear d_output".into(),
            size: 8,
            tp: 3
        }
    );
    assert!(e.to_string().contains('8') && e.to_string().contains('3'));
    let e = RowParallelLinearConfig::new(10, 6)
        .init(g, &dev)
        .unwrap_err();
    assert_eq!(
        e,
        TpError::NotDivisible {
            what: "RowParallelLinear d_input".into(),
            size: 10,
            tp: 3
        }
    );
    let e = ColumnParallelLinearConfig::new(4, 6)
        .with_settings(TpSettings::new().with_mode(TpMode::ReduceScatter))
        .with_gather_output(true)
        .init(g, &dev);
    assert!(matches!(e, Err(TpError::Config(_))));
    // Errors at the call (tp = 1 group to build layers without peers, then checked shapes).
    let solo = LocalGroup::new(1).unwrap().remove(0);
    let col = ColumnParallelLinearConfig::new(4, 6)
        .init(&solo, &dev)
        .unwrap();
    let e = col
        .try_forward(tensor(vec![0.0; 10], [2, 5], DType::F32))
        .unwrap_err();
    assert!(
        matches!(&e, TpError::Shape { got, .. } if got == &vec![2, 5]),
        "{e}"
    );
    // `forward` (Burn's convention) panics on the caller's thread with the same message.
    let panic = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        col.forward(tensor(vec![0.0; 10], [2, 5], DType::F32))
    }))
    .unwrap_err();
    assert_eq!(panic.downcast_ref::<String>(), Some(&e.to_string()));
    assert!(
        e.to_string().contains("[2, 5]") && e.to_string().contains("[.., 4]"),
        "{e}"
    );
    let row = RowParallelLinear::from_full(
        &int_linear(1),
        g,
        &RowParallelLinearConfig::new(D_IN, D_OUT)
            .with_settings(TpSettings::new().with_mode(TpMode::ReduceScatter)),
    )
    .unwrap();
    let e = row
        .try_forward(tensor(vec![0.0; 5 * 4], [5, 4], DType::F32))
        .unwrap_err();
    assert_eq!(
        e,
        TpError::NotDivisible {
            what: "RowParallelLinear: dim 0 (sequence) of the input".into(),
            size: 5,
            tp: 3
        }
    );
    let e = row
        .try_forward(tensor(vec![0.0; 6 * 5], [6, 5], DType::F32))
        .unwrap_err();
    assert!(
        matches!(&e, TpError::Shape { expected, .. } if expected.contains('4')),
        "{e}"
    );
}

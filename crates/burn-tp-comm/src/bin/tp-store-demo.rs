//! A rank program for testing `burn-tp-launch` and the rendezvous store: meets at the store,
//! exchanges one value per rank, prints the sum, exits. With `FAIL_RANK=r`, rank `r` exits with
//! code 3 after the rendezvous (and the others wait for a value that never comes).

use std::time::Duration;

use burn_tp_comm::store::LaunchEnv;

fn main() {
    let env = match LaunchEnv::from_env() {
        Ok(env) => env,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let timeout = Duration::from_secs(
        std::env::var("STORE_TIMEOUT_S")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(20),
    );
    let (_server, store) = match env.rendezvous(timeout) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(4);
        }
    };
    if std::env::var("FAIL_RANK")
        .ok()
        .and_then(|s| s.parse::<usize>().ok())
        == Some(env.rank)
    {
        eprintln!("failing on purpose");
        std::process::exit(3);
    }
    store
        .set(
            &format!("value/{}", env.rank),
            &((env.rank as u64 + 1) * 10).to_le_bytes(),
        )
        .unwrap();
    let mut sum = 0;
    for r in 0..env.world_size {
        match store.get(&format!("value/{r}")) {
            Ok(v) => sum += u64::from_le_bytes(v[..8].try_into().unwrap()),
            Err(e) => {
                eprintln!("{e}");
                std::process::exit(5);
            }
        }
    }
    // Rank 0 hosts the store: it leaves last.
    store.barrier("done", env.world_size).unwrap();
    println!("rank {} of {}: sum {sum}", env.rank, env.world_size);
}

//! The rendezvous store over loopback, and the launcher with several processes.

use std::process::Command;
use std::time::{Duration, Instant};

use burn_tp_comm::store::{LaunchEnv, StoreClient, StoreServer};

#[test]
fn ranks_meet_and_exchange_values_through_the_store() {
    let server = StoreServer::start("127.0.0.1:0").unwrap();
    let addr = server.addr().to_string();
    let handles: Vec<_> = (0..4)
        .map(|rank| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let store = StoreClient::connect(&addr, rank, Duration::from_secs(10)).unwrap();
                store
                    .set(&format!("id/{rank}"), format!("rank-{rank}").as_bytes())
                    .unwrap();
                store.barrier("b", 4).unwrap();
                (0..4)
                    .map(|r| String::from_utf8(store.get(&format!("id/{r}")).unwrap()).unwrap())
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for h in handles {
        assert_eq!(
            h.join().unwrap(),
            vec!["rank-0", "rank-1", "rank-2", "rank-3"]
        );
    }
}

#[test]
fn a_rank_that_never_comes_is_a_timeout_naming_it() {
    let server = StoreServer::start("127.0.0.1:0").unwrap();
    let addr = server.addr().to_string();
    let start = Instant::now();
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let store = StoreClient::connect(&addr, rank, Duration::from_millis(300)).unwrap();
                store.barrier("b", 3).unwrap_err().to_string()
            })
        })
        .collect();
    for h in handles {
        let msg = h.join().unwrap();
        assert!(
            msg.contains("rank(s) [2] did not arrive") && msg.contains(&addr),
            "{msg}"
        );
    }
    assert!(start.elapsed() < Duration::from_secs(5));
    // Nobody listening: the connect error names the address and the rank.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let e = StoreClient::connect(&dead, 7, Duration::from_millis(200))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains(&dead) && e.contains("rank 7"), "{e}");
}

fn launch(extra_env: &[(&str, &str)]) -> std::process::Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_burn-tp-launch"));
    // The rank program is this test binary, running only `rank_program` (see there).
    let me = std::env::current_exe().unwrap();
    cmd.args(["--nproc", "3", "--"])
        .arg(me)
        .args([
            "--exact",
            "rank_program",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(RANK_PROGRAM, "1");
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

#[test]
fn the_launcher_runs_a_three_process_job_that_meets_at_the_store() {
    let out = launch(&[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for r in 0..3 {
        assert!(
            stdout.contains(&format!("[rank {r}] rank {r} of 3: sum 60")),
            "{stdout}"
        );
    }
}

#[test]
fn the_launcher_stops_the_others_when_a_rank_fails_and_exits_with_its_code() {
    let start = Instant::now();
    // The survivors would wait 30 s for the failed rank's value; the launcher kills them.
    let out = launch(&[("FAIL_RANK", "1"), ("STORE_TIMEOUT_S", "30")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("[rank 1] failing on purpose"), "{stderr}");
    assert!(
        stderr.contains("rank 1 failed with exit code 3"),
        "{stderr}"
    );
    assert!(start.elapsed() < Duration::from_secs(20));
}

const RANK_PROGRAM: &str = "BURN_TP_TEST_RANK_PROGRAM";

/// The rank program the launcher tests start (a no-op in a normal test run): meets at the store,
/// exchanges one value per rank, prints the sum, exits. With `FAIL_RANK=r`, rank `r` exits with
/// code 3 after the rendezvous (and the others wait for a value that never comes).
#[test]
fn rank_program() {
    if std::env::var_os(RANK_PROGRAM).is_none() {
        return;
    }
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
    // On a line of its own, after the test harness's "test rank_program ... ".
    println!("\nrank {} of {}: sum {sum}", env.rank, env.world_size);
    std::process::exit(0);
}

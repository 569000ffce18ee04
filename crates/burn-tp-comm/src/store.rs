//! A small TCP key-value store for rendezvous across processes, like torchrun's `TCPStore`.
//!
//! Rank 0 hosts it at `MASTER_ADDR:MASTER_PORT`; every rank (rank 0 included) is a client. It
//! carries only small control values (ids, barrier marks, error words), never tensors.
//!
//! Wire format, one request per frame: `op: u8`, `key_len: u32 LE`, key, `val_len: u32 LE`,
//! value; the reply is `status: u8` (0 ok, 1 timed out, 2 refused), `len: u32 LE`, value (the
//! reason, when refused). Each frame goes out in one write, on sockets without Nagle's delay at
//! both ends (a set + get is a few round trips of microseconds, not 40 ms of delayed ACKs).
//! A SET is answered before its value becomes visible to other clients, so a client's last SET
//! can be the signal that it is done with the store: once the host sees it, the reply is sent,
//! and the host may exit without cutting the client off.
//!
//! Written for a port others on the network may reach:
//! - the first frame of a connection must be `HELLO` with the launch's shared secret
//!   (`BURN_TP_STORE_TOKEN`, which `burn-tp-launch` makes for each launch): a stranger cannot
//!   read or overwrite keys; a wrong token is refused and the connection closed;
//! - a connection that has not said hello within 2 s is closed, and at most 512 are served at
//!   once (more are closed on accept), each on a thread with a small stack;
//! - values are at most 1 MiB, keys 4 KiB, one connection may store 16 MiB and the whole store
//!   64 MiB; a GET waits at most a day; frames that are not requests close the connection.
//!
//! These limits are fixed (not settings): they bound what a stranger can cost the host.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::{CommError, Result};

const SET: u8 = 1;
const GET: u8 = 2;
const HELLO: u8 = 3;

const OK: u8 = 0;
const TIMED_OUT: u8 = 1;
const REFUSED: u8 = 2;

const MAX_VALUE: usize = 1 << 20;
const MAX_KEY: usize = 4 << 10;
/// Connections served at once; more are closed as they are accepted.
const MAX_CONNECTIONS: usize = 512;
/// How long a new connection has to present the token.
const HELLO_TIMEOUT: Duration = Duration::from_secs(2);
/// Bytes (keys and values) one connection may store.
const CONNECTION_QUOTA: usize = 16 << 20;
/// Bytes (keys and values) the whole store holds.
const STORE_QUOTA: usize = 64 << 20;
/// The longest a GET waits.
const MAX_WAIT: Duration = Duration::from_secs(24 * 3600);

/// Store errors become [`CommError::Backend`] naming the rank and the address.
fn err(rank: usize, addr: &str, what: impl std::fmt::Display) -> CommError {
    CommError::Backend(format!("rendezvous store at {addr} (rank {rank}): {what}"))
}

#[derive(Default)]
struct Table {
    map: Mutex<HashMap<String, Vec<u8>>>,
    cv: Condvar,
    /// Bytes of keys and values held.
    bytes: AtomicUsize,
    connections: AtomicUsize,
}

/// The server side: a listener thread and one thread per client connection.
pub struct StoreServer {
    addr: SocketAddr,
}

impl StoreServer {
    /// Binds `addr` and serves, until the process exits, the clients that present `token`
    /// (`""` for none: then anyone who reaches the port can use it).
    ///
    /// # Errors
    /// The address cannot be bound.
    pub fn start(addr: impl ToSocketAddrs, token: &str) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let table = Arc::new(Table::default());
        let token: Arc<[u8]> = token.as_bytes().into();
        std::thread::Builder::new()
            .name("tp-store".into())
            .spawn(move || {
                for stream in listener.incoming().flatten() {
                    if table.connections.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
                        table.connections.fetch_sub(1, Ordering::SeqCst);
                        continue; // dropped: closed
                    }
                    let (table, token) = (table.clone(), token.clone());
                    let spawned = std::thread::Builder::new()
                        .name("tp-store-conn".into())
                        .stack_size(64 << 10)
                        .spawn({
                            let table = table.clone();
                            move || {
                                serve(stream, &table, &token);
                                table.connections.fetch_sub(1, Ordering::SeqCst);
                            }
                        });
                    if spawned.is_err() {
                        table.connections.fetch_sub(1, Ordering::SeqCst);
                    }
                }
            })?;
        Ok(Self { addr })
    }

    /// The bound address (useful with port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

fn read_frame(s: &mut TcpStream) -> std::io::Result<(u8, String, Vec<u8>)> {
    let mut op = [0u8; 1];
    s.read_exact(&mut op)?;
    let key = read_bytes(s, MAX_KEY)?;
    let val = read_bytes(s, MAX_VALUE)?;
    Ok((op[0], String::from_utf8_lossy(&key).into_owned(), val))
}

fn read_bytes(s: &mut TcpStream, max: usize) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a store frame of {len} bytes (at most {max})"),
        ));
    }
    let mut buf = vec![0; len];
    s.read_exact(&mut buf)?;
    Ok(buf)
}

/// One frame: `head` then each part length-prefixed, in one buffer (one write).
fn frame(head: u8, parts: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + parts.iter().map(|p| 4 + p.len()).sum::<usize>());
    out.push(head);
    for p in parts {
        out.extend_from_slice(&(p.len() as u32).to_le_bytes());
        out.extend_from_slice(p);
    }
    out
}

/// Equal without an early exit, so the time taken does not tell how much of a guess was right.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

fn serve(mut s: TcpStream, table: &Table, token: &[u8]) {
    let _ = s.set_nodelay(true);
    // The hello first, within its deadline; then requests without one (a GET may wait long).
    let _ = s.set_read_timeout(Some(HELLO_TIMEOUT));
    match read_frame(&mut s) {
        Ok((HELLO, _, given)) if same_secret(&given, token) => {
            if s.write_all(&frame(OK, &[&[]])).is_err() {
                return;
            }
        }
        Ok((HELLO, _, _)) => {
            let _ = s.write_all(&frame(REFUSED, &[b"wrong token"]));
            return;
        }
        _ => return,
    }
    let _ = s.set_read_timeout(None);
    let mut stored = 0usize;
    while let Ok((op, key, val)) = read_frame(&mut s) {
        let (status, reply) = match op {
            SET => match admit(table, stored, &key, &val) {
                // The reply goes out before the value is visible to anyone: whoever sees the key
                // knows its writer has its answer, so a host that leaves once it has seen every
                // client's last key cannot cut a client off before its reply.
                Ok(()) => {
                    if s.write_all(&frame(OK, &[&[]])).is_err() {
                        return;
                    }
                    stored += key.len() + val.len();
                    publish(table, key, val);
                    continue;
                }
                Err(why) => (REFUSED, why.into_bytes()),
            },
            GET => {
                // The value of a GET is the timeout in milliseconds.
                let ms = u64::from_le_bytes(
                    val.get(..8)
                        .and_then(|b| b.try_into().ok())
                        .unwrap_or([0; 8]),
                );
                let deadline = Instant::now() + Duration::from_millis(ms).min(MAX_WAIT);
                let mut map = table.map.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    if let Some(v) = map.get(&key) {
                        break (OK, v.clone());
                    }
                    let now = Instant::now();
                    if now >= deadline {
                        break (TIMED_OUT, Vec::new());
                    }
                    map = table
                        .cv
                        .wait_timeout(map, deadline - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            }
            _ => return,
        };
        if s.write_all(&frame(status, &[&reply])).is_err() {
            return;
        }
    }
}

/// Whether a SET of `key` fits the quotas: this connection's `stored` bytes and the store's
/// (checked when the request arrives).
fn admit(table: &Table, stored: usize, key: &str, val: &[u8]) -> std::result::Result<(), String> {
    let size = key.len() + val.len();
    if stored + size > CONNECTION_QUOTA {
        return Err(format!(
            "this connection's quota of {CONNECTION_QUOTA} bytes is used up"
        ));
    }
    let map = table.map.lock().unwrap_or_else(|e| e.into_inner());
    let old = map.get(key).map_or(0, |v| key.len() + v.len());
    if table.bytes.load(Ordering::SeqCst) - old + size > STORE_QUOTA {
        return Err(format!(
            "the store's quota of {STORE_QUOTA} bytes is used up"
        ));
    }
    Ok(())
}

/// Makes an admitted SET visible and wakes the GETs waiting for it.
fn publish(table: &Table, key: String, val: Vec<u8>) {
    let mut map = table.map.lock().unwrap_or_else(|e| e.into_inner());
    let old = map.get(&key).map_or(0, |v| key.len() + v.len());
    let size = key.len() + val.len();
    table.bytes.fetch_add(size, Ordering::SeqCst);
    table.bytes.fetch_sub(old, Ordering::SeqCst);
    map.insert(key, val);
    table.cv.notify_all();
}

fn read_reply(s: &mut TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
    let mut status = [0u8; 1];
    s.read_exact(&mut status)?;
    Ok((status[0], read_bytes(s, MAX_VALUE)?))
}

/// A client of the store, owned by one rank.
pub struct StoreClient {
    stream: Mutex<TcpStream>,
    addr: String,
    rank: usize,
    timeout: Duration,
}

impl StoreClient {
    /// Connects to `addr` and presents `token` (the server's; `""` for none), retrying until
    /// `timeout` (the host may not be up yet, or busy with its most connections).
    ///
    /// # Errors
    /// No connection within `timeout`, or a wrong token, naming the rank and the address.
    pub fn connect(addr: &str, rank: usize, token: &str, timeout: Duration) -> Result<Self> {
        let deadline = Instant::now() + timeout;
        loop {
            let attempt = TcpStream::connect(addr).and_then(|mut stream| {
                stream.set_nodelay(true)?;
                stream.write_all(&frame(HELLO, &[&[], token.as_bytes()]))?;
                let (status, why) = read_reply(&mut stream)?;
                Ok((stream, status, why))
            });
            match attempt {
                Ok((stream, OK, _)) => {
                    return Ok(Self {
                        stream: Mutex::new(stream),
                        addr: addr.to_string(),
                        rank,
                        timeout,
                    });
                }
                Ok((_, _, why)) => {
                    return Err(err(
                        rank,
                        addr,
                        format!(
                            "refused: {} (BURN_TP_STORE_TOKEN must be the launch's)",
                            String::from_utf8_lossy(&why)
                        ),
                    ));
                }
                Err(e) if Instant::now() >= deadline => {
                    return Err(err(
                        rank,
                        addr,
                        format!("could not connect within {timeout:?}: {e}"),
                    ));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }

    fn request(&self, op: u8, key: &str, val: &[u8]) -> Result<Option<Vec<u8>>> {
        let mut s = self.stream.lock().unwrap_or_else(|e| e.into_inner());
        let io = |e: std::io::Error| err(self.rank, &self.addr, e);
        s.write_all(&frame(op, &[key.as_bytes(), val]))
            .map_err(io)?;
        let (status, v) = read_reply(&mut s).map_err(io)?;
        match status {
            OK => Ok(Some(v)),
            TIMED_OUT => Ok(None),
            _ => Err(err(
                self.rank,
                &self.addr,
                format!("refused {key:?}: {}", String::from_utf8_lossy(&v)),
            )),
        }
    }

    /// Sets `key` to `value`.
    ///
    /// # Errors
    /// A connection error, or a value over the quotas (see the module).
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.request(SET, key, value).map(|_| ())
    }

    /// Waits (at most the client's timeout) for `key` and returns its value.
    ///
    /// # Errors
    /// A timeout naming the key, rank and address; a connection error.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        let ms = self.timeout.as_millis() as u64;
        self.request(GET, key, &ms.to_le_bytes())?.ok_or_else(|| {
            err(
                self.rank,
                &self.addr,
                format!("key {key:?} not set within {:?}", self.timeout),
            )
        })
    }

    /// Blocks until all `world_size` ranks reached barrier `name`.
    ///
    /// # Errors
    /// A timeout naming the ranks that had not arrived.
    pub fn barrier(&self, name: &str, world_size: usize) -> Result<()> {
        self.set(&format!("barrier/{name}/{}", self.rank), &[1])?;
        let mut missing = Vec::new();
        for r in 0..world_size {
            if self.get(&format!("barrier/{name}/{r}")).is_err() {
                missing.push(r);
            }
        }
        if missing.is_empty() {
            Ok(())
        } else {
            Err(err(
                self.rank,
                &self.addr,
                format!("barrier {name:?}: rank(s) {missing:?} did not arrive"),
            ))
        }
    }
}

/// The launch environment of one process, torchrun's contract: `RANK`, `WORLD_SIZE`,
/// `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`; and `BURN_TP_STORE_TOKEN`, the store's secret.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Global rank.
    pub rank: usize,
    /// Number of processes.
    pub world_size: usize,
    /// Rank on this machine (the GPU index).
    pub local_rank: usize,
    /// `host:port` of the store on rank 0.
    pub master: String,
    /// The secret every client presents to the store (`BURN_TP_STORE_TOKEN`; empty if unset,
    /// which leaves the store open to anyone who reaches the port).
    pub token: String,
}

impl LaunchEnv {
    /// Reads the environment.
    ///
    /// # Errors
    /// A missing or malformed variable, by name.
    pub fn from_env() -> Result<Self> {
        let var = |name: &str| {
            std::env::var(name)
                .map_err(|_| CommError::Backend(format!("environment variable {name} is not set")))
        };
        let num = |name: &str| -> Result<usize> {
            let v = var(name)?;
            v.trim()
                .parse()
                .map_err(|_| CommError::Backend(format!("{name}={v:?} is not a number")))
        };
        let env = Self {
            rank: num("RANK")?,
            world_size: num("WORLD_SIZE")?,
            local_rank: num("LOCAL_RANK").unwrap_or(0),
            master: format!("{}:{}", var("MASTER_ADDR")?, num("MASTER_PORT")?),
            token: std::env::var("BURN_TP_STORE_TOKEN").unwrap_or_default(),
        };
        if env.rank >= env.world_size {
            return Err(CommError::Backend(format!(
                "RANK={} is not below WORLD_SIZE={}",
                env.rank, env.world_size
            )));
        }
        Ok(env)
    }

    /// Rank 0 starts the store; every rank connects and they meet at a barrier.
    ///
    /// # Errors
    /// The store cannot be bound or reached, or a rank does not arrive within `timeout`.
    pub fn rendezvous(&self, timeout: Duration) -> Result<(Option<StoreServer>, StoreClient)> {
        let server = if self.rank == 0 {
            Some(
                StoreServer::start(&self.master, &self.token)
                    .map_err(|e| err(0, &self.master, format!("cannot listen: {e}")))?,
            )
        } else {
            None
        };
        let client = StoreClient::connect(&self.master, self.rank, &self.token, timeout)?;
        client.barrier("rendezvous", self.world_size)?;
        Ok((server, client))
    }
}

//! A small TCP key-value store for rendezvous across processes, like torchrun's `TCPStore`.
//!
//! Rank 0 hosts it at `MASTER_ADDR:MASTER_PORT`; every rank (rank 0 included) is a client. It
//! carries only small control values (ids, barrier marks, error words), never tensors.
//!
//! Wire format, one request per frame: `op: u8`, `key_len: u32 LE`, key, `val_len: u32 LE`,
//! value; the reply is `status: u8` (0 ok, 1 timed out), `len: u32 LE`, value.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::{CommError, Result};

const SET: u8 = 1;
const GET: u8 = 2;

/// Store errors become [`CommError::Backend`] naming the rank and the address.
fn err(rank: usize, addr: &str, what: impl std::fmt::Display) -> CommError {
    CommError::Backend(format!("rendezvous store at {addr} (rank {rank}): {what}"))
}

#[derive(Default)]
struct Table {
    map: Mutex<HashMap<String, Vec<u8>>>,
    cv: Condvar,
}

/// The server side: a listener thread and one thread per client connection.
pub struct StoreServer {
    addr: SocketAddr,
}

impl StoreServer {
    /// Binds `addr` and serves until the process exits.
    ///
    /// # Errors
    /// The address cannot be bound.
    pub fn start(addr: impl ToSocketAddrs) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let table = Arc::new(Table::default());
        std::thread::Builder::new()
            .name("tp-store".into())
            .spawn(move || {
                for stream in listener.incoming().flatten() {
                    let table = table.clone();
                    let _ = std::thread::Builder::new()
                        .name("tp-store-conn".into())
                        .spawn(move || serve(stream, &table));
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
    let key = read_bytes(s)?;
    let val = read_bytes(s)?;
    Ok((op[0], String::from_utf8_lossy(&key).into_owned(), val))
}

fn read_bytes(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > 1 << 20 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "a store value over 1 MiB",
        ));
    }
    let mut buf = vec![0; len];
    s.read_exact(&mut buf)?;
    Ok(buf)
}

fn write_bytes(s: &mut TcpStream, b: &[u8]) -> std::io::Result<()> {
    s.write_all(&(b.len() as u32).to_le_bytes())?;
    s.write_all(b)
}

fn serve(mut s: TcpStream, table: &Table) {
    while let Ok((op, key, val)) = read_frame(&mut s) {
        let reply = match op {
            SET => {
                table
                    .map
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(key, val);
                table.cv.notify_all();
                Some(Vec::new())
            }
            GET => {
                // The value of a GET is the timeout in milliseconds.
                let ms = u64::from_le_bytes(
                    val.get(..8)
                        .and_then(|b| b.try_into().ok())
                        .unwrap_or([0; 8]),
                );
                let deadline = Instant::now() + Duration::from_millis(ms);
                let mut map = table.map.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    if let Some(v) = map.get(&key) {
                        break Some(v.clone());
                    }
                    let now = Instant::now();
                    if now >= deadline {
                        break None;
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
        let ok = match reply {
            Some(v) => s.write_all(&[0]).and_then(|_| write_bytes(&mut s, &v)),
            None => s.write_all(&[1]).and_then(|_| write_bytes(&mut s, &[])),
        };
        if ok.is_err() {
            return;
        }
    }
}

/// A client of the store, owned by one rank.
pub struct StoreClient {
    stream: Mutex<TcpStream>,
    addr: String,
    rank: usize,
    timeout: Duration,
}

impl StoreClient {
    /// Connects to `addr`, retrying until `timeout` (the host may not be up yet).
    ///
    /// # Errors
    /// No connection within `timeout`, naming the rank and the address.
    pub fn connect(addr: &str, rank: usize, timeout: Duration) -> Result<Self> {
        let deadline = Instant::now() + timeout;
        loop {
            match TcpStream::connect(addr) {
                Ok(stream) => {
                    let _ = stream.set_nodelay(true);
                    return Ok(Self {
                        stream: Mutex::new(stream),
                        addr: addr.to_string(),
                        rank,
                        timeout,
                    });
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
        s.write_all(&[op]).map_err(io)?;
        write_bytes(&mut s, key.as_bytes()).map_err(io)?;
        write_bytes(&mut s, val).map_err(io)?;
        let mut status = [0u8; 1];
        s.read_exact(&mut status).map_err(io)?;
        let v = read_bytes(&mut s).map_err(io)?;
        Ok((status[0] == 0).then_some(v))
    }

    /// Sets `key` to `value`.
    ///
    /// # Errors
    /// A connection error.
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
/// `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`.
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
                StoreServer::start(&self.master)
                    .map_err(|e| err(0, &self.master, format!("cannot listen: {e}")))?,
            )
        } else {
            None
        };
        let client = StoreClient::connect(&self.master, self.rank, timeout)?;
        client.barrier("rendezvous", self.world_size)?;
        Ok((server, client))
    }
}

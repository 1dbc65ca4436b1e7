//! A client of PyTorch's TCPStore, the key-value store ranks meet at: torchrun's agent hosts
//! one on MASTER_PORT, and `StoreServer` (store_server.rs) is ours for the commands used
//! here. Only the wire protocol's stable start is spoken: VALIDATE, SET, GET, ADD, CHECK,
//! WAIT (pytorch/pytorch torch/csrc/distributed/c10d/TCPStoreBackend.hpp, `QueryType`).
//!
//! On the wire: one command byte, then its arguments; a string or byte value is a u64
//! little-endian length and the bytes, numbers are little-endian. Like PyTorch's client,
//! every key is sent with a leading "/", so `store.get("ferrograd/...")` from Python sees
//! what this client set. Not a general store: no compare-set, delete or multi-key commands.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::base::{Error, Result};

/// The first thing a client sends after the VALIDATE byte.
pub(crate) const MAGIC: u32 = 0x3C85_F7CE;

/// Command bytes (PyTorch's `QueryType`; PING sits after CANCEL_WAIT in current versions).
pub(crate) mod cmd {
    pub const VALIDATE: u8 = 0;
    pub const SET: u8 = 1;
    pub const GET: u8 = 3;
    pub const ADD: u8 = 4;
    pub const CHECK: u8 = 5;
    pub const WAIT: u8 = 6;
    pub const PING: u8 = 13;
}

/// CHECK's answers (`CheckResponseType`) and WAIT's (`WaitResponseType::STOP_WAITING`).
pub(crate) const READY: u8 = 0;
pub(crate) const NOT_READY: u8 = 1;
pub(crate) const STOP_WAITING: u8 = 0;

/// Values longer than this are refused when read: a garbled length must not allocate the
/// machine's memory.
pub(crate) const MAX_VALUE_BYTES: u64 = 64 << 20;

const CONTEXT: &str = "rendezvous store";

pub(crate) fn put_bytes(buf: &mut Vec<u8>, b: &[u8]) {
    buf.extend_from_slice(&(b.len() as u64).to_le_bytes());
    buf.extend_from_slice(b);
}

pub(crate) fn read_array<const N: usize>(r: &mut impl Read) -> io::Result<[u8; N]> {
    let mut b = [0u8; N];
    r.read_exact(&mut b)?;
    Ok(b)
}

pub(crate) fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    read_array(r).map(u64::from_le_bytes)
}

pub(crate) fn read_bytes(r: &mut impl Read) -> io::Result<Vec<u8>> {
    let n = read_u64(r)?;
    if n > MAX_VALUE_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a value of {n} bytes is over the store's limit of {MAX_VALUE_BYTES}"),
        ));
    }
    let mut b = vec![0u8; n as usize];
    r.read_exact(&mut b)?;
    Ok(b)
}

/// Connects to `host:port`, retrying until `deadline`: the server may not be up yet.
pub(crate) fn connect_until(host: &str, port: u16, deadline: Instant) -> io::Result<TcpStream> {
    let addrs: Vec<SocketAddr> = (host, port).to_socket_addrs()?.collect();
    let mut last = io::Error::new(io::ErrorKind::NotFound, format!("{host} has no address"));
    loop {
        for a in &addrs {
            let left = deadline.saturating_duration_since(Instant::now());
            match TcpStream::connect_timeout(a, left.clamp(Duration::from_millis(1), ONE_TRY)) {
                Ok(s) => return Ok(s),
                Err(e) => last = e,
            }
        }
        if Instant::now() >= deadline {
            return Err(last);
        }
        std::thread::sleep(RETRY);
    }
}

const ONE_TRY: Duration = Duration::from_secs(1);
const RETRY: Duration = Duration::from_millis(50);

/// One connection to a TCPStore.
pub struct StoreClient {
    stream: TcpStream,
    endpoint: String,
    /// How long an answer may take (a WAIT takes its own timeout).
    timeout: Duration,
    /// A WAIT that timed out leaves its answer in flight: the connection is unusable after.
    broken: bool,
}

impl StoreClient {
    /// Connects to the store at `host:port` (retrying until `timeout`: the server may start
    /// after this process) and validates the connection.
    pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<StoreClient> {
        let endpoint = format!("{host}:{port}");
        let stream = connect_until(host, port, Instant::now() + timeout).map_err(|e| {
            Error::distributed(
                CONTEXT,
                format!(
                    "could not connect to {endpoint} within {}: {e}",
                    secs(timeout)
                ),
            )
        })?;
        Self::from_stream(stream, endpoint, timeout)
    }

    /// Wraps a connected stream: sends VALIDATE and the magic number.
    pub(crate) fn from_stream(
        stream: TcpStream,
        endpoint: String,
        timeout: Duration,
    ) -> Result<StoreClient> {
        let _ = stream.set_nodelay(true);
        let mut c = StoreClient {
            stream,
            endpoint,
            timeout: timeout.max(Duration::from_millis(1)),
            broken: false,
        };
        let mut buf = vec![cmd::VALIDATE];
        buf.extend_from_slice(&MAGIC.to_le_bytes());
        c.send(&buf)?;
        Ok(c)
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Stores `value` under `key` (replacing what was there); waiters on `key` wake.
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        let mut buf = vec![cmd::SET];
        put_bytes(&mut buf, wire_key(key).as_bytes());
        put_bytes(&mut buf, value);
        self.send(&buf)
    }

    /// The value of `key`, waiting up to `timeout` for some rank to set it.
    pub fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.wait(&[key], timeout)?;
        let mut buf = vec![cmd::GET];
        put_bytes(&mut buf, wire_key(key).as_bytes());
        self.send(&buf)?;
        self.answer(read_bytes)
    }

    /// Adds `delta` to the integer at `key` (0 when unset) and returns the sum.
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64> {
        let mut buf = vec![cmd::ADD];
        put_bytes(&mut buf, wire_key(key).as_bytes());
        buf.extend_from_slice(&delta.to_le_bytes());
        self.send(&buf)?;
        self.answer(|s| read_array(s).map(i64::from_le_bytes))
    }

    /// Whether every key is set, without waiting.
    pub fn check(&mut self, keys: &[&str]) -> Result<bool> {
        self.send(&keys_command(cmd::CHECK, keys))?;
        match self.answer(read_array::<1>)?[0] {
            READY => Ok(true),
            NOT_READY => Ok(false),
            b => Err(self.protocol_error(format!("CHECK answered {b}"))),
        }
    }

    /// Returns once every key is set; an error after `timeout`, which leaves this
    /// connection unusable (the server still owes the answer).
    pub fn wait(&mut self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.send(&keys_command(cmd::WAIT, keys))?;
        let answer = self.answer_within(timeout.max(ONE_MS), read_array::<1>);
        match answer {
            Ok([STOP_WAITING]) => Ok(()),
            Ok([b]) => Err(self.protocol_error(format!("WAIT answered {b}"))),
            Err(e) => Err(e),
        }
    }

    /// Blocks until the server closes this connection, at most `timeout`.
    pub(crate) fn await_close(&mut self, timeout: Duration) {
        let _ = self.stream.set_read_timeout(Some(timeout.max(ONE_MS)));
        let mut sink = [0u8; 64];
        while matches!(self.stream.read(&mut sink), Ok(n) if n > 0) {}
    }

    fn send(&mut self, buf: &[u8]) -> Result<()> {
        if self.broken {
            return Err(self.abandoned());
        }
        self.stream
            .write_all(buf)
            .map_err(|e| self.io_error("sending to", e))
    }

    fn answer<T>(&mut self, read: impl FnOnce(&mut TcpStream) -> io::Result<T>) -> Result<T> {
        self.answer_within(self.timeout, read)
    }

    fn answer_within<T>(
        &mut self,
        timeout: Duration,
        read: impl FnOnce(&mut TcpStream) -> io::Result<T>,
    ) -> Result<T> {
        let _ = self.stream.set_read_timeout(Some(timeout));
        read(&mut self.stream).map_err(|e| {
            self.broken = true;
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) {
                Error::distributed(
                    CONTEXT,
                    format!("{} did not answer within {}", self.endpoint, secs(timeout)),
                )
            } else {
                self.io_error("reading from", e)
            }
        })
    }

    fn io_error(&self, doing: &str, e: io::Error) -> Error {
        Error::distributed(
            CONTEXT,
            format!(
                "{doing} {} failed: {e} (did the rank hosting the store exit?)",
                self.endpoint
            ),
        )
    }

    fn protocol_error(&mut self, what: String) -> Error {
        self.broken = true;
        Error::distributed(
            CONTEXT,
            format!(
                "{} does not speak the TCPStore protocol as expected: {what}",
                self.endpoint
            ),
        )
    }

    fn abandoned(&self) -> Error {
        Error::distributed(
            CONTEXT,
            format!(
                "the connection to {} was abandoned after an earlier timeout; connect again",
                self.endpoint
            ),
        )
    }
}

const ONE_MS: Duration = Duration::from_millis(1);

/// PyTorch's TCPStore client puts "/" before every key; doing the same keeps our keys
/// readable from Python clients of the same store.
fn wire_key(key: &str) -> String {
    format!("/{key}")
}

fn keys_command(command: u8, keys: &[&str]) -> Vec<u8> {
    let mut buf = vec![command];
    buf.extend_from_slice(&(keys.len() as u64).to_le_bytes());
    for k in keys {
        put_bytes(&mut buf, wire_key(k).as_bytes());
    }
    buf
}

/// "2s", "0.5s": durations as people write them in messages.
pub(crate) fn secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s.fract() == 0.0 {
        format!("{s:.0}s")
    } else {
        format!("{s:.1}s")
    }
}

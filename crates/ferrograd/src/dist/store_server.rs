//! `StoreServer`: a minimal TCPStore-compatible server, hosted by rank 0 when no torchrun
//! agent hosts one, so a single client (store.rs) serves both cases. It answers exactly the
//! commands that client sends (VALIDATE, SET, GET, ADD, CHECK, WAIT) plus PING, which
//! PyTorch's own clients send after connecting. A thread per connection: a rendezvous has
//! one connection per rank, and a WAIT simply blocks its thread. Anything else closes the
//! connection. Not a general store: no persistence, no compare-set, no deletion.

use std::collections::HashMap;
use std::io::{self, Write};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use super::store::{
    MAGIC, NOT_READY, READY, STOP_WAITING, cmd, put_bytes, read_array, read_bytes, read_u64,
};
use crate::base::{Error, Result};

/// How often a blocked WAIT looks at the stop flag (a stop also wakes it at once).
const STOP_POLL: Duration = Duration::from_millis(100);
/// Keys in one CHECK or WAIT: more is a garbled message.
const MAX_KEYS: u64 = 1 << 20;

#[derive(Default)]
struct Shared {
    map: Mutex<HashMap<Vec<u8>, Vec<u8>>>,
    changed: Condvar,
    stop: AtomicBool,
    /// Clones of the open connections, to shut them down on stop.
    conns: Mutex<Vec<TcpStream>>,
}

impl Shared {
    fn map(&self) -> MutexGuard<'_, HashMap<Vec<u8>, Vec<u8>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A running store; stops (closing every connection) when dropped.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Listens on `host:port` (port 0: any free one; `port()` tells which).
    pub fn bind(host: &str, port: u16) -> Result<StoreServer> {
        let listener = bind_any(host, port).map_err(|e| {
            Error::distributed(
                "rendezvous store",
                format!(
                    "cannot listen on {host}:{port}: {e}; MASTER_ADDR must name this host and MASTER_PORT a free port (under torchrun, whose agent already hosts a store there, set TORCHELASTIC_USE_AGENT_STORE=True)"
                ),
            )
        })?;
        let addr = listener.local_addr().map_err(|e| {
            Error::distributed("rendezvous store", format!("no local address: {e}"))
        })?;
        let shared = Arc::new(Shared::default());
        let s = Arc::clone(&shared);
        let accept = std::thread::Builder::new()
            .name("store-server".into())
            .spawn(move || accept_loop(listener, s))
            .map_err(|e| Error::distributed("rendezvous store", format!("no thread: {e}")))?;
        Ok(StoreServer {
            addr,
            shared,
            accept: Some(accept),
        })
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, closes every connection and waits for the server's threads.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        let Some(accept) = self.accept.take() else {
            return;
        };
        self.shared.stop.store(true, Ordering::SeqCst);
        // The accept loop blocks in accept(): a connection of our own wakes it.
        let _ = TcpStream::connect_timeout(&wake_addr(self.addr), Duration::from_secs(1));
        let _ = accept.join();
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn bind_any(host: &str, port: u16) -> io::Result<TcpListener> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, "the name has no address");
    for a in (host, port).to_socket_addrs()? {
        match TcpListener::bind(a) {
            Ok(l) => return Ok(l),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Where to connect to reach a listener bound to `addr` (an unspecified address is not
/// connectable everywhere; loopback is).
fn wake_addr(addr: SocketAddr) -> SocketAddr {
    match addr {
        SocketAddr::V4(a) if a.ip().is_unspecified() => (Ipv4Addr::LOCALHOST, a.port()).into(),
        SocketAddr::V6(a) if a.ip().is_unspecified() => (Ipv6Addr::LOCALHOST, a.port()).into(),
        a => a,
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut handlers = Vec::new();
    for stream in listener.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        let Ok(stream) = stream else { continue };
        if let Ok(clone) = stream.try_clone() {
            shared
                .conns
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(clone);
        }
        let s = Arc::clone(&shared);
        handlers.push(std::thread::spawn(move || serve(stream, &s)));
    }
    // Listener first, so nobody connects to a server that is going away.
    drop(listener);
    for c in shared
        .conns
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .drain(..)
    {
        let _ = c.shutdown(std::net::Shutdown::Both);
    }
    shared.changed.notify_all();
    for h in handlers {
        let _ = h.join();
    }
}

/// Answers one connection's commands until it closes, errs, or the server stops.
fn serve(mut s: TcpStream, shared: &Shared) {
    let _ = s.set_nodelay(true);
    while let Ok([command]) = read_array::<1>(&mut s) {
        if shared.stop.load(Ordering::SeqCst) || command_failed(command, &mut s, shared) {
            return;
        }
    }
}

/// Runs one command; true when the connection must close (bad input or a closed peer).
fn command_failed(command: u8, s: &mut TcpStream, shared: &Shared) -> bool {
    let result = match command {
        cmd::VALIDATE => validate(s),
        cmd::PING => read_array::<4>(s).and_then(|nonce| s.write_all(&nonce)),
        cmd::SET => set(s, shared),
        cmd::GET => get(s, shared),
        cmd::ADD => add(s, shared),
        cmd::CHECK => check(s, shared),
        cmd::WAIT => wait(s, shared),
        _ => Err(io::Error::new(io::ErrorKind::Unsupported, "command")),
    };
    result.is_err()
}

fn validate(s: &mut TcpStream) -> io::Result<()> {
    if u32::from_le_bytes(read_array(s)?) == MAGIC {
        Ok(())
    } else {
        Err(io::Error::new(io::ErrorKind::InvalidData, "bad magic"))
    }
}

fn set(s: &mut TcpStream, shared: &Shared) -> io::Result<()> {
    let key = read_bytes(s)?;
    let value = read_bytes(s)?;
    shared.map().insert(key, value);
    shared.changed.notify_all();
    Ok(())
}

fn get(s: &mut TcpStream, shared: &Shared) -> io::Result<()> {
    let key = read_bytes(s)?;
    // Clients WAIT before they GET: a missing key is a client that skipped it.
    let value = shared
        .map()
        .get(&key)
        .cloned()
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "GET of a missing key"))?;
    let mut buf = Vec::with_capacity(8 + value.len());
    put_bytes(&mut buf, &value);
    s.write_all(&buf)
}

/// Integers are stored as decimal text, as PyTorch's store does.
fn add(s: &mut TcpStream, shared: &Shared) -> io::Result<()> {
    let key = read_bytes(s)?;
    let delta = i64::from_le_bytes(read_array(s)?);
    let sum = {
        let mut map = shared.map();
        let old = map.get(&key).map_or(Some(0), |v| {
            std::str::from_utf8(v)
                .ok()
                .and_then(|t| t.parse::<i64>().ok())
        });
        let old =
            old.ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "ADD to a non-number"))?;
        let sum = old.wrapping_add(delta);
        map.insert(key, sum.to_string().into_bytes());
        sum
    };
    shared.changed.notify_all();
    s.write_all(&sum.to_le_bytes())
}

fn read_keys(s: &mut TcpStream) -> io::Result<Vec<Vec<u8>>> {
    let n = read_u64(s)?;
    if n > MAX_KEYS {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "too many keys"));
    }
    (0..n).map(|_| read_bytes(s)).collect()
}

fn check(s: &mut TcpStream, shared: &Shared) -> io::Result<()> {
    let keys = read_keys(s)?;
    let map = shared.map();
    let ready = keys.iter().all(|k| map.contains_key(k));
    drop(map);
    s.write_all(&[if ready { READY } else { NOT_READY }])
}

fn wait(s: &mut TcpStream, shared: &Shared) -> io::Result<()> {
    let keys = read_keys(s)?;
    let mut map = shared.map();
    while !keys.iter().all(|k| map.contains_key(k)) {
        if shared.stop.load(Ordering::SeqCst) {
            return Err(io::Error::new(io::ErrorKind::Interrupted, "stopping"));
        }
        map = shared
            .changed
            .wait_timeout(map, STOP_POLL)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
    drop(map);
    s.write_all(&[STOP_WAITING])
}

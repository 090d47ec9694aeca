//! A loopback UDP relay with per-client faults, for the fault tests of QUIC transports.
//!
//! The emulator proper shapes IP packets between network namespaces and needs root; this relay
//! needs nothing: clients send to [`Relay::addr`], each client (by source address) gets its own
//! upstream socket to the server, and replies go back the same way. Faults are set per client
//! or for all: [`Relay::blackhole`] drops every packet of a client in both directions for a
//! while (a short one is a freeze the connection rides out; one longer than the transport's
//! idle timeout cuts the connection, and the client's next connection passes again once it
//! ends), [`Relay::set_loss`] drops packets at random. Owns its sockets and threads; dropping
//! the relay stops them. Plain `std` threads and sockets, like the rest of this crate.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::rng::Rng;

/// How often blocked threads look at the stop flag.
const POLL: Duration = Duration::from_millis(20);

#[derive(Debug, Default, Clone, Copy)]
struct Fault {
    /// Drop everything until then.
    blackhole_until: Option<Instant>,
    /// Chance of dropping any one packet.
    loss: f64,
}

#[derive(Debug)]
struct Flow {
    upstream: UdpSocket,
}

#[derive(Debug)]
struct Shared {
    stop: AtomicBool,
    faults: Mutex<HashMap<Option<SocketAddr>, Fault>>,
    rng: Mutex<Rng>,
    forwarded: AtomicU64,
    dropped: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    /// Whether a packet of `client` passes now (its own fault, then the all-clients one).
    fn passes(&self, client: SocketAddr) -> bool {
        let now = Instant::now();
        let faults = lock(&self.faults);
        for f in [faults.get(&Some(client)), faults.get(&None)].into_iter().flatten() {
            if f.blackhole_until.is_some_and(|t| now < t) {
                self.dropped.fetch_add(1, Ordering::Relaxed);
                return false;
            }
            if f.loss > 0.0 && lock(&self.rng).next_f64() < f.loss {
                self.dropped.fetch_add(1, Ordering::Relaxed);
                return false;
            }
        }
        self.forwarded.fetch_add(1, Ordering::Relaxed);
        true
    }
}

/// Packets the relay moved and dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelayStats {
    pub forwarded: u64,
    pub dropped: u64,
}

/// The relay (see the module docs).
#[derive(Debug)]
pub struct Relay {
    addr: SocketAddr,
    shared: Arc<Shared>,
    threads: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl Relay {
    /// Listens on `127.0.0.1:0` and relays to `upstream`; `seed` drives the random loss.
    pub fn start(upstream: SocketAddr, seed: u64) -> io::Result<Self> {
        let listen = UdpSocket::bind("127.0.0.1:0")?;
        listen.set_read_timeout(Some(POLL))?;
        let addr = listen.local_addr()?;
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            faults: Mutex::new(HashMap::new()),
            rng: Mutex::new(Rng::new(seed)),
            forwarded: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
        });
        let threads = Arc::new(Mutex::new(Vec::new()));
        let main = {
            let (shared, threads) = (shared.clone(), threads.clone());
            std::thread::Builder::new()
                .name("relay".into())
                .spawn(move || downstream_loop(listen, upstream, shared, threads))?
        };
        lock(&threads).push(main);
        Ok(Self { addr, shared, threads })
    }

    /// Where clients send.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Drops every packet from and to `client` (every client with `None`) for `d` from now.
    pub fn blackhole(&self, client: Option<SocketAddr>, d: Duration) {
        lock(&self.shared.faults).entry(client).or_default().blackhole_until = Some(Instant::now() + d);
    }

    /// Ends a blackhole of `client` (or of all) now.
    pub fn heal(&self, client: Option<SocketAddr>) {
        if let Some(f) = lock(&self.shared.faults).get_mut(&client) {
            f.blackhole_until = None;
        }
    }

    /// Drops each packet from and to `client` (every client with `None`) with chance `p`.
    pub fn set_loss(&self, client: Option<SocketAddr>, p: f64) {
        lock(&self.shared.faults).entry(client).or_default().loss = p.clamp(0.0, 1.0);
    }

    /// Packets forwarded and dropped so far.
    pub fn stats(&self) -> RelayStats {
        RelayStats {
            forwarded: self.shared.forwarded.load(Ordering::Relaxed),
            dropped: self.shared.dropped.load(Ordering::Relaxed),
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        let threads = std::mem::take(&mut *lock(&self.threads));
        for t in threads {
            let _ = t.join();
        }
    }
}

/// Clients → server: one upstream socket (and reply thread) per client address.
fn downstream_loop(
    listen: UdpSocket,
    upstream: SocketAddr,
    shared: Arc<Shared>,
    threads: Arc<Mutex<Vec<JoinHandle<()>>>>,
) {
    let mut flows: HashMap<SocketAddr, Flow> = HashMap::new();
    let mut buf = vec![0u8; 65_536];
    while !shared.stop.load(Ordering::Relaxed) {
        let (n, client) = match listen.recv_from(&mut buf) {
            Ok(x) => x,
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => continue,
            Err(_) => continue,
        };
        let flow = match flows.entry(client) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => match open_flow(&listen, upstream, client, &shared, &threads) {
                Ok(f) => e.insert(f),
                Err(_) => continue,
            },
        };
        if shared.passes(client) {
            let _ = flow.upstream.send(&buf[..n]);
        }
    }
}

fn open_flow(
    listen: &UdpSocket,
    upstream: SocketAddr,
    client: SocketAddr,
    shared: &Arc<Shared>,
    threads: &Arc<Mutex<Vec<JoinHandle<()>>>>,
) -> io::Result<Flow> {
    let up = UdpSocket::bind("127.0.0.1:0")?;
    up.connect(upstream)?;
    up.set_read_timeout(Some(POLL))?;
    let (reply, back, shared) = (up.try_clone()?, listen.try_clone()?, shared.clone());
    let t = std::thread::Builder::new().name("relay-flow".into()).spawn(move || {
        let mut buf = vec![0u8; 65_536];
        while !shared.stop.load(Ordering::Relaxed) {
            match reply.recv(&mut buf) {
                Ok(n) => {
                    if shared.passes(client) {
                        let _ = back.send_to(&buf[..n], client);
                    }
                }
                Err(_) => continue,
            }
        }
    })?;
    lock(threads).push(t);
    Ok(Flow { upstream: up })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relays_both_ways_and_blackholes_on_demand() {
        let server = UdpSocket::bind("127.0.0.1:0").unwrap();
        server.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let relay = Relay::start(server.local_addr().unwrap(), 1).unwrap();
        let client = UdpSocket::bind("127.0.0.1:0").unwrap();
        client.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
        let mut buf = [0u8; 16];
        client.send_to(b"ping", relay.addr()).unwrap();
        let (n, from) = server.recv_from(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"ping");
        server.send_to(b"pong", from).unwrap();
        let n = client.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"pong");

        relay.blackhole(Some(client.local_addr().unwrap()), Duration::from_secs(60));
        client.send_to(b"lost", relay.addr()).unwrap();
        server.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
        assert!(server.recv_from(&mut buf).is_err(), "a blackholed packet passed");
        relay.heal(Some(client.local_addr().unwrap()));
        client.send_to(b"back", relay.addr()).unwrap();
        let (n, _) = server.recv_from(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"back");
        let s = relay.stats();
        assert_eq!((s.forwarded, s.dropped), (3, 1), "{s:?}");
    }
}

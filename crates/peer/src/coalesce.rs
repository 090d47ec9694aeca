//! Receive coalescing for the QUIC socket: the software form of a NIC's interrupt moderation.
//!
//! A bulk receiver that reads each datagram as it arrives is woken once per packet or two:
//! at 1 Gbit/s that is tens of thousands of wake-ups a second, and a thread switch, an
//! `epoll_wait` and a `recvmmsg` for each (measured: a fetch's receiving daemon spent more of
//! its time switching tasks than decrypting). [`CoalescingSocket`] is the endpoint's socket
//! with a watcher thread in front of its receive side: the watcher waits for the socket to
//! become readable and, while traffic flows (a batch ended within four holds), sleeps `hold`
//! before it lets the endpoint's task drain everything that arrived; the kernel's socket
//! buffer (sized from the BDP, see [`crate::transport`]) holds it meanwhile. An idle socket is
//! not held: the first datagram after a quiet spell is handed over at once, so a handshake or a
//! lone request pays no delay. Sends go straight to the socket, as before.
//!
//! The cost is at most `hold` of added one-way delay on a busy socket, which is why
//! [`crate::LinkTuning::recv_hold`] turns it off on short round trips.

use std::fmt;
use std::io::{self, IoSliceMut};
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker, ready};
use std::time::{Duration, Instant};

use quinn::udp::{RecvMeta, Transmit, UdpSocketState};
use quinn::{AsyncUdpSocket, UdpPoller};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// A socket fd shared by the endpoint and the watcher thread.
struct Fd(Arc<UdpSocket>);

impl AsRawFd for Fd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// What the watcher thread and the endpoint's task share.
struct Shared {
    state: Mutex<Gate>,
    drained: Condvar,
    stop: AtomicBool,
    /// Written on drop to take the watcher out of `poll` at once.
    wake_fd: OwnedFd,
}

struct Gate {
    /// The task may read: the watcher saw data and held it for a batch.
    open: bool,
    /// The endpoint task waiting for the gate to open.
    waker: Option<Waker>,
}

impl Shared {
    fn gate(&self) -> MutexGuard<'_, Gate> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// An [`AsyncUdpSocket`] read in batches: a watcher thread waits for the socket to become
/// readable, holds `hold` when traffic is flowing, then lets the endpoint's task drain it.
///
/// Receive readiness never reaches the runtime's `epoll` (the fd is registered for writes
/// only): otherwise every datagram arriving during a hold would still wake the runtime's
/// thread, which is the cost this exists to remove.
pub(crate) struct CoalescingSocket {
    sock: Arc<UdpSocket>,
    udp: UdpSocketState,
    io: AsyncFd<Fd>,
    shared: Arc<Shared>,
    hold: Duration,
}

impl CoalescingSocket {
    /// Wraps a bound socket; call inside a tokio runtime. `hold` must be non-zero (a zero
    /// hold is the plain socket).
    pub(crate) fn new(sock: UdpSocket, hold: Duration) -> io::Result<Self> {
        sock.set_nonblocking(true)?;
        let udp = UdpSocketState::new((&sock).into())?;
        let sock = Arc::new(sock);
        // SAFETY: `Fd` holds an `Arc` of the socket, so the fd it returns stays open and the
        // same for as long as the `AsyncFd` (which owns that `Fd`) lives.
        let io = unsafe { AsyncFd::register_with_interest(Fd(sock.clone()), Interest::WRITABLE) }
            .map_err(|e| e.into_parts().1)?;
        // SAFETY: eventfd has no memory-safety preconditions; its result is checked below.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a freshly created fd that nothing else owns.
        let wake_fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let shared = Arc::new(Shared {
            state: Mutex::new(Gate { open: false, waker: None }),
            drained: Condvar::new(),
            stop: AtomicBool::new(false),
            wake_fd,
        });
        let (s, w) = (sock.clone(), shared.clone());
        std::thread::Builder::new().name("kvferry-quic-rx".into()).spawn(move || watch(&s, &w, hold))?;
        Ok(Self { sock, udp, io, shared, hold })
    }
}

/// The watcher: wait for data, hold while busy, open the gate, wait until it is drained.
fn watch(sock: &UdpSocket, shared: &Shared, hold: Duration) {
    // Traffic counts as flowing when the last batch ended this recently.
    let busy_window = hold * 4;
    let mut last_drained: Option<Instant> = None;
    while !shared.stop.load(Ordering::Acquire) {
        let mut fds = [
            libc::pollfd { fd: sock.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: shared.wake_fd.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        // SAFETY: two valid pollfds in a live array; -1 waits without a timeout.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if rc < 0 || fds[1].revents != 0 || shared.stop.load(Ordering::Acquire) {
            if rc < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return;
        }
        if last_drained.is_some_and(|t| t.elapsed() < busy_window) {
            std::thread::sleep(hold);
        }
        let mut gate = shared.gate();
        gate.open = true;
        if let Some(w) = gate.waker.take() {
            w.wake();
        }
        while gate.open && !shared.stop.load(Ordering::Acquire) {
            gate = shared.drained.wait(gate).unwrap_or_else(PoisonError::into_inner);
        }
        last_drained = Some(Instant::now());
    }
}

impl Drop for CoalescingSocket {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to the eventfd this value owns.
        let _ = unsafe { libc::write(self.shared.wake_fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
        self.shared.drained.notify_all();
    }
}

impl fmt::Debug for CoalescingSocket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CoalescingSocket").field("sock", &self.sock).field("hold", &self.hold).finish()
    }
}

/// Waits for send space through the runtime (the only interest the fd is registered for).
#[derive(Debug)]
struct WritePoller(Arc<CoalescingSocket>);

impl UdpPoller for WritePoller {
    fn poll_writable(self: Pin<&mut Self>, cx: &mut Context) -> Poll<io::Result<()>> {
        loop {
            let mut guard = ready!(self.0.io.poll_write_ready(cx))?;
            let mut pfd = libc::pollfd { fd: self.0.sock.as_raw_fd(), events: libc::POLLOUT, revents: 0 };
            // SAFETY: one valid pollfd; a zero timeout only checks.
            if unsafe { libc::poll(&mut pfd, 1, 0) } > 0 && pfd.revents & libc::POLLOUT != 0 {
                return Poll::Ready(Ok(()));
            }
            // Stale readiness (a send failed since): wait for the next edge.
            guard.clear_ready();
        }
    }
}

impl AsyncUdpSocket for CoalescingSocket {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        Box::pin(WritePoller(self))
    }

    fn try_send(&self, transmit: &Transmit) -> io::Result<()> {
        self.udp.send((&*self.sock).into(), transmit)
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        {
            let mut gate = self.shared.gate();
            if !gate.open {
                gate.waker = Some(cx.waker().clone());
                return Poll::Pending;
            }
        }
        match self.udp.recv((&*self.sock).into(), bufs, meta) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                // Drained: close the gate and hand the socket back to the watcher.
                let mut gate = self.shared.gate();
                gate.open = false;
                gate.waker = Some(cx.waker().clone());
                self.shared.drained.notify_one();
                Poll::Pending
            }
            other => Poll::Ready(other),
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.sock.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.udp.max_gso_segments()
    }

    fn max_receive_segments(&self) -> usize {
        self.udp.gro_segments()
    }

    fn may_fragment(&self) -> bool {
        self.udp.may_fragment()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(hold: Duration) -> (UdpSocket, Arc<CoalescingSocket>) {
        let rx = UdpSocket::bind("127.0.0.1:0").unwrap();
        let tx = UdpSocket::bind("127.0.0.1:0").unwrap();
        tx.connect(rx.local_addr().unwrap()).unwrap();
        (tx, Arc::new(CoalescingSocket::new(rx, hold).unwrap()))
    }

    async fn recv_batch(s: &CoalescingSocket) -> usize {
        let mut storage = vec![[0u8; 2048]; 8];
        std::future::poll_fn(|cx| {
            let mut bufs: Vec<IoSliceMut<'_>> =
                storage.iter_mut().map(|b| IoSliceMut::new(&mut b[..])).collect();
            let mut meta = [RecvMeta::default(); 8];
            s.poll_recv(cx, &mut bufs, &mut meta).map(|r| {
                let n = r.unwrap();
                meta[..n].iter().map(|m| m.len / m.stride.max(1)).sum::<usize>()
            })
        })
        .await
    }

    #[tokio::test]
    async fn a_quiet_socket_is_read_at_once_and_a_busy_one_in_batches() {
        let hold = Duration::from_millis(200);
        let (tx, rx) = pair(hold);
        // A lone datagram after a quiet spell: read at once, no hold.
        tx.send(b"first").unwrap();
        let t = Instant::now();
        assert_eq!(recv_batch(&rx).await, 1);
        assert!(t.elapsed() < hold, "an idle socket must not be held ({:?})", t.elapsed());
        // Datagrams that arrive right after a batch wait for the hold to end and are then
        // read together (without the hold the first of them would be read alone, at ~2 ms).
        let sender = std::thread::spawn(move || {
            for _ in 0..5 {
                std::thread::sleep(Duration::from_millis(2));
                tx.send(b"burst").unwrap();
            }
        });
        let t = Instant::now();
        let n = recv_batch(&rx).await;
        let waited = t.elapsed();
        sender.join().unwrap();
        assert!(waited >= hold, "the read after a batch waits the hold ({waited:?})");
        assert_eq!(n, 5, "what arrived during the hold is read in one batch");
    }

    #[tokio::test]
    async fn nothing_is_lost_when_traffic_stops_during_a_hold() {
        let (tx, rx) = pair(Duration::from_millis(5));
        let mut got = 0;
        for round in 0..20 {
            // Alternate: some datagrams land during a hold, some after it, when idle.
            tokio::time::sleep(Duration::from_millis(round % 3 * 4)).await;
            tx.send(&[round as u8; 100]).unwrap();
            got += tokio::time::timeout(Duration::from_secs(5), recv_batch(&rx))
                .await
                .expect("a datagram sent during or after a hold wakes the reader");
        }
        assert_eq!(got, 20);
    }
}

//! Receive coalescing for the QUIC socket: the software form of a NIC's interrupt moderation.
//!
//! A bulk receiver that reads each datagram as it arrives is woken once per packet or two:
//! at 1 Gbit/s that is tens of thousands of wake-ups a second, and a thread switch, an
//! `epoll_wait` and a `recvmmsg` for each (measured: a fetch's receiving daemon spent more of
//! its time switching tasks than decrypting). [`CoalescingSocket`] reads the endpoint's socket
//! in batches: after a batch drains, the next read waits `hold` on the runtime's own timer
//! (the kernel's socket buffer, sized from the BDP in [`crate::transport`], holds what arrives
//! meanwhile), and only a hold that ends with nothing to read makes the socket idle again. An
//! idle socket is registered for readability, so the first datagram after a quiet spell is
//! handed over at once: a handshake or a lone request pays no delay. Sends go straight to the
//! socket.
//!
//! Readability reaches the runtime's `epoll` only while the socket is idle: it is registered
//! through a duplicate of the socket's fd that exists only then (the socket itself is
//! registered for writes only). Otherwise every datagram arriving during a hold would wake the
//! runtime's thread, which is the cost this exists to remove. A busy socket costs one timer
//! wake-up per hold, on the thread that then reads; an earlier version woke a watcher thread,
//! which woke the runtime's, three to four thread switches per batch (2026-12-05: 2,500
//! switches a second and 3 % of a core at 100 Mbit/s on the receiving side).
//!
//! The runtime's timer rounds deadlines up to its millisecond, so a hold asks for half a tick
//! less and lasts `hold` on average (measured: holds centred on 1.5 ms instead of 1 ms cost
//! 1 Gbit/s × 50 ms three to four points of goodput at 256 MiB). The cost is about `hold` of
//! added one-way delay on a busy socket, which is why [`crate::LinkTuning::recv_hold`] turns it off
//! on short round trips.

use std::fmt;
use std::future::Future;
use std::io::{self, IoSliceMut};
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use quinn::udp::{RecvMeta, Transmit, UdpSocketState};
use quinn::{AsyncUdpSocket, UdpPoller};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::time::Sleep;

/// A socket fd shared by the endpoint's registrations.
struct Fd(Arc<UdpSocket>);

impl AsRawFd for Fd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// The receive side's state, touched only by the endpoint's driver (one task).
#[derive(Default)]
struct Rx {
    /// A datagram was read since the last hold began: the batch in progress is not empty.
    got: bool,
    /// The hold in progress: no read until it ends.
    hold: Option<Pin<Box<Sleep>>>,
    /// The readability registration of an idle socket (a duplicate fd; dropped, and so taken
    /// out of the runtime's `epoll`, as soon as traffic flows).
    idle: Option<AsyncFd<OwnedFd>>,
}

/// An [`AsyncUdpSocket`] read in batches: after a batch drains, reads wait `hold` on the
/// runtime's timer; an idle socket is read as soon as a datagram arrives.
pub(crate) struct CoalescingSocket {
    sock: Arc<UdpSocket>,
    udp: UdpSocketState,
    io: AsyncFd<Fd>,
    hold: Duration,
    rx: Mutex<Rx>,
}

impl CoalescingSocket {
    /// Wraps a bound socket; call inside a tokio runtime with its timer enabled. `hold` must
    /// be non-zero (a zero hold is the plain socket).
    pub(crate) fn new(sock: UdpSocket, hold: Duration) -> io::Result<Self> {
        sock.set_nonblocking(true)?;
        let udp = UdpSocketState::new((&sock).into())?;
        let sock = Arc::new(sock);
        // SAFETY: `Fd` holds an `Arc` of the socket, so the fd it returns stays open and the
        // same for as long as the `AsyncFd` (which owns that `Fd`) lives.
        let io = unsafe { AsyncFd::register_with_interest(Fd(sock.clone()), Interest::WRITABLE) }
            .map_err(|e| e.into_parts().1)?;
        Ok(Self { sock, udp, io, hold, rx: Mutex::new(Rx::default()) })
    }

    fn rx(&self) -> MutexGuard<'_, Rx> {
        self.rx.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The runtime's timer fires on whole milliseconds, rounding a deadline up: a sleep of `d`
/// ends between `d` and `d` + 1 ms. Asking for half a tick less centres the hold on `hold`.
fn timer_hold(hold: Duration) -> Duration {
    hold.saturating_sub(Duration::from_micros(500)).max(Duration::from_micros(1))
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
        let mut rx = self.rx();
        loop {
            if let Some(hold) = rx.hold.as_mut() {
                ready!(hold.as_mut().poll(cx));
                rx.hold = None;
            }
            match self.udp.recv((&*self.sock).into(), bufs, meta) {
                Ok(n) => {
                    rx.got = true;
                    return Poll::Ready(Ok(n));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
            if rx.got {
                // A batch drained: hold the next read, with readability out of the epoll.
                rx.got = false;
                rx.idle = None;
                rx.hold = Some(Box::pin(tokio::time::sleep(timer_hold(self.hold))));
                continue;
            }
            // Nothing arrived during the hold: the socket is idle until a datagram comes.
            if rx.idle.is_none() {
                let dup = self.sock.as_fd().try_clone_to_owned()?;
                // SAFETY: the `AsyncFd` owns `dup`, so the fd it registers stays open and the
                // same until the registration is dropped.
                let idle = unsafe { AsyncFd::register_with_interest(dup, Interest::READABLE) }
                    .map_err(|e| e.into_parts().1)?;
                rx.idle = Some(idle);
            }
            let Some(idle) = rx.idle.as_ref() else { continue };
            let mut guard = ready!(idle.poll_read_ready(cx))?;
            match self.udp.recv((&*self.sock).into(), bufs, meta) {
                Ok(n) => {
                    rx.got = true;
                    return Poll::Ready(Ok(n));
                }
                // Spurious readiness: wait for the next edge.
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => guard.clear_ready(),
                Err(e) => return Poll::Ready(Err(e)),
            }
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
    use std::time::Instant;

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
        // The timer ends a hold within half a tick of it (`timer_hold`).
        assert!(
            waited + Duration::from_millis(1) >= hold,
            "the read after a batch waits the hold ({waited:?})"
        );
        assert_eq!(n, 5, "what arrived during the hold is read in one batch");
    }

    #[test]
    fn timer_holds_are_centred_on_the_hold_and_never_zero() {
        assert_eq!(timer_hold(Duration::from_millis(1)), Duration::from_micros(500));
        assert_eq!(timer_hold(Duration::from_micros(2500)), Duration::from_millis(2));
        assert_eq!(timer_hold(Duration::from_micros(100)), Duration::from_micros(1));
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

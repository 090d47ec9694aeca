//! A Unix-socket relay between an engine and its daemon's `engine.sock`, which a test can cut
//! (every connection through it closed at once, both sides) or freeze (bytes held, connections
//! left open) at any moment. An engine is pointed at it through a run dir of its own: that
//! dir's `engine.sock` is the relay, its `pool.sock` a symlink to the daemon's.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kvferry_pool::sync::LockExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use tokio::task::AbortHandle;

pub struct UdsCut {
    conns: std::sync::Mutex<Vec<AbortHandle>>,
    frozen: watch::Sender<bool>,
    accepted: AtomicU64,
    accept: AbortHandle,
}

impl Drop for UdsCut {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

/// Makes `dir` an engine run dir in front of the daemon run dir `daemon_dir`: `pool.sock` a
/// symlink to the daemon's, `engine.sock` a relay to the daemon's (returned).
pub fn engine_run_dir(dir: &Path, daemon_dir: &Path) -> Arc<UdsCut> {
    std::fs::create_dir_all(dir).unwrap();
    std::os::unix::fs::symlink(daemon_dir.join("pool.sock"), dir.join("pool.sock")).unwrap();
    UdsCut::start(dir.join("engine.sock"), daemon_dir.join("engine.sock"))
}

impl UdsCut {
    /// Listens on `listen`; each connection is relayed to a new connection to `target`.
    pub fn start(listen: PathBuf, target: PathBuf) -> Arc<UdsCut> {
        let listener = UnixListener::bind(&listen).unwrap();
        let (frozen, _) = watch::channel(false);
        Arc::new_cyclic(|weak: &std::sync::Weak<UdsCut>| {
            let weak = weak.clone();
            let accept = tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    let Some(me) = weak.upgrade() else { return };
                    me.accepted.fetch_add(1, Ordering::Relaxed);
                    let Ok(server) = UnixStream::connect(&target).await else { continue };
                    let rx = me.frozen.subscribe();
                    let task = tokio::spawn(relay(client, server, rx));
                    let mut c = me.conns.locked();
                    c.retain(|h| !h.is_finished());
                    c.push(task.abort_handle());
                }
            })
            .abort_handle();
            UdsCut { conns: Default::default(), frozen, accepted: AtomicU64::new(0), accept }
        })
    }

    /// Closes every connection through the relay (both sides); how many were open.
    pub fn cut(&self) -> usize {
        let conns = std::mem::take(&mut *self.conns.locked());
        let live = conns.iter().filter(|h| !h.is_finished()).count();
        for h in conns {
            h.abort();
        }
        live
    }

    /// Holds (`true`) or releases (`false`) every byte in both directions; connections stay open.
    pub fn freeze(&self, on: bool) {
        self.frozen.send_replace(on);
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.conns.locked().iter().filter(|h| !h.is_finished()).count()
    }
}

async fn relay(client: UnixStream, server: UnixStream, frozen: watch::Receiver<bool>) {
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    // Either direction ending ends both: the relay is one connection.
    tokio::select! {
        () = pipe(cr, sw, frozen.clone()) => {}
        () = pipe(sr, cw, frozen) => {}
    }
}

async fn pipe(
    mut from: tokio::net::unix::OwnedReadHalf,
    mut to: tokio::net::unix::OwnedWriteHalf,
    mut frozen: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if frozen.wait_for(|f| !*f).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

//! Per-connection stream routing: every unidirectional chunk stream an outgoing QUIC
//! connection accepts is read into staging (within the fetch budget) and handed to the
//! transfer its first chunk names, so concurrent fetches over one cached connection never read
//! each other's streams; a connection failure reaches every transfer on it. A TCP session's
//! data connections belong to one transfer: their readers ([`Route::Only`]) hand chunks of that
//! transfer only.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kvferry_wire::WireError;
use kvferry_wire::frame::Frame;
use kvferry_wire::plan::MAX_CHUNK;
use quinn::Connection;
use tokio::sync::mpsc;

use crate::budget::{Budget, Lease};
use crate::io::{from_conn_error, read_end, read_frame};
use crate::link::RecvHalf;
use crate::recvbuf::RecvBuf;
use kvferry_pool::sync::LockExt;

pub(crate) type ChunkItem = Result<(kvferry_wire::ChunkHeader, RecvBuf, Lease), WireError>;

/// Routes a connection's incoming chunk streams to the transfer they belong to, so that
/// concurrent fetches over one cached connection never read each other's streams.
#[derive(Default)]
pub(crate) struct StreamRouter {
    transfers: Mutex<HashMap<u128, mpsc::Sender<ChunkItem>>>,
}

impl StreamRouter {
    pub(crate) fn get(&self, id: u128) -> Option<mpsc::Sender<ChunkItem>> {
        self.transfers.locked().get(&id).cloned()
    }

    pub(crate) fn register(self: &Arc<Self>, id: u128) -> (mpsc::Receiver<ChunkItem>, Registration) {
        let (tx, rx) = mpsc::channel(8);
        self.transfers.locked().insert(id, tx);
        (rx, Registration { router: self.clone(), id })
    }

    pub(crate) async fn fail_all(&self, e: WireError) {
        let all: Vec<_> = self.transfers.locked().values().cloned().collect();
        for tx in all {
            let _ = tx.send(Err(e.clone())).await;
        }
    }
}

/// Unregisters a transfer from its connection's router on drop.
pub(crate) struct Registration {
    router: Arc<StreamRouter>,
    id: u128,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.router.transfers.locked().remove(&self.id);
    }
}

/// Accepts a connection's chunk streams for as long as it lives and routes each to its
/// transfer; a connection failure reaches every transfer on it.
pub(crate) async fn route_streams(conn: Connection, budget: Arc<Budget>, router: Arc<StreamRouter>) {
    loop {
        match conn.accept_uni().await {
            Ok(recv) => {
                tokio::spawn(read_chunks(
                    RecvHalf::Quic(recv),
                    budget.clone(),
                    Route::Router(router.clone()),
                ));
            }
            Err(e) => {
                router.fail_all(from_conn_error(&e)).await;
                return;
            }
        }
    }
}

/// Where a chunk reader hands what it read.
pub(crate) enum Route {
    /// To the transfer its chunks name, among the connection's (QUIC).
    Router(Arc<StreamRouter>),
    /// To this transfer only (a TCP session's data connection).
    Only(u128, mpsc::Sender<ChunkItem>),
}

impl Route {
    fn get(&self, id: u128) -> Option<mpsc::Sender<ChunkItem>> {
        match self {
            Self::Router(r) => r.get(id),
            Self::Only(mine, tx) => (*mine == id).then(|| tx.clone()),
        }
    }
}

/// Reads one data channel's chunks into staging and hands each to its transfer.
pub(crate) async fn read_chunks(mut recv: RecvHalf, budget: Arc<Budget>, router: Route) {
    let mut last: Option<mpsc::Sender<ChunkItem>> = None;
    loop {
        let frame = read_frame(&mut recv).await;
        let tx = match &frame {
            Ok(Some(Frame::Chunk(h))) => match router.get(h.transfer_id) {
                Some(tx) => tx,
                None => {
                    // A transfer that already ended (or never existed here): not ours to read.
                    recv.stop();
                    return;
                }
            },
            _ => match last.clone() {
                Some(tx) => tx,
                None => return,
            },
        };
        last = Some(tx.clone());
        let item = match frame {
            Ok(None) => return,
            Ok(Some(Frame::Chunk(h))) if h.len > MAX_CHUNK => {
                Err(WireError::Protocol(format!("chunk of {} bytes exceeds {MAX_CHUNK}", h.len)))
            }
            Ok(Some(Frame::Chunk(h))) => match budget.lease(h.len).await {
                Ok(lease) => {
                    let mut buf = RecvBuf::take(h.len as usize);
                    match recv.read_exact(&mut buf).await {
                        Ok(()) => Ok((h, buf, lease)),
                        Err(e) => Err(read_end(e)),
                    }
                }
                Err(e) => Err(e),
            },
            Ok(Some(other)) => {
                Err(WireError::Protocol(format!("unexpected frame on a chunk stream: {other:?}")))
            }
            Err(e) => Err(e),
        };
        let stop = item.is_err();
        if tx.send(item).await.is_err() || stop {
            return;
        }
    }
}

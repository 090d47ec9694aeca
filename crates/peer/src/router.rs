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
///
/// A transfer that ends while its channel is still sending (a hedge's losing fetch, a
/// cancelled or failed one) has its channel stopped at once (QUIC `STOP_SENDING`): every wait
/// — for the next header, for staging, for a chunk's payload — also watches the transfer's
/// receiver, so a reader never finishes reading a chunk (4 MiB by default, a third of a second
/// at 100 Mbit/s) off the WAN for a transfer nobody will take it from.
pub(crate) async fn read_chunks(mut recv: RecvHalf, budget: Arc<Budget>, router: Route) {
    let mut last: Option<mpsc::Sender<ChunkItem>> = None;
    loop {
        let frame = match &last {
            Some(tx) => match until_closed(tx, read_frame(&mut recv)).await {
                Some(frame) => frame,
                None => break,
            },
            None => read_frame(&mut recv).await,
        };
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
            Ok(Some(Frame::Chunk(h))) => {
                let read = async {
                    let lease = budget.lease(h.len).await?;
                    let mut buf = RecvBuf::take(h.len as usize);
                    match recv.read_exact(&mut buf).await {
                        Ok(()) => Ok((h, buf, lease)),
                        Err(e) => Err(read_end(e)),
                    }
                };
                match until_closed(&tx, read).await {
                    Some(item) => item,
                    None => break,
                }
            }
            Ok(Some(other)) => {
                Err(WireError::Protocol(format!("unexpected frame on a chunk stream: {other:?}")))
            }
            Err(e) => Err(e),
        };
        let stop = item.is_err();
        if tx.send(item).await.is_err() {
            break;
        }
        if stop {
            return;
        }
    }
    // The transfer is gone: ask the sender to stop rather than read what it still sends.
    recv.stop();
}

/// `work`'s output, or `None` as soon as the transfer behind `tx` has dropped its receiver.
async fn until_closed<T>(
    tx: &mpsc::Sender<ChunkItem>,
    work: impl std::future::Future<Output = T>,
) -> Option<T> {
    tokio::select! {
        out = work => Some(out),
        () = tx.closed() => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tls::{DevPki, RegionId, TrustPolicy, client_crypto};
    use crate::transport::{LinkTuning, quic_server_config};
    use quinn::crypto::rustls::QuicClientConfig;
    use std::time::Duration;

    const TD: &str = "router.test";

    /// A QUIC connection on loopback with the peers' mutual TLS: (endpoints, the owner's side,
    /// the requester's side).
    async fn pair() -> ([quinn::Endpoint; 2], Connection, Connection) {
        let pki = DevPki::generate(TD).unwrap();
        let policy =
            TrustPolicy { roots: pki.roots(), trust_domain: TD.into(), allowed_regions: vec!["dst".into()] };
        let server_cfg =
            quic_server_config(&pki.issue("src").unwrap(), &policy, &LinkTuning::default()).unwrap();
        let server = quinn::Endpoint::server(server_cfg, "127.0.0.1:0".parse().unwrap()).unwrap();
        let tls = client_crypto(&pki.issue("dst").unwrap(), pki.roots(), &RegionId::new(TD, "src").unwrap())
            .unwrap();
        let client_cfg = quinn::ClientConfig::new(Arc::new(QuicClientConfig::try_from(tls).unwrap()));
        let client = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        let connecting =
            client.connect_with(client_cfg, server.local_addr().unwrap(), "kvferry-peer").unwrap();
        let (dst, src) = tokio::join!(connecting, async { server.accept().await.unwrap().await });
        ([server, client], src.unwrap(), dst.unwrap())
    }

    fn header(transfer_id: u128, len: u64) -> Vec<u8> {
        let h = kvferry_wire::ChunkHeader {
            transfer_id,
            chunk_id: 0,
            blocks: (0, 1),
            layers: (0, 1),
            len,
            checksum: 0,
        };
        kvferry_wire::frame::encode_to_vec(&Frame::Chunk(h))
    }

    /// A hedge's losing fetch is dropped while its source is still sending: the reader stops
    /// the stream at once (the source sees `STOP_SENDING`) instead of reading the rest of a
    /// chunk off the link, whether it was waiting for a chunk's payload or for the next header.
    #[tokio::test]
    async fn a_transfer_that_ends_stops_its_streams_at_once() {
        use std::sync::atomic::Ordering;
        let (_endpoints, src, dst) = pair().await;
        let router = Arc::new(StreamRouter::default());
        let budget = Budget::new(64 << 20);
        tokio::spawn(route_streams(dst.clone(), budget.clone(), router.clone()));
        for (id, mid_chunk) in [(7u128, true), (8, false)] {
            let (mut rx, reg) = router.register(id);
            let mut send = src.open_uni().await.unwrap();
            // One whole 1 KiB chunk, taken by the transfer.
            send.write_all(&header(id, 1 << 10)).await.unwrap();
            send.write_all(&[0u8; 1 << 10]).await.unwrap();
            let (h, _, lease) = rx.recv().await.unwrap().unwrap();
            assert_eq!(h.len, 1 << 10);
            drop(lease);
            if mid_chunk {
                // Then a 1 MiB chunk of which only the first 64 KiB is ever sent; wait until
                // the reader holds its staging (it is reading the payload).
                send.write_all(&header(id, 1 << 20)).await.unwrap();
                send.write_all(&[0u8; 64 << 10]).await.unwrap();
                let t = std::time::Instant::now();
                while budget.in_use_kib.load(Ordering::Relaxed) < 1024 {
                    assert!(t.elapsed() < Duration::from_secs(5), "the reader never leased the chunk");
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
            // The transfer ends (its receiver and its registration dropped).
            drop((rx, reg));
            let stopped = tokio::time::timeout(Duration::from_secs(5), send.stopped()).await;
            assert!(
                matches!(stopped, Ok(Ok(Some(_)))),
                "a reader {} must stop the stream of a transfer that ended: {stopped:?}",
                if mid_chunk { "mid-chunk" } else { "between chunks" }
            );
            assert_eq!(
                budget.in_use_kib.load(Ordering::Relaxed),
                0,
                "the stopped chunk's staging is released"
            );
        }
    }
}

//! The owner driver: `PeerNode::start` binds the endpoint and accepts peers; each request on a
//! connection is served by one `kvferry_wire::Owner` core: a producer reads chunk i+1 from the
//! [`ChunkSource`] (within the serving staging budget) while writer tasks send chunk i on
//! several unidirectional streams; control frames (retransmit, complete) arrive on the
//! request's bidirectional stream. A `Query` is answered with the manifest and this endpoint's
//! load, a `Probe` by [`crate::probe`]; no KV byte is read for either.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use kvferry_wire::frame::{Cancel, Frame, Refusal};
use kvferry_wire::{LocalError, Owner, WireError, Work};
use quinn::crypto::rustls::QuicServerConfig;
use quinn::{Connection, Endpoint, EndpointConfig, RecvStream, SendStream, TokioRuntime, VarInt};
use rustls::pki_types::CertificateDer;
use tokio::sync::mpsc;

use crate::budget::{Budget, Leased};
use crate::io::{AbortOnDrop, control_reader, read_frame, write_frame};
use crate::node::{BlockCatalog, Credentials, PeerConfig, PeerNode};
use crate::tls::{IdentityError, RegionId, TlsIdentity, TrustPolicy, identity_of, server_crypto};
use crate::transport::{LinkTuning, bind_udp};
use kvferry_pool::sync::LockExt;

/// The QUIC server configuration for `identity` under `policy` (at start and on a reload).
pub(crate) fn quic_server_config(
    identity: &TlsIdentity,
    policy: &TrustPolicy,
    tuning: &LinkTuning,
) -> Result<quinn::ServerConfig, IdentityError> {
    let tls = server_crypto(identity, policy)?;
    let quic = QuicServerConfig::try_from(tls).map_err(|e| IdentityError::Config(e.to_string()))?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(quic));
    server.transport_config(Arc::new(tuning.transport()));
    Ok(server)
}

impl PeerNode {
    /// Binds the endpoint and starts serving.
    pub fn start(cfg: PeerConfig, catalog: Arc<dyn BlockCatalog>) -> Result<Arc<Self>, WireError> {
        let server = quic_server_config(&cfg.identity, &cfg.policy, &cfg.tuning)
            .map_err(|e| LocalError::Setup(e.to_string()))?;
        let (socket, _, _) = bind_udp(cfg.listen, cfg.tuning.socket_buffer_bytes)
            .map_err(|e| LocalError::Setup(e.to_string()))?;
        let endpoint = Endpoint::new(EndpointConfig::default(), Some(server), socket, Arc::new(TokioRuntime))
            .map_err(|e| LocalError::Setup(e.to_string()))?;
        let creds = Arc::new(Credentials { identity: cfg.identity.clone(), roots: cfg.policy.roots.clone() });
        let node = Arc::new(Self {
            endpoint,
            creds: Mutex::new(creds),
            uses: Mutex::new(HashMap::new()),
            retiring: Mutex::new(Vec::new()),
            reaping: AtomicBool::new(false),
            reloads: AtomicU64::new(0),
            serve_budget: Budget::new(cfg.staging_bytes),
            fetch_budget: Budget::new(cfg.staging_bytes),
            cfg,
            catalog,
            conns: Mutex::new(HashMap::new()),
            incoming: Mutex::new(Vec::new()),
            routers: Mutex::new(HashMap::new()),
            serving: AtomicU32::new(0),
            verify_failures: AtomicU64::new(0),
        });
        tokio::spawn(accept_loop(node.clone()));
        Ok(node)
    }
}

struct ServingGuard<'a>(&'a AtomicU32);

impl Drop for ServingGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn accept_loop(node: Arc<PeerNode>) {
    while let Some(incoming) = node.endpoint.accept().await {
        let node = node.clone();
        tokio::spawn(async move {
            let conn = match incoming.await {
                Ok(c) => c,
                Err(e) => {
                    tracing::info!(error = %e, "incoming peer connection failed");
                    return;
                }
            };
            let peer = match conn
                .peer_identity()
                .and_then(|a| a.downcast::<Vec<CertificateDer<'static>>>().ok())
                .and_then(|chain| chain.first().map(identity_of))
            {
                Some(Ok(id)) => id,
                _ => {
                    conn.close(VarInt::from_u32(3), b"no identity");
                    return;
                }
            };
            {
                let mut v = node.incoming.locked();
                v.retain(|c| c.close_reason().is_none());
                v.push(conn.clone());
            }
            while let Ok((send, recv)) = conn.accept_bi().await {
                let node = node.clone();
                let conn = conn.clone();
                let peer = peer.clone();
                tokio::spawn(async move {
                    let _in_use = node.in_use(&conn);
                    if let Err(e) = serve_transfer(&node, &conn, &peer, send, recv).await {
                        tracing::info!(peer = %peer, error = %e, "serving a transfer ended with an error");
                    }
                });
            }
        });
    }
}

async fn serve_transfer(
    node: &PeerNode,
    conn: &Connection,
    peer: &RegionId,
    mut ctl_send: SendStream,
    mut ctl_recv: RecvStream,
) -> Result<(), WireError> {
    let (req, query_only) = match read_frame(&mut ctl_recv).await? {
        Some(Frame::Request(r)) => (r, false),
        Some(Frame::Query(r)) => (r, true),
        Some(Frame::Probe(p)) => return crate::probe::serve_probe(ctl_send, p).await,
        other => return Err(WireError::Protocol(format!("expected a request, got {other:?}"))),
    };
    let refuse =
        |code, detail: String| Frame::Refusal(Refusal { transfer_id: req.transfer_id, code, detail });
    let served = match node.catalog.open(peer, &req) {
        Ok(s) => s,
        Err((code, detail)) => {
            write_frame(&mut ctl_send, &refuse(code, detail)).await?;
            let _ = ctl_send.finish();
            return Ok(());
        }
    };
    let (mut owner, manifest) =
        match Owner::accept(&req, served.blocks_held, served.layers, served.bytes_per_block_layer) {
            Ok(x) => x,
            Err(r) => {
                write_frame(&mut ctl_send, &Frame::Refusal(r)).await?;
                let _ = ctl_send.finish();
                return Ok(());
            }
        };
    if query_only {
        // A query learns what is held, and how loaded this fetch path is; no KV byte is read.
        // Both frames in one write, so they leave in one packet.
        let mut both = kvferry_wire::frame::encode_to_vec(&Frame::Manifest(manifest));
        let load = kvferry_wire::frame::LoadReport {
            egress_cap_bps: served.egress_cap_bps,
            ..node.load_report(req.transfer_id)
        };
        kvferry_wire::frame::encode(&Frame::Load(load), &mut both);
        ctl_send.write_all(&both).await.map_err(crate::io::write_err)?;
        let _ = ctl_send.finish();
        return Ok(());
    }
    write_frame(&mut ctl_send, &Frame::Manifest(manifest)).await?;
    node.serving.fetch_add(1, Ordering::Relaxed);
    let _serving = ServingGuard(&node.serving);

    // Writers: one unidirectional stream each, fed round-robin.
    let streams = node.cfg.tuning.streams.max(1) as usize;
    let mut writers = Vec::with_capacity(streams);
    let mut writer_tasks = Vec::with_capacity(streams);
    for _ in 0..streams {
        let (tx, rx) = mpsc::channel::<(kvferry_wire::ChunkHeader, Bytes)>(2);
        writers.push(tx);
        writer_tasks.push(tokio::spawn(chunk_writer(conn.clone(), rx)));
    }
    let (ctl_tx, mut ctl_rx) = mpsc::channel::<Result<Frame, WireError>>(16);
    let reader = tokio::spawn(control_reader(ctl_recv, ctl_tx));
    let _guard = AbortOnDrop(vec![reader.abort_handle()]);

    let mut next_writer = 0;
    let result: Result<(), WireError> = async {
        loop {
            while let Ok(msg) = ctl_rx.try_recv() {
                if handle_owner_control(&mut owner, msg)? {
                    return Ok(());
                }
            }
            if let Some(work) = owner.next_work() {
                let spec = work.spec();
                let lease = node.serve_budget.lease(spec.len).await?;
                let bytes = served.source.read(spec).await?;
                let header = owner.chunk_ready(work, (*bytes).as_ref())?;
                if let (Some(h), Work::Send(_)) = (header, work) {
                    #[cfg(feature = "fault-injection")]
                    let bytes = crate::io::maybe_corrupt(&*served.source, &spec, bytes);
                    #[cfg(feature = "fault-injection")]
                    let h = {
                        let mut h = h;
                        served.source.tamper_header(&spec, &mut h);
                        h
                    };
                    let payload = Bytes::from_owner(Leased { bytes, _lease: lease });
                    writers[next_writer % streams]
                        .send((h, payload))
                        .await
                        .map_err(|_| WireError::Connection("chunk writer ended".into()))?;
                    next_writer += 1;
                }
                continue;
            }
            if let Some(done) = owner.poll_done()? {
                write_frame(&mut ctl_send, &Frame::Done(done)).await?;
            }
            match ctl_rx.recv().await {
                Some(msg) => {
                    if handle_owner_control(&mut owner, msg)? {
                        return Ok(());
                    }
                }
                None => return Err(WireError::Connection("requester closed the control stream".into())),
            }
        }
    }
    .await;
    drop(writers);
    for t in writer_tasks {
        let _ = t.await;
    }
    if let Err(e) = &result {
        owner.cancel();
        let _ = write_frame(
            &mut ctl_send,
            &Frame::Cancel(Cancel { transfer_id: owner.transfer_id(), detail: e.to_string() }),
        )
        .await;
    }
    let _ = ctl_send.finish();
    result
}

/// Applies one control frame; `true` when the transfer is complete.
fn handle_owner_control(owner: &mut Owner, msg: Result<Frame, WireError>) -> Result<bool, WireError> {
    match msg? {
        Frame::Retransmit(r) => {
            owner.on_retransmit(&r.chunk_ids)?;
            Ok(false)
        }
        Frame::Complete(_) => {
            owner.on_complete()?;
            Ok(true)
        }
        Frame::Cancel(c) => {
            owner.cancel();
            Err(WireError::Cancelled(c.detail))
        }
        other => Err(WireError::Protocol(format!("unexpected control frame {other:?}"))),
    }
}

async fn chunk_writer(conn: Connection, mut rx: mpsc::Receiver<(kvferry_wire::ChunkHeader, Bytes)>) {
    let mut stream: Option<SendStream> = None;
    while let Some((h, payload)) = rx.recv().await {
        if stream.is_none() {
            match conn.open_uni().await {
                Ok(s) => stream = Some(s),
                Err(_) => return,
            }
        }
        let Some(s) = stream.as_mut() else { return };
        if write_frame(s, &Frame::Chunk(h)).await.is_err() || s.write_chunk(payload).await.is_err() {
            return;
        }
    }
    if let Some(mut s) = stream {
        let _ = s.finish();
    }
}

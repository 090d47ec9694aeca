//! Asking a peer how much of a block chain it holds, before deciding to fetch.
//!
//! A `Query` carries the same fields as a fetch request and passes the same checks (mutual
//! TLS, allow-list, tenant, fingerprint); the owner answers with the manifest it would use, or
//! a typed refusal, and reads no KV byte. The answer's round trip also gives a fresh RTT.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvferry_wire::WireError;
use kvferry_wire::frame::{FetchRequest, Frame, Manifest, RefusalCode};

use crate::io::{read_frame, write_frame};
use crate::node::PeerNode;
use crate::tls::RegionId;

/// What a peer holds of a chain.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Holdings {
    /// Leading blocks of the chain the peer holds (0 when it holds none).
    pub blocks_held: u32,
    /// The manifest it would serve them with (absent when it holds none).
    pub manifest: Option<Manifest>,
    /// Round trip of the query itself.
    pub rtt: Duration,
    /// The peer's serving load, when it reported one.
    pub load: Option<kvferry_wire::frame::LoadReport>,
}

impl PeerNode {
    /// Asks `peer` how many leading blocks of `hashes` it holds for `tenant` under `fingerprint`.
    /// `UnknownBlocks` becomes `Ok` with zero blocks; other refusals are errors.
    pub async fn query(
        &self,
        peer: &RegionId,
        addr: SocketAddr,
        tenant: &str,
        fingerprint: [u8; 32],
        hashes: Vec<[u8; 32]>,
        deadline: Instant,
    ) -> Result<Holdings, WireError> {
        let work = async {
            let conn = self.link(peer, addr, 0).await?;
            let _in_use = self.in_use(&conn);
            let (mut send, mut recv) = conn.open_control().await?;
            let t0 = Instant::now();
            let req = FetchRequest {
                transfer_id: rand::random(),
                tenant: tenant.to_owned(),
                fingerprint,
                block_hashes: hashes,
                have_chunks: Vec::new(),
                chunk_target_bytes: 0,
            };
            write_frame(&mut send, &Frame::Query(req)).await?;
            send.finish().await;
            let answer = read_frame(&mut recv).await?;
            let rtt = t0.elapsed();
            self.record_link(peer, &conn);
            match answer {
                Some(Frame::Manifest(m)) => {
                    let load = match read_frame(&mut recv).await {
                        Ok(Some(Frame::Load(l))) if l.transfer_id == m.transfer_id => Some(l),
                        _ => None,
                    };
                    Ok(Holdings { blocks_held: m.blocks_held, manifest: Some(m), rtt, load })
                }
                Some(Frame::Refusal(r)) if r.code == RefusalCode::UnknownBlocks => {
                    Ok(Holdings { blocks_held: 0, manifest: None, rtt, load: None })
                }
                Some(Frame::Refusal(r)) => Err(WireError::Refused { code: r.code, detail: r.detail }),
                other => Err(WireError::Protocol(format!("unexpected answer to a query: {other:?}"))),
            }
        };
        match tokio::time::timeout(deadline.saturating_duration_since(Instant::now()), work).await {
            Ok(r) => r,
            Err(_) => Err(WireError::DeadlineExceeded),
        }
    }
}

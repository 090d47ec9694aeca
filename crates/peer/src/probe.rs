//! Bounded active link probe: measure goodput to a peer by fetching synthetic bytes.
//!
//! The requester opens a bidirectional stream on the (mutually authenticated, cached)
//! connection and sends a [`Probe`] frame. The owner answers on the same stream with the
//! frame echoed, then exactly `bytes` zero bytes, then finishes the stream — or with a typed
//! [`Refusal`] (`BadRequest`) when `bytes` exceeds [`MAX_PROBE_BYTES`]. No KV byte and no
//! staging buffer is involved on either side (the zeros are a static buffer, the receiver
//! discards as it reads), and the catalog is not consulted: the handshake's identity and
//! allow-list checks are the same as for a fetch, so a peer that may not fetch cannot probe.
//!
//! The answer rides the request's own stream rather than a unidirectional one so it cannot be
//! mistaken for a chunk stream of a concurrent fetch on the same connection. Feed the receipt
//! into a [`kvferry_wire::LinkEstimator`] (`record_goodput(now, bytes, wall)` and
//! `record_rtt(now, rtt)`).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvferry_wire::WireError;
use kvferry_wire::frame::{Frame, Probe, Refusal, RefusalCode};

use crate::link::{RecvHalf, SendHalf};

use crate::io::{read_frame, write_frame};
use crate::node::PeerNode;
use crate::tls::RegionId;

/// The most synthetic bytes an owner sends for one probe.
pub const MAX_PROBE_BYTES: u64 = 64 << 20;

/// Zeros served by reference (no allocation, no copy per probe).
static ZEROS: [u8; 1 << 20] = [0; 1 << 20];

/// What a probe measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProbeReceipt {
    /// Synthetic bytes received.
    pub bytes: u64,
    /// From sending the probe request to the last byte (includes one RTT and slow start, as a
    /// real fetch of that size would).
    pub wall: Duration,
    /// `bytes × 8 / wall`.
    pub goodput_bps: f64,
    /// Connection RTT at the end.
    pub rtt: Duration,
}

impl PeerNode {
    /// Measures goodput to `peer` by fetching `bytes` synthetic bytes before `deadline`.
    /// Refused by the owner (typed `BadRequest`) above [`MAX_PROBE_BYTES`].
    pub async fn probe(
        &self,
        peer: &RegionId,
        addr: SocketAddr,
        bytes: u64,
        deadline: Instant,
    ) -> Result<ProbeReceipt, WireError> {
        let run = async {
            let conn = self.link(peer, addr, 0).await?;
            let _in_use = self.in_use(&conn);
            let t0 = Instant::now();
            let (mut send, mut recv) = conn.open_control().await?;
            let transfer_id: u128 = rand::random();
            write_frame(&mut send, &Frame::Probe(Probe { transfer_id, bytes })).await?;
            send.finish().await;
            match read_frame(&mut recv).await? {
                Some(Frame::Probe(p)) if p.transfer_id == transfer_id && p.bytes == bytes => {}
                Some(Frame::Refusal(r)) => {
                    return Err(WireError::Refused { code: r.code, detail: r.detail });
                }
                other => return Err(WireError::Protocol(format!("unexpected probe answer {other:?}"))),
            }
            let got = drain(&mut recv, bytes).await?;
            if got != bytes {
                return Err(WireError::Protocol(format!("probe answered {got} of {bytes} bytes")));
            }
            let wall = t0.elapsed();
            self.record_link(peer, &conn);
            Ok(ProbeReceipt {
                bytes,
                wall,
                goodput_bps: bytes as f64 * 8.0 / wall.as_secs_f64().max(1e-9),
                rtt: conn.rtt(),
            })
        };
        tokio::time::timeout_at(deadline.into(), run).await.map_err(|_| WireError::DeadlineExceeded)?
    }
}

/// Reads and discards the stream to its end; returns the bytes seen (at most `expect + 1`, so
/// an over-long answer is noticed without reading it all).
async fn drain(recv: &mut RecvHalf, expect: u64) -> Result<u64, WireError> {
    let mut got = 0u64;
    let mut buf = vec![0u8; 256 << 10];
    while got <= expect {
        match recv.read_some(&mut buf).await? {
            0 => break,
            n => got += n as u64,
        }
    }
    Ok(got)
}

/// Owner side: answers one probe on the stream it arrived on.
pub(crate) async fn serve_probe(mut send: SendHalf, p: Probe) -> Result<(), WireError> {
    if p.bytes > MAX_PROBE_BYTES {
        let refusal = Refusal {
            transfer_id: p.transfer_id,
            code: RefusalCode::BadRequest,
            detail: format!("probe of {} bytes exceeds the {MAX_PROBE_BYTES}-byte cap", p.bytes),
        };
        write_frame(&mut send, &Frame::Refusal(refusal)).await?;
        send.finish().await;
        return Ok(());
    }
    write_frame(&mut send, &Frame::Probe(p)).await?;
    let mut left = p.bytes;
    while left > 0 {
        let n = left.min(ZEROS.len() as u64) as usize;
        send.write_chunk(Bytes::from_static(&ZEROS[..n])).await?;
        left -= n as u64;
    }
    send.finish().await;
    Ok(())
}

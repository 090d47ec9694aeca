//! Segmentation offload, done by the emulator the way a NIC does it (TSO for TCP, USO for
//! UDP), so the sending stack hands the device one large packet instead of segmenting it in
//! software.
//!
//! The ingress TUN is opened with `TUN_F_TSO4 | TUN_F_USO4`: a TCP or UDP-GSO send of up to
//! 64 KiB reaches the emulator as one IPv4 packet behind a `virtio_net_hdr` that gives its
//! segment size. [`Segments`] cuts it into the MTU-sized packets the wire would carry —
//! each with its own IPv4 length, ID and header checksum, its own UDP length or TCP sequence
//! number and flags, and a partial L4 checksum left for the receiver to trust
//! (`VIRTIO_NET_HDR_F_NEEDS_CSUM`, as the unsegmented packets already are). The shaper then
//! sees exactly the packets it saw before; only the sender's kernel is spared the work.
//!
//! Pure: no I/O; the forwarder reads and writes, this module only does the header math.

use crate::sys::VNET_HDR_LEN;

/// `virtio_net_hdr.flags`: the L4 checksum is partial, starting at `csum_start`.
pub const F_NEEDS_CSUM: u8 = 1;
/// `virtio_net_hdr.gso_type`: not a GSO packet.
pub const GSO_NONE: u8 = 0;
/// `virtio_net_hdr.gso_type`: TCP over IPv4 (TSO).
pub const GSO_TCPV4: u8 = 1;
/// `virtio_net_hdr.gso_type`: UDP with L4 segmentation (USO, `UDP_SEGMENT`).
pub const GSO_UDP_L4: u8 = 5;
/// `virtio_net_hdr.gso_type` bit: TCP with ECN (CWR only on the first segment).
pub const GSO_ECN: u8 = 0x80;

const PROTO_TCP: u8 = 6;
const PROTO_UDP: u8 = 17;
const TCP_FIN: u8 = 0x01;
const TCP_PSH: u8 = 0x08;
const TCP_CWR: u8 = 0x80;

/// The `virtio_net_hdr` in front of every packet (host byte order, as TUN uses by default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct VnetHdr {
    /// `F_NEEDS_CSUM` and others.
    pub flags: u8,
    /// One of the `GSO_*` values.
    pub gso_type: u8,
    /// Length of the headers before the payload (advisory).
    pub hdr_len: u16,
    /// Payload bytes per segment.
    pub gso_size: u16,
    /// Where the partial checksum's coverage starts.
    pub csum_start: u16,
    /// Offset of the checksum field from `csum_start`.
    pub csum_offset: u16,
}

impl VnetHdr {
    /// Reads a header from the first [`VNET_HDR_LEN`] bytes of `b`.
    pub fn parse(b: &[u8]) -> Option<Self> {
        let b = b.get(..VNET_HDR_LEN)?;
        let u = |i: usize| u16::from_ne_bytes([b[i], b[i + 1]]);
        Some(Self {
            flags: b[0],
            gso_type: b[1],
            hdr_len: u(2),
            gso_size: u(4),
            csum_start: u(6),
            csum_offset: u(8),
        })
    }

    /// Writes the header into the first [`VNET_HDR_LEN`] bytes of `out`.
    pub fn write(&self, out: &mut [u8]) {
        out[0] = self.flags;
        out[1] = self.gso_type;
        out[2..4].copy_from_slice(&self.hdr_len.to_ne_bytes());
        out[4..6].copy_from_slice(&self.gso_size.to_ne_bytes());
        out[6..8].copy_from_slice(&self.csum_start.to_ne_bytes());
        out[8..10].copy_from_slice(&self.csum_offset.to_ne_bytes());
    }
}

/// Why a packet could not be segmented (the forwarder counts it as an I/O error and drops it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegmentError {
    /// Shorter than its headers say.
    Truncated,
    /// A GSO packet that is not IPv4 TCP or IPv4/IPv6 UDP, or whose `gso_type` does not match it.
    Unsupported,
    /// A GSO packet with a segment size of 0.
    ZeroSegmentSize,
}

#[derive(Debug, Clone, Copy)]
enum L4 {
    Tcp { seq: u32, flags: u8 },
    Udp,
}

/// The wire packets one packet read from the TUN stands for: itself, or its segments.
#[derive(Debug)]
pub struct Segments<'a> {
    /// The IP packet (after the virtio header).
    ip: &'a [u8],
    hdr: VnetHdr,
    /// `None`: pass the packet through as it is.
    gso: Option<Gso>,
}

#[derive(Debug, Clone, Copy)]
struct Gso {
    v6: bool,
    /// IP header bytes.
    ihl: usize,
    /// IP plus L4 header bytes.
    headers: usize,
    seg: usize,
    count: usize,
    l4: L4,
    ecn: bool,
}

impl<'a> Segments<'a> {
    /// Parses `pkt`, a virtio header followed by an IP packet.
    pub fn new(pkt: &'a [u8]) -> Result<Self, SegmentError> {
        let hdr = VnetHdr::parse(pkt).ok_or(SegmentError::Truncated)?;
        let ip = &pkt[VNET_HDR_LEN..];
        let kind = hdr.gso_type & !GSO_ECN;
        if kind == GSO_NONE {
            return Ok(Self { ip, hdr, gso: None });
        }
        let v6 = match ip.first().map(|b| b >> 4) {
            Some(4) => false,
            Some(6) => true,
            _ => return Err(SegmentError::Unsupported),
        };
        // IPv6: the fixed header only (a GSO send with extension headers is not cut here).
        let ihl = if v6 { 40 } else { usize::from(ip[0] & 0x0f) * 4 };
        if ihl < 20 || ip.len() < ihl {
            return Err(SegmentError::Truncated);
        }
        let proto = if v6 { ip[6] } else { ip[9] };
        let (l4, l4_len) = match (kind, proto, v6) {
            (GSO_TCPV4, PROTO_TCP, false) => {
                let t = ip.get(ihl..ihl + 20).ok_or(SegmentError::Truncated)?;
                let doff = usize::from(t[12] >> 4) * 4;
                if doff < 20 {
                    return Err(SegmentError::Truncated);
                }
                (L4::Tcp { seq: u32::from_be_bytes([t[4], t[5], t[6], t[7]]), flags: t[13] }, doff)
            }
            (GSO_UDP_L4, PROTO_UDP, _) => (L4::Udp, 8),
            _ => return Err(SegmentError::Unsupported),
        };
        let headers = ihl + l4_len;
        if ip.len() < headers {
            return Err(SegmentError::Truncated);
        }
        let seg = usize::from(hdr.gso_size);
        if seg == 0 {
            return Err(SegmentError::ZeroSegmentSize);
        }
        let payload = ip.len() - headers;
        let count = payload.div_ceil(seg).max(1);
        let ecn = hdr.gso_type & GSO_ECN != 0;
        Ok(Self { ip, hdr, gso: Some(Gso { v6, ihl, headers, seg, count, l4, ecn }) })
    }

    /// How many wire packets this is.
    pub fn count(&self) -> usize {
        self.gso.map_or(1, |g| g.count)
    }

    /// Whether the packet was a GSO packet (cut by [`Self::write`]).
    pub fn is_gso(&self) -> bool {
        self.gso.is_some()
    }

    /// Bytes on the wire (the IP packet) of segment `i`.
    pub fn wire_len(&self, i: usize) -> usize {
        match self.gso {
            None => self.ip.len(),
            Some(g) => g.headers + self.payload_range(&g, i).len(),
        }
    }

    fn payload_range(&self, g: &Gso, i: usize) -> std::ops::Range<usize> {
        let start = (g.headers + i * g.seg).min(self.ip.len());
        start..(start + g.seg).min(self.ip.len())
    }

    /// Writes segment `i` — virtio header and IP packet — into `out` and returns its length,
    /// or `None` if `out` is too small.
    pub fn write(&self, i: usize, out: &mut [u8]) -> Option<usize> {
        let len = VNET_HDR_LEN + self.wire_len(i);
        let out = out.get_mut(..len)?;
        let Some(g) = self.gso else {
            self.hdr.write(out);
            out[VNET_HDR_LEN..].copy_from_slice(self.ip);
            return Some(len);
        };
        let body = self.payload_range(&g, i);
        let ip_len = g.headers + body.len();
        let (vh, pkt) = out.split_at_mut(VNET_HDR_LEN);
        pkt[..g.headers].copy_from_slice(&self.ip[..g.headers]);
        pkt[g.headers..].copy_from_slice(&self.ip[body.clone()]);
        let l4_len = ip_len - g.ihl;
        if g.v6 {
            // IPv6: payload length; no header checksum.
            pkt[4..6].copy_from_slice(&(l4_len as u16).to_be_bytes());
        } else {
            // IPv4: total length, one ID per segment, header checksum.
            pkt[2..4].copy_from_slice(&(ip_len as u16).to_be_bytes());
            let id = u16::from_be_bytes([self.ip[4], self.ip[5]]).wrapping_add(i as u16);
            pkt[4..6].copy_from_slice(&id.to_be_bytes());
            pkt[10..12].fill(0);
            let ip_sum = !fold(sum16(&pkt[..g.ihl]));
            pkt[10..12].copy_from_slice(&ip_sum.to_be_bytes());
        }
        let l4 = &mut pkt[g.ihl..];
        let check_at = match g.l4 {
            L4::Udp => {
                l4[4..6].copy_from_slice(&(l4_len as u16).to_be_bytes());
                6
            }
            L4::Tcp { seq, flags } => {
                let seq = seq.wrapping_add((i * g.seg) as u32);
                l4[4..8].copy_from_slice(&seq.to_be_bytes());
                let mut f = flags;
                if i + 1 < g.count {
                    f &= !(TCP_FIN | TCP_PSH);
                }
                if i > 0 && g.ecn {
                    f &= !TCP_CWR;
                }
                l4[13] = f;
                16
            }
        };
        // The partial checksum a stack leaves for a checksumming device: the pseudo-header's
        // folded sum, not inverted (Linux's `~csum_tcpudp_magic(..)`).
        let (proto, addrs) =
            if g.v6 { (self.ip[6], &self.ip[8..40]) } else { (self.ip[9], &self.ip[12..20]) };
        let pseudo = fold(sum16(addrs) + u32::from(proto) + l4_len as u32);
        l4[check_at..check_at + 2].copy_from_slice(&pseudo.to_be_bytes());
        let hdr = VnetHdr {
            flags: F_NEEDS_CSUM,
            gso_type: GSO_NONE,
            hdr_len: 0,
            gso_size: 0,
            csum_start: g.ihl as u16,
            csum_offset: check_at as u16,
        };
        hdr.write(vh);
        Some(len)
    }
}

/// Most segments one coalesced packet holds (Linux's GRO limit).
pub const MAX_COALESCED: usize = 64;

/// Receive coalescing, done by the emulator the way a NIC's GRO/LRO does it: consecutive
/// packets of one flow that are due at the same moment are handed to the receiving stack as
/// one GSO packet (`VIRTIO_NET_HDR_GSO_UDP_L4` or `_TCPV4`), which a socket with `UDP_GRO`
/// (quinn's) reads in one call and a TCP socket takes as one segment; any other socket gets
/// the datagrams one by one, cut by its kernel. It never holds a packet back: the forwarder
/// offers only packets already due and flushes before it sleeps, so timing is unchanged.
///
/// A packet joins the batch only if it is the batch flow's next in order: IPv4 without
/// options or fragments, partial checksum (as every packet the sending device hands over
/// is), the same addresses, ports, TOS and TTL, a payload of the batch's segment size (a
/// shorter one may end it); for TCP the next sequence number, the same ACK, window and
/// options, and only ACK (with PSH, which ends the batch) among its flags.
#[derive(Debug)]
pub struct Coalescer {
    buf: Vec<u8>,
    segs: usize,
    seg_size: usize,
    /// No more may join (a short segment or a PSH ended it).
    closed: bool,
    proto: u8,
    next_seq: u32,
}

impl Default for Coalescer {
    fn default() -> Self {
        Self::new()
    }
}

const IPV4_HDR: usize = 20;

impl Coalescer {
    /// An empty coalescer with room for one 64 KiB packet.
    pub fn new() -> Self {
        Self {
            buf: Vec::with_capacity(crate::sys::MAX_GSO_READ),
            segs: 0,
            seg_size: 0,
            closed: false,
            proto: 0,
            next_seq: 0,
        }
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.segs == 0
    }

    /// Packets held.
    pub fn len(&self) -> usize {
        self.segs
    }

    /// Adds `pkt` (virtio header and IP packet, as the forwarder queues them) to the batch, or
    /// returns `false` and changes nothing if it cannot join — the caller then [`Self::finish`]es
    /// the batch, writes it, and offers the packet again; a packet refused by an empty
    /// coalescer is one to write as it is.
    pub fn push(&mut self, pkt: &[u8]) -> bool {
        let Some((proto, headers, payload)) = eligible(pkt) else { return false };
        let ip = &pkt[VNET_HDR_LEN..];
        if self.segs == 0 {
            self.buf.clear();
            self.buf.extend_from_slice(pkt);
            self.segs = 1;
            self.seg_size = payload;
            self.proto = proto;
            self.closed = false;
            if proto == PROTO_TCP {
                let t = &ip[IPV4_HDR..];
                self.next_seq = u32::from_be_bytes([t[4], t[5], t[6], t[7]]).wrapping_add(payload as u32);
                self.closed = t[13] & TCP_PSH != 0;
            }
            return true;
        }
        let first = &self.buf[VNET_HDR_LEN..];
        if self.closed
            || proto != self.proto
            || self.segs >= MAX_COALESCED
            || payload > self.seg_size
            || self.buf.len() + payload > crate::sys::MAX_GSO_READ - 1
            || ip[1] != first[1]
            || ip[8] != first[8]
            || ip[12..IPV4_HDR + 4] != first[12..IPV4_HDR + 4]
        {
            return false;
        }
        if proto == PROTO_TCP {
            let (t, f) = (&ip[IPV4_HDR..headers], &first[IPV4_HDR..]);
            let seq = u32::from_be_bytes([t[4], t[5], t[6], t[7]]);
            // Same header length, ACK, flags (but PSH), window and options.
            if seq != self.next_seq
                || headers - IPV4_HDR != usize::from(f[12] >> 4) * 4
                || t[8..13] != f[8..13]
                || (t[13] & !TCP_PSH) != (f[13] & !TCP_PSH)
                || t[14..16] != f[14..16]
                || t[20..] != f[20..headers - IPV4_HDR]
            {
                return false;
            }
            self.next_seq = seq.wrapping_add(payload as u32);
            if t[13] & TCP_PSH != 0 {
                let at = VNET_HDR_LEN + IPV4_HDR + 13;
                self.buf[at] |= TCP_PSH;
                self.closed = true;
            }
        }
        self.buf.extend_from_slice(&ip[headers..]);
        self.segs += 1;
        if payload < self.seg_size {
            self.closed = true;
        }
        true
    }

    /// The batch as one packet to write (virtio header first), and empties the coalescer. One
    /// packet comes back exactly as it was pushed; several come back as a GSO packet.
    pub fn finish(&mut self) -> &[u8] {
        let segs = std::mem::take(&mut self.segs);
        if segs > 1 {
            let proto = self.proto;
            let pkt = &mut self.buf[VNET_HDR_LEN..];
            let ip_len = pkt.len();
            let l4_len = ip_len - IPV4_HDR;
            pkt[2..4].copy_from_slice(&(ip_len as u16).to_be_bytes());
            pkt[10..12].fill(0);
            let ip_sum = !fold(sum16(&pkt[..IPV4_HDR]));
            pkt[10..12].copy_from_slice(&ip_sum.to_be_bytes());
            let (check_at, headers, gso_type) = if proto == PROTO_UDP {
                pkt[IPV4_HDR + 4..IPV4_HDR + 6].copy_from_slice(&(l4_len as u16).to_be_bytes());
                (6, IPV4_HDR + 8, GSO_UDP_L4)
            } else {
                (16, IPV4_HDR + usize::from(pkt[IPV4_HDR + 12] >> 4) * 4, GSO_TCPV4)
            };
            let pseudo = fold(sum16(&pkt[12..20]) + u32::from(proto) + l4_len as u32);
            pkt[IPV4_HDR + check_at..IPV4_HDR + check_at + 2].copy_from_slice(&pseudo.to_be_bytes());
            VnetHdr {
                flags: F_NEEDS_CSUM,
                gso_type,
                hdr_len: headers as u16,
                gso_size: self.seg_size as u16,
                csum_start: IPV4_HDR as u16,
                csum_offset: check_at as u16,
            }
            .write(&mut self.buf);
        }
        &self.buf
    }
}

/// Whether `pkt` may be coalesced at all: (protocol, header bytes, payload bytes).
fn eligible(pkt: &[u8]) -> Option<(u8, usize, usize)> {
    let hdr = VnetHdr::parse(pkt)?;
    let ip = &pkt[VNET_HDR_LEN..];
    if hdr.gso_type != GSO_NONE
        || hdr.flags & F_NEEDS_CSUM == 0
        || usize::from(hdr.csum_start) != IPV4_HDR
        || ip.len() < IPV4_HDR + 8
        || ip[0] != 0x45
        || u16::from_be_bytes([ip[2], ip[3]]) as usize != ip.len()
        || u16::from_be_bytes([ip[6], ip[7]]) & 0x3fff != 0
    {
        return None;
    }
    let headers = match ip[9] {
        PROTO_UDP if hdr.csum_offset == 6 => IPV4_HDR + 8,
        PROTO_TCP if hdr.csum_offset == 16 && ip.len() >= IPV4_HDR + 20 => {
            let t = &ip[IPV4_HDR..];
            // ACK, optionally PSH; nothing else.
            if t[13] & !TCP_PSH != 0x10 {
                return None;
            }
            IPV4_HDR + usize::from(t[12] >> 4) * 4
        }
        _ => return None,
    };
    let payload = ip.len().checked_sub(headers).filter(|&p| p > 0)?;
    Some((ip[9], headers, payload))
}

/// The ones'-complement sum of `b` as big-endian 16-bit words (an odd last byte is padded).
fn sum16(b: &[u8]) -> u32 {
    let mut s = 0u32;
    let mut chunks = b.chunks_exact(2);
    for c in &mut chunks {
        s += u32::from(u16::from_be_bytes([c[0], c[1]]));
    }
    if let [last] = chunks.remainder() {
        s += u32::from(*last) << 8;
    }
    s
}

fn fold(mut s: u32) -> u16 {
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    s as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    const SRC: [u8; 4] = [198, 18, 0, 1];
    const DST: [u8; 4] = [198, 18, 0, 2];

    /// A GSO packet as the kernel hands it to a TUN with TSO/USO: one IPv4 header, one L4
    /// header, `payload` bytes, the partial checksum of the whole.
    fn gso_packet(proto: u8, gso_type: u8, gso_size: u16, payload: &[u8], tcp_flags: u8) -> Vec<u8> {
        let l4_hdr = if proto == PROTO_TCP { 20 } else { 8 };
        let ip_len = 20 + l4_hdr + payload.len();
        let mut ip = vec![0u8; ip_len];
        ip[0] = 0x45;
        ip[2..4].copy_from_slice(&(ip_len.min(0xffff) as u16).to_be_bytes());
        ip[4..6].copy_from_slice(&0xfffeu16.to_be_bytes());
        ip[6] = 0x40; // DF
        ip[8] = 64;
        ip[9] = proto;
        ip[12..16].copy_from_slice(&SRC);
        ip[16..20].copy_from_slice(&DST);
        let l4 = &mut ip[20..];
        l4[0..2].copy_from_slice(&4433u16.to_be_bytes());
        l4[2..4].copy_from_slice(&51000u16.to_be_bytes());
        if proto == PROTO_TCP {
            l4[4..8].copy_from_slice(&0xffff_ff00u32.to_be_bytes()); // wraps within the packet
            l4[12] = 5 << 4;
            l4[13] = tcp_flags;
        } else {
            l4[4..6].copy_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
        }
        ip[20 + l4_hdr..].copy_from_slice(payload);
        let ip_sum = !fold(sum16(&ip[..20]));
        ip[10..12].copy_from_slice(&ip_sum.to_be_bytes());
        let check_at = 20 + if proto == PROTO_TCP { 16 } else { 6 };
        let pseudo = fold(sum16(&SRC) + sum16(&DST) + u32::from(proto) + (ip_len - 20) as u32);
        ip[check_at..check_at + 2].copy_from_slice(&pseudo.to_be_bytes());
        let hdr = VnetHdr {
            flags: F_NEEDS_CSUM,
            gso_type,
            hdr_len: (20 + l4_hdr) as u16,
            gso_size,
            csum_start: 20,
            csum_offset: if proto == PROTO_TCP { 16 } else { 6 },
        };
        let mut out = vec![0u8; VNET_HDR_LEN];
        hdr.write(&mut out);
        out.extend_from_slice(&ip);
        out
    }

    fn payload(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 31 % 251) as u8).collect()
    }

    /// Finishes a partial checksum the way a NIC would and checks the packet then verifies:
    /// the sum over pseudo-header and L4 bytes is all ones.
    fn assert_l4_checksum_completes(seg: &[u8]) {
        let hdr = VnetHdr::parse(seg).unwrap();
        assert_eq!(hdr.flags, F_NEEDS_CSUM);
        assert_eq!(hdr.gso_type, GSO_NONE);
        let mut ip = seg[VNET_HDR_LEN..].to_vec();
        let start = usize::from(hdr.csum_start);
        let at = start + usize::from(hdr.csum_offset);
        let full = !fold(sum16(&ip[start..]));
        ip[at..at + 2].copy_from_slice(&full.to_be_bytes());
        let l4_len = (ip.len() - start) as u32;
        let (proto, addrs) = if ip[0] >> 4 == 6 { (ip[6], &ip[8..40]) } else { (ip[9], &ip[12..20]) };
        let verify = fold(sum16(addrs) + u32::from(proto) + l4_len + sum16(&ip[start..]));
        assert_eq!(verify, 0xffff, "L4 checksum does not verify");
        if ip[0] >> 4 == 4 {
            assert_eq!(fold(sum16(&ip[..20])), 0xffff, "IPv4 header checksum does not verify");
        }
    }

    fn cut(pkt: &[u8]) -> Vec<Vec<u8>> {
        let s = Segments::new(pkt).unwrap();
        (0..s.count())
            .map(|i| {
                let mut out = vec![0u8; 2048];
                let n = s.write(i, &mut out).unwrap();
                assert_eq!(n, VNET_HDR_LEN + s.wire_len(i));
                out.truncate(n);
                out
            })
            .collect()
    }

    fn coalesce(segs: &[Vec<u8>]) -> Vec<Vec<u8>> {
        let mut c = Coalescer::new();
        let mut out = Vec::new();
        for s in segs {
            if !c.push(s) {
                out.push(c.finish().to_vec());
                if !c.push(s) {
                    out.push(s.clone());
                }
            }
        }
        if !c.is_empty() {
            out.push(c.finish().to_vec());
        }
        out
    }

    #[test]
    fn cut_then_coalesced_is_the_send_again() {
        for (proto, kind, seg, n, flags) in [
            (PROTO_UDP, GSO_UDP_L4, 1350u16, 1350 * 9 + 100, 0u8),
            (PROTO_UDP, GSO_UDP_L4, 1200, 1200 * 4, 0),
            (PROTO_TCP, GSO_TCPV4, 1448, 1448 * 6, 0x10 | TCP_PSH),
            (PROTO_TCP, GSO_TCPV4, 1448, 1448 * 3 + 5, 0x10),
        ] {
            let send = gso_packet(proto, kind, seg, &payload(n), flags);
            let back = coalesce(&cut(&send));
            assert_eq!(back.len(), 1, "proto {proto}: one packet back");
            let (b, s) = (&back[0], &send);
            assert_eq!(VnetHdr::parse(b).unwrap(), VnetHdr::parse(s).unwrap(), "proto {proto}: header");
            assert_eq!(b[VNET_HDR_LEN..], s[VNET_HDR_LEN..], "proto {proto}: packet");
        }
    }

    #[test]
    fn one_packet_is_written_as_it_came() {
        let segs = cut(&gso_packet(PROTO_UDP, GSO_UDP_L4, 1350, &payload(900), 0));
        assert_eq!(coalesce(&segs), segs);
    }

    #[test]
    fn what_breaks_a_batch() {
        let udp = cut(&gso_packet(PROTO_UDP, GSO_UDP_L4, 1000, &payload(4000), 0));
        // A shorter datagram ends a batch; the next full one starts another.
        let short = cut(&gso_packet(PROTO_UDP, GSO_UDP_L4, 1000, &payload(500), 0));
        let seq = [udp[0].clone(), short[0].clone(), udp[1].clone()];
        let out = coalesce(&seq);
        assert_eq!(out.len(), 2);
        assert_eq!(VnetHdr::parse(&out[0]).unwrap().gso_type, GSO_UDP_L4);
        assert_eq!(out[1], udp[1]);
        // Another flow (port), a larger datagram, a non-GSO-able packet.
        let mut other = udp[1].clone();
        other[VNET_HDR_LEN + 21] ^= 1;
        assert_eq!(coalesce(&[udp[0].clone(), other.clone()]).len(), 2);
        let big = cut(&gso_packet(PROTO_UDP, GSO_UDP_L4, 1200, &payload(1200), 0));
        assert_eq!(coalesce(&[short[0].clone(), big[0].clone()]).len(), 2);
        let mut plain = udp[0].clone();
        plain[0] = 0; // no partial checksum: not from a checksumming device
        assert!(!Coalescer::new().push(&plain));
        // TCP: a gap in sequence, and a packet after a PSH.
        let tcp = cut(&gso_packet(PROTO_TCP, GSO_TCPV4, 1448, &payload(1448 * 4), 0x10 | TCP_PSH));
        assert_eq!(coalesce(&[tcp[0].clone(), tcp[2].clone()]).len(), 2, "a sequence gap");
        let mut psh = tcp[1].clone();
        psh[VNET_HDR_LEN + 33] |= TCP_PSH;
        let out = coalesce(&[tcp[0].clone(), psh, tcp[2].clone()]);
        assert_eq!(out.len(), 2, "PSH ends a batch");
        let mut syn = tcp[0].clone();
        syn[VNET_HDR_LEN + 33] |= 0x02;
        assert!(!Coalescer::new().push(&syn), "only ACK/PSH segments coalesce");
        // A full batch of MAX_COALESCED.
        let many = cut(&gso_packet(PROTO_UDP, GSO_UDP_L4, 100, &payload(100 * (MAX_COALESCED + 1)), 0));
        let out = coalesce(&many);
        assert_eq!(out.len(), 2);
        assert_eq!(out[1], many[MAX_COALESCED]);
    }

    #[test]
    fn a_plain_packet_passes_through_unchanged() {
        let mut pkt = gso_packet(PROTO_UDP, GSO_NONE, 0, &payload(1200), 0);
        pkt[VNET_HDR_LEN + 30] ^= 0x5a; // whatever it holds, it is copied as it is
        let segs = cut(&pkt);
        assert_eq!(segs, vec![pkt.clone()]);
        assert_eq!(Segments::new(&pkt).unwrap().wire_len(0), pkt.len() - VNET_HDR_LEN);
    }

    #[test]
    fn udp_gso_becomes_datagrams_of_the_segment_size() {
        let data = payload(1350 * 9 + 100);
        let pkt = gso_packet(PROTO_UDP, GSO_UDP_L4, 1350, &data, 0);
        let segs = cut(&pkt);
        assert_eq!(segs.len(), 10);
        let mut joined = Vec::new();
        for (i, s) in segs.iter().enumerate() {
            let ip = &s[VNET_HDR_LEN..];
            let body = if i < 9 { 1350 } else { 100 };
            assert_eq!(ip.len(), 28 + body);
            assert_eq!(u16::from_be_bytes([ip[2], ip[3]]) as usize, ip.len());
            assert_eq!(u16::from_be_bytes([ip[4], ip[5]]), 0xfffeu16.wrapping_add(i as u16));
            assert_eq!(u16::from_be_bytes([ip[24], ip[25]]) as usize, 8 + body, "UDP length");
            assert_eq!(&ip[..2], &[0x45, 0], "IP version and TOS kept");
            assert_eq!(&ip[12..24], &pkt[VNET_HDR_LEN + 12..VNET_HDR_LEN + 24], "addresses and ports kept");
            assert_l4_checksum_completes(s);
            joined.extend_from_slice(&ip[28..]);
        }
        assert_eq!(joined, data);
    }

    #[test]
    fn tcp_tso_advances_sequence_and_keeps_fin_psh_last_cwr_first() {
        let data = payload(1448 * 4);
        let flags = 0x10 | TCP_PSH | TCP_FIN | TCP_CWR; // ACK, PSH, FIN, CWR
        let pkt = gso_packet(PROTO_TCP, GSO_TCPV4 | GSO_ECN, 1448, &data, flags);
        let segs = cut(&pkt);
        assert_eq!(segs.len(), 4);
        let mut joined = Vec::new();
        for (i, s) in segs.iter().enumerate() {
            let ip = &s[VNET_HDR_LEN..];
            let tcp = &ip[20..];
            let seq = u32::from_be_bytes([tcp[4], tcp[5], tcp[6], tcp[7]]);
            assert_eq!(seq, 0xffff_ff00u32.wrapping_add(1448 * i as u32));
            let f = tcp[13];
            assert_eq!(f & 0x10, 0x10, "ACK on every segment");
            assert_eq!(f & (TCP_FIN | TCP_PSH) != 0, i == 3, "FIN/PSH only on the last");
            assert_eq!(f & TCP_CWR != 0, i == 0, "CWR only on the first");
            assert_l4_checksum_completes(s);
            joined.extend_from_slice(&tcp[20..]);
        }
        assert_eq!(joined, data);
    }

    #[test]
    fn a_gso_packet_of_one_segment_is_one_packet() {
        let data = payload(500);
        let pkt = gso_packet(PROTO_UDP, GSO_UDP_L4, 1350, &data, 0);
        let segs = cut(&pkt);
        assert_eq!(segs.len(), 1);
        assert_eq!(&segs[0][VNET_HDR_LEN + 28..], &data[..]);
        assert_l4_checksum_completes(&segs[0]);
    }

    #[test]
    fn malformed_gso_packets_are_refused() {
        let good = gso_packet(PROTO_UDP, GSO_UDP_L4, 1350, &payload(3000), 0);
        assert_eq!(Segments::new(&good[..5]).unwrap_err(), SegmentError::Truncated);
        assert_eq!(Segments::new(&good[..VNET_HDR_LEN + 24]).unwrap_err(), SegmentError::Truncated);
        let mut wrong = good.clone();
        wrong[1] = GSO_TCPV4; // a UDP packet claiming TSO
        assert_eq!(Segments::new(&wrong).unwrap_err(), SegmentError::Unsupported);
        let mut v5 = good.clone();
        v5[VNET_HDR_LEN] = 0x55;
        assert_eq!(Segments::new(&v5).unwrap_err(), SegmentError::Unsupported);
        let mut tcp6 = udp6_gso_packet(1200, &payload(3000));
        tcp6[1] = GSO_TCPV4;
        assert_eq!(
            Segments::new(&tcp6).unwrap_err(),
            SegmentError::Unsupported,
            "TSO over IPv6 is not offered"
        );
        let mut zero = good.clone();
        zero[4..6].fill(0);
        assert_eq!(Segments::new(&zero).unwrap_err(), SegmentError::ZeroSegmentSize);
        let s = Segments::new(&good).unwrap();
        assert_eq!(s.write(0, &mut [0u8; 100]), None, "a buffer too small is refused, not overrun");
    }

    /// A UDP GSO packet over IPv6 (the device offers USO for both versions at once).
    fn udp6_gso_packet(gso_size: u16, payload: &[u8]) -> Vec<u8> {
        let l4_len = 8 + payload.len();
        let mut ip = vec![0u8; 40 + l4_len];
        ip[0] = 0x60;
        ip[4..6].copy_from_slice(&(l4_len as u16).to_be_bytes());
        ip[6] = PROTO_UDP;
        ip[7] = 64;
        ip[8] = 0xfd;
        ip[23] = 1;
        ip[24] = 0xfd;
        ip[39] = 2;
        ip[40..42].copy_from_slice(&4433u16.to_be_bytes());
        ip[42..44].copy_from_slice(&51000u16.to_be_bytes());
        ip[44..46].copy_from_slice(&(l4_len as u16).to_be_bytes());
        ip[48..].copy_from_slice(payload);
        let hdr = VnetHdr {
            flags: F_NEEDS_CSUM,
            gso_type: GSO_UDP_L4,
            hdr_len: 48,
            gso_size,
            csum_start: 40,
            csum_offset: 6,
        };
        let mut out = vec![0u8; VNET_HDR_LEN];
        hdr.write(&mut out);
        out.extend_from_slice(&ip);
        out
    }

    #[test]
    fn udp_gso_over_ipv6_is_cut_too() {
        let data = payload(1200 * 2 + 7);
        let segs = cut(&udp6_gso_packet(1200, &data));
        assert_eq!(segs.len(), 3);
        let mut joined = Vec::new();
        for (i, s) in segs.iter().enumerate() {
            let ip = &s[VNET_HDR_LEN..];
            let body = if i < 2 { 1200 } else { 7 };
            assert_eq!(u16::from_be_bytes([ip[4], ip[5]]) as usize, 8 + body, "IPv6 payload length");
            assert_eq!(u16::from_be_bytes([ip[44], ip[45]]) as usize, 8 + body, "UDP length");
            assert_l4_checksum_completes(s);
            joined.extend_from_slice(&ip[48..]);
        }
        assert_eq!(joined, data);
    }

    #[test]
    fn the_header_round_trips() {
        let h =
            VnetHdr { flags: 1, gso_type: 5, hdr_len: 28, gso_size: 1350, csum_start: 20, csum_offset: 6 };
        let mut b = [0u8; VNET_HDR_LEN];
        h.write(&mut b);
        assert_eq!(VnetHdr::parse(&b), Some(h));
    }
}

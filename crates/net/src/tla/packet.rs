//! IPv4/TCP packets as TLA sees them on its TUN devices: parsing, building,
//! and the Internet checksums.
//!
//! Owns the byte layout of an IPv4 header (no options are emitted; incoming
//! options are skipped) and of a TCP header with its options, and the one's
//! complement checksums of RFC 791/793 (the TCP one over the IPv4
//! pseudo-header). Must never panic on bad input: every malformed packet is a
//! [`PacketError`]; never emit a packet whose checksums are not recomputed.

use std::net::Ipv4Addr;

use bytes::Bytes;

/// TCP flag FIN.
pub const FIN: u8 = 0x01;
/// TCP flag SYN.
pub const SYN: u8 = 0x02;
/// TCP flag RST.
pub const RST: u8 = 0x04;
/// TCP flag PSH.
pub const PSH: u8 = 0x08;
/// TCP flag ACK.
pub const ACK: u8 = 0x10;

/// IP protocol number of TCP.
const PROTO_TCP: u8 = 6;

/// Why a packet was not parsed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PacketError {
    /// Shorter than its headers say.
    #[error("truncated packet: {0}")]
    Truncated(&'static str),
    /// Not IPv4 (TLA routes IPv4 only).
    #[error("not an IPv4 packet (version {0})")]
    NotIpv4(u8),
    /// IPv4 but not TCP (routed unchanged).
    #[error("IP protocol {0}, not TCP")]
    NotTcp(u8),
    /// A fragment (TLA does not reassemble; TUN peers use path MTU).
    #[error("an IPv4 fragment")]
    Fragment,
    /// A header field is impossible.
    #[error("bad header: {0}")]
    Bad(&'static str),
}

/// One TCP segment in an IPv4 packet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Source address.
    pub src: Ipv4Addr,
    /// Destination address.
    pub dst: Ipv4Addr,
    /// Source port.
    pub sport: u16,
    /// Destination port.
    pub dport: u16,
    /// Sequence number.
    pub seq: u32,
    /// Acknowledgement number (meaningful with [`ACK`]).
    pub ack: u32,
    /// Flags (FIN, SYN, RST, PSH, ACK, ...).
    pub flags: u8,
    /// Advertised window (unscaled field).
    pub window: u16,
    /// Raw TCP options (a multiple of 4 bytes when built).
    pub options: Vec<u8>,
    /// Payload.
    pub payload: Bytes,
}

impl Segment {
    /// True when `flag` is set.
    pub fn has(&self, flag: u8) -> bool {
        self.flags & flag != 0
    }

    /// Sequence space the segment occupies (payload, plus one for SYN and FIN).
    pub fn seq_len(&self) -> u32 {
        self.payload.len() as u32 + u32::from(self.has(SYN)) + u32::from(self.has(FIN))
    }
}

/// The one's complement sum of `data` folded into 16 bits, starting from
/// `acc` (not yet complemented).
fn sum16(mut acc: u32, data: &[u8]) -> u32 {
    let mut chunks = data.chunks_exact(2);
    for c in &mut chunks {
        acc += u32::from(u16::from_be_bytes([c[0], c[1]]));
    }
    if let [last] = chunks.remainder() {
        acc += u32::from(*last) << 8;
    }
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    acc
}

/// The Internet checksum of `data` (RFC 1071).
pub fn checksum(data: &[u8]) -> u16 {
    !(sum16(0, data) as u16)
}

/// The TCP checksum of `tcp` (header with a zero checksum field, and payload)
/// between `src` and `dst`.
pub fn tcp_checksum(src: Ipv4Addr, dst: Ipv4Addr, tcp: &[u8]) -> u16 {
    let mut pseudo = [0u8; 12];
    pseudo[..4].copy_from_slice(&src.octets());
    pseudo[4..8].copy_from_slice(&dst.octets());
    pseudo[9] = PROTO_TCP;
    pseudo[10..12].copy_from_slice(&(tcp.len() as u16).to_be_bytes());
    !(sum16(sum16(0, &pseudo), tcp) as u16)
}

/// The IP version of a packet (first nibble), if any.
pub fn version(pkt: &[u8]) -> Option<u8> {
    pkt.first().map(|b| b >> 4)
}

/// Parses an IPv4 packet carrying TCP.
///
/// Fails with NotIpv4 / NotTcp for other packets (the caller routes them
/// unchanged), Truncated / Bad / Fragment for malformed ones. Checksums are
/// not verified (the kernel verifies what TLA writes).
pub fn parse(pkt: &[u8]) -> Result<Segment, PacketError> {
    let v = version(pkt).ok_or(PacketError::Truncated("empty"))?;
    if v != 4 {
        return Err(PacketError::NotIpv4(v));
    }
    if pkt.len() < 20 {
        return Err(PacketError::Truncated("IPv4 header"));
    }
    let ihl = usize::from(pkt[0] & 0x0f) * 4;
    if ihl < 20 {
        return Err(PacketError::Bad("IPv4 header length"));
    }
    let total = usize::from(u16::from_be_bytes([pkt[2], pkt[3]]));
    if total < ihl || pkt.len() < total {
        return Err(PacketError::Truncated("IPv4 total length"));
    }
    let frag = u16::from_be_bytes([pkt[6], pkt[7]]);
    if frag & 0x3fff != 0 {
        return Err(PacketError::Fragment);
    }
    if pkt[9] != PROTO_TCP {
        return Err(PacketError::NotTcp(pkt[9]));
    }
    let src = Ipv4Addr::new(pkt[12], pkt[13], pkt[14], pkt[15]);
    let dst = Ipv4Addr::new(pkt[16], pkt[17], pkt[18], pkt[19]);
    let t = &pkt[ihl..total];
    if t.len() < 20 {
        return Err(PacketError::Truncated("TCP header"));
    }
    let off = usize::from(t[12] >> 4) * 4;
    if off < 20 || off > t.len() {
        return Err(PacketError::Bad("TCP data offset"));
    }
    Ok(Segment {
        src,
        dst,
        sport: u16::from_be_bytes([t[0], t[1]]),
        dport: u16::from_be_bytes([t[2], t[3]]),
        seq: u32::from_be_bytes([t[4], t[5], t[6], t[7]]),
        ack: u32::from_be_bytes([t[8], t[9], t[10], t[11]]),
        flags: t[13],
        window: u16::from_be_bytes([t[14], t[15]]),
        options: t[20..off].to_vec(),
        payload: Bytes::copy_from_slice(&t[off..]),
    })
}

/// Builds the IPv4 packet of `seg`, with both checksums computed.
///
/// Fails with Bad when the options are longer than 40 bytes or the packet
/// longer than 65535 bytes.
pub fn build(seg: &Segment) -> Result<Vec<u8>, PacketError> {
    let opt_len = seg.options.len().div_ceil(4) * 4;
    if opt_len > 40 {
        return Err(PacketError::Bad("TCP options past 40 bytes"));
    }
    let tcp_len = 20 + opt_len + seg.payload.len();
    let total = 20 + tcp_len;
    if total > usize::from(u16::MAX) {
        return Err(PacketError::Bad("packet past 65535 bytes"));
    }
    let mut p = vec![0u8; total];
    p[0] = 0x45;
    p[2..4].copy_from_slice(&(total as u16).to_be_bytes());
    p[6] = 0x40; // don't fragment
    p[8] = 64;
    p[9] = PROTO_TCP;
    p[12..16].copy_from_slice(&seg.src.octets());
    p[16..20].copy_from_slice(&seg.dst.octets());
    let c = checksum(&p[..20]);
    p[10..12].copy_from_slice(&c.to_be_bytes());
    let t = &mut p[20..];
    t[0..2].copy_from_slice(&seg.sport.to_be_bytes());
    t[2..4].copy_from_slice(&seg.dport.to_be_bytes());
    t[4..8].copy_from_slice(&seg.seq.to_be_bytes());
    t[8..12].copy_from_slice(&seg.ack.to_be_bytes());
    t[12] = (((20 + opt_len) / 4) as u8) << 4;
    t[13] = seg.flags;
    t[14..16].copy_from_slice(&seg.window.to_be_bytes());
    t[20..20 + seg.options.len()].copy_from_slice(&seg.options);
    // Padding: end-of-options (0) bytes, already zero.
    t[20 + opt_len..].copy_from_slice(&seg.payload);
    let c = tcp_checksum(seg.src, seg.dst, t);
    t[16..18].copy_from_slice(&c.to_be_bytes());
    Ok(p)
}

/// TCP options TLA understands in a SYN.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SynOptions {
    /// Maximum segment size the sender can receive.
    pub mss: Option<u16>,
    /// Window scale shift.
    pub wscale: Option<u8>,
}

/// Reads the MSS and window scale of a SYN's options; other options
/// (timestamps, SACK) are dropped by TLA (their values would need remapping).
pub fn syn_options(opts: &[u8]) -> SynOptions {
    let mut o = SynOptions::default();
    let mut i = 0;
    while i < opts.len() {
        match opts[i] {
            0 => break,
            1 => i += 1,
            kind => {
                let Some(&len) = opts.get(i + 1) else { break };
                let len = usize::from(len);
                if len < 2 || i + len > opts.len() {
                    break;
                }
                let v = &opts[i + 2..i + len];
                match (kind, v.len()) {
                    (2, 2) => o.mss = Some(u16::from_be_bytes([v[0], v[1]])),
                    (3, 1) => o.wscale = Some(v[0].min(14)),
                    _ => {}
                }
                i += len;
            }
        }
    }
    o
}

/// Encodes `o` as TCP options (MSS, then NOP + window scale).
pub fn encode_syn_options(o: SynOptions) -> Vec<u8> {
    let mut v = Vec::new();
    if let Some(m) = o.mss {
        v.extend_from_slice(&[2, 4]);
        v.extend_from_slice(&m.to_be_bytes());
    }
    if let Some(w) = o.wscale {
        v.extend_from_slice(&[1, 3, 3, w]);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn seg(payload: &[u8]) -> Segment {
        Segment {
            src: Ipv4Addr::new(10, 77, 0, 2),
            dst: Ipv4Addr::new(10, 77, 0, 1),
            sport: 40000,
            dport: 7000,
            seq: 0xdead_beef,
            ack: 17,
            flags: ACK | PSH,
            window: 512,
            options: vec![],
            payload: Bytes::copy_from_slice(payload),
        }
    }

    #[test]
    fn rfc1071_example_checksum() {
        // RFC 1071 section 3's example sums to 0xddf2.
        let d = [0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7];
        assert_eq!(checksum(&d), !0xddf2);
    }

    #[test]
    fn a_built_syn_verifies_as_a_receiver_checks_it() {
        // A receiver sums the whole header (and the TCP segment with its
        // pseudo-header) and expects all ones.
        let s = Segment {
            src: Ipv4Addr::new(10, 0, 0, 1),
            dst: Ipv4Addr::new(10, 0, 0, 2),
            sport: 45678,
            dport: 80,
            seq: 1,
            ack: 0,
            flags: SYN,
            window: 64240,
            options: encode_syn_options(SynOptions {
                mss: Some(1460),
                wscale: Some(7),
            }),
            payload: Bytes::new(),
        };
        let p = build(&s).unwrap();
        // Whole IPv4 header and whole TCP segment (with pseudo-header) verify.
        assert_eq!(sum16(0, &p[..20]), 0xffff);
        let t = &p[20..];
        let mut pseudo = [0u8; 12];
        pseudo[..4].copy_from_slice(&s.src.octets());
        pseudo[4..8].copy_from_slice(&s.dst.octets());
        pseudo[9] = 6;
        pseudo[10..12].copy_from_slice(&(t.len() as u16).to_be_bytes());
        assert_eq!(sum16(sum16(0, &pseudo), t), 0xffff);
        assert_eq!(parse(&p).unwrap(), s);
    }

    #[test]
    fn non_tcp_and_malformed_packets_are_refused_precisely() {
        let mut p = build(&seg(b"hi")).unwrap();
        assert_eq!(parse(&[]), Err(PacketError::Truncated("empty")));
        assert_eq!(parse(&[0x60, 0, 0, 0]), Err(PacketError::NotIpv4(6)));
        assert_eq!(parse(&p[..19]), Err(PacketError::Truncated("IPv4 header")));
        assert_eq!(
            parse(&p[..30]),
            Err(PacketError::Truncated("IPv4 total length"))
        );
        p[9] = 1;
        assert_eq!(parse(&p), Err(PacketError::NotTcp(1)));
        p[9] = 6;
        p[6] = 0x20; // more fragments
        assert_eq!(parse(&p), Err(PacketError::Fragment));
        p[6] = 0x40;
        p[32] = 0x10; // TCP data offset 4 words
        assert_eq!(parse(&p), Err(PacketError::Bad("TCP data offset")));
    }

    #[test]
    fn syn_options_skip_what_tla_does_not_keep() {
        // MSS 1460, SACK permitted, timestamps, NOP, window scale 7.
        let opts = [
            2, 4, 0x05, 0xb4, 4, 2, 8, 10, 0, 0, 0, 1, 0, 0, 0, 0, 1, 3, 3, 7,
        ];
        let o = syn_options(&opts);
        assert_eq!(o.mss, Some(1460));
        assert_eq!(o.wscale, Some(7));
        assert_eq!(syn_options(&encode_syn_options(o)), o);
        // A truncated option ends the parse without panicking.
        assert_eq!(syn_options(&[2, 4, 5]), SynOptions::default());
        assert_eq!(syn_options(&[3, 0]), SynOptions::default());
    }

    proptest! {
        #[test]
        fn build_then_parse_is_identity_and_checksums_verify(
            payload in proptest::collection::vec(any::<u8>(), 0..1500),
            seq in any::<u32>(), ack in any::<u32>(), flags in any::<u8>(),
            window in any::<u16>(), nopts in 0usize..=10,
        ) {
            let mut s = seg(&payload);
            s.seq = seq;
            s.ack = ack;
            s.flags = flags;
            s.window = window;
            s.options = vec![1; nopts * 4];
            let p = build(&s).unwrap();
            prop_assert_eq!(sum16(0, &p[..20]), 0xffff);
            let mut t = p[20..].to_vec();
            let c = u16::from_be_bytes([t[16], t[17]]);
            t[16] = 0;
            t[17] = 0;
            prop_assert_eq!(tcp_checksum(s.src, s.dst, &t), c);
            prop_assert_eq!(parse(&p).unwrap(), s);
        }

        #[test]
        fn parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = parse(&bytes);
            let _ = syn_options(&bytes);
        }
    }
}

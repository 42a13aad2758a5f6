//! 2CA, the two-connection architecture: a proxy logger between the peer and
//! the server. The peer connects to the proxy, the proxy to the server; the
//! proxy is its own weft node, and the paper's control connection is weft's:
//! the server's transaction calls the proxy's `net` service (TX_START,
//! TX_RESTART, the end of the transaction's bytes), which makes the proxy a
//! two-phase participant, and prepare/commit/abort arrive as weft's commit
//! protocol.
//!
//! The control messages and the parts of both ends that TLA shares are in
//! [`crate::control`] (re-exported here).
//!
//! Owns the framing of peer bytes on the proxy→server link ([`frame`]: each
//! chunk carries its position, so a replay after a restart cannot be
//! confused with bytes still in flight), the proxy ([`proxy::NetProxy`]) and
//! the server's side ([`server::ProxiedStream`]). The server→proxy direction
//! is raw bytes; positions in the control messages place them. Must never let the proxy send the peer a byte of a
//! transaction that did not commit.

pub mod proxy;
pub mod server;

pub use crate::control::{
    ConnInfo, ConnName, NetRecord, NetRequest, NetResponse, NET_RECORD_TAG, SERVICE,
};

/// The proxy→server framing: `[position: u64 LE][length: u32 LE][bytes]`.
pub mod frame {
    /// Header bytes.
    pub const HEADER: usize = 12;
    /// Largest payload of one frame.
    pub const MAX_PAYLOAD: usize = 64 * 1024;

    /// Encodes a frame header.
    pub fn header(pos: u64, len: usize) -> [u8; HEADER] {
        debug_assert!(len <= MAX_PAYLOAD);
        let mut h = [0u8; HEADER];
        h[..8].copy_from_slice(&pos.to_le_bytes());
        h[8..].copy_from_slice(&(len as u32).to_le_bytes());
        h
    }

    /// Decodes a header: position and length.
    ///
    /// Fails when the length is past [`MAX_PAYLOAD`].
    pub fn parse(h: &[u8; HEADER]) -> Result<(u64, usize), String> {
        let pos = u64::from_le_bytes(h[..8].try_into().expect("8 bytes"));
        let len = u32::from_le_bytes(h[8..].try_into().expect("4 bytes")) as usize;
        if len > MAX_PAYLOAD {
            return Err(format!("a {len}-byte frame (at most {MAX_PAYLOAD})"));
        }
        Ok((pos, len))
    }
}

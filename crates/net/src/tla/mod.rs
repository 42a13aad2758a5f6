//! TLA, the transport-level logger: the TCP connection stays end to end
//! between the peer and the server, and every IP packet passes through a
//! logger that holds the server's segments of a transaction until its
//! commit, acknowledges (and drops) the server's bytes of an aborted one,
//! re-sends the peer's bytes of an aborted transaction to its restart with
//! new sequence numbers, and remaps sequence and acknowledgement numbers in
//! both directions so that neither end sees the holes (seed 001 section
//! 2.1).
//!
//! - [`packet`]: IPv4/TCP parsing, building and checksums.
//! - [`conn`]: one connection's sans-IO core (segments in, segments out).
//!
//! Owns nothing of the transaction's outcome: it applies what weft decides.
//! Must never let the peer see a byte of a transaction that did not commit.

pub mod conn;
pub mod logger;
pub mod packet;
pub mod server;
pub mod tun;

//! weft's vocabulary: identifiers, status codes, the transaction context,
//! payloads, frames and their codec.
//!
//! Everything here is plain data and pure functions: no sockets, no files, no
//! clocks. The byte format is documented in `docs/wire.md` so that a client in
//! another language can speak it.

pub mod auth;
pub mod codec;
pub mod frame;
mod heads;
pub mod idhash;
pub mod ids;
pub mod payload;
pub mod status;
pub mod txctx;

pub use codec::{
    decode_exact, decode_frame, decode_frame_with, encode_frame, encode_frame_with, encode_message,
    encode_message_with, peek_kind, DecodeError, Integrity, Limits, MessageEncodeError,
    Reassembler, ReassemblyBudget, VarintError,
};
pub use frame::{
    Auth, Fragment, Frame, FrameKind, Goodbye, Heartbeat, Hello, Message, PeerRole, Port, Refused,
    Request, Response,
};
pub use idhash::{IdHasher, IdHashing, IdMap, IdSet};
pub use ids::{
    Address, GroupId, Incarnation, NodeId, ParseIdError, ServiceName, SubPath, Tid, Xid,
};
pub use payload::{EncodeError, LocalValue, Payload, PayloadError};
pub use status::{Failure, Status};
pub use txctx::{Baggage, BaggageItem, TxContext, TxReturn};

//! Fuzz target: the group protocol's message decoder (`weft_group::msg::GroupMsg`), as the
//! runtime decodes a payload that arrived on port GROUP from a peer node.
//!
//! Checked beyond "no panic":
//! - a decoded message re-encodes, the re-encoding decodes, and encoding is then stable
//!   (encode(decode(encode(m))) == encode(m));
//! - its retransmission copy encodes to the same bytes (bytes bodies are shared, not lost);
//! - the helpers the runtime calls on every message (`kind`, `needs_directory`,
//!   `needs_cluster`, `is_count`, `deferrable`) answer without panicking.
//! - a decoded message nests at most one `Batch` deep: deeper nesting would recurse once per
//!   level in the decoder (two bytes a level), which overflows a tokio worker's stack long
//!   before a message reaches its size limit (see `msg.rs`, "Batches do not nest").
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use weft_group::msg::GroupMsg;
use weft_wire::payload::{decode_postcard, encode_postcard};
use weft_wire::Payload;

fn encode(m: &GroupMsg) -> BytesMut {
    let mut out = BytesMut::new();
    encode_postcard(m, &mut out).expect("a decoded message encodes");
    out
}

fn batch_depth(m: &GroupMsg) -> usize {
    match m {
        GroupMsg::Batch(v) => 1 + v.iter().map(batch_depth).max().unwrap_or(0),
        _ => 0,
    }
}

fn check(data: &[u8]) {
    let direct = decode_postcard::<GroupMsg>(data);
    // The runtime's path: a bytes payload decoded as a GroupMsg.
    let via_payload = Payload::bytes(data.to_vec()).decode::<GroupMsg>();
    assert_eq!(
        direct.is_ok(),
        via_payload.is_ok(),
        "the two decode paths disagree"
    );
    let Ok(msg) = direct else {
        return;
    };
    assert!(
        batch_depth(&msg) <= 1,
        "a batch inside a batch was accepted"
    );
    let _ = (
        msg.kind(),
        msg.needs_directory(),
        msg.needs_cluster(),
        msg.is_count(),
        msg.deferrable(),
    );
    let once = encode(&msg);
    assert!(
        once.len() <= data.len() * 2 + 16,
        "re-encoding grew: {} from {}",
        once.len(),
        data.len()
    );
    let back: GroupMsg = decode_postcard(&once).expect("a re-encoded message decodes");
    assert_eq!(encode(&back), once, "encoding is not stable: {msg:?}");
    assert_eq!(
        encode(&msg.retransmission()),
        once,
        "the retransmission differs"
    );
}

fuzz_target!(|data: &[u8]| {
    check(data);
});

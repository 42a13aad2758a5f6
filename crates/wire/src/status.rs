//! Status codes: how every weft operation ends (T-Shoshin's failure semantics).
//!
//! Owns the numeric codes that travel on the wire and the [`Failure`] error that
//! carries one with a human-readable detail. Must never lose the distinction
//! between statuses (a timeout is not a dead host).

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

macro_rules! statuses {
    ($( $(#[$doc:meta])* $name:ident = $code:literal, $text:literal; )*) => {
        /// The outcome of an operation. `Ok` is success; every other value names
        /// one precise way of failing. Codes are stable: see `docs/wire.md`.
        #[derive(Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Status {
            $( $(#[$doc])* $name, )*
            /// A code this version does not know (sent by a newer peer).
            Other(u16),
        }

        impl Status {
            /// The wire code.
            pub fn code(self) -> u16 {
                match self {
                    $( Status::$name => $code, )*
                    Status::Other(c) => c,
                }
            }

            /// Maps a wire code to a status; unknown codes become [`Status::Other`].
            pub fn from_code(code: u16) -> Status {
                match code {
                    $( $code => Status::$name, )*
                    c => Status::Other(c),
                }
            }

            /// The status name as printed by the CLI and logs (`HostDead`, ...).
            pub fn name(self) -> &'static str {
                match self {
                    $( Status::$name => $text, )*
                    Status::Other(_) => "Other",
                }
            }

            /// Every known status, in code order.
            pub const ALL: &'static [Status] = &[ $( Status::$name, )* ];
        }
    };
}

statuses! {
    /// Success.
    Ok = 0, "Ok";
    /// The deadline passed before the operation completed.
    TimedOut = 1, "TimedOut";
    /// The destination node has no service by that name and instance.
    NoSuchService = 2, "NoSuchService";
    /// The destination node was declared dead by the failure detector (no
    /// heartbeat within the configured bound), or is unknown as alive.
    HostDead = 3, "HostDead";
    /// The destination process is gone while its host answers: connection
    /// refused or closed without a goodbye, or a same-host peer that exited.
    ProcDead = 4, "ProcDead";
    /// The request could not be understood: undecodable payload, wrong type,
    /// invalid argument.
    BadRequest = 5, "BadRequest";
    /// A group send found no members.
    NoMembers = 6, "NoMembers";
    /// The group communication was terminated or superseded.
    NoComm = 7, "NoComm";
    /// A bounded queue at the destination was full; nothing was delivered.
    NoBuffer = 8, "NoBuffer";
    /// The address is malformed or names a node nobody knows.
    AddrError = 9, "AddrError";
    /// The message does not match what the receiver expects (tag, type,
    /// incarnation).
    Mismatch = 10, "Mismatch";
    /// The cluster or group secret presented was wrong.
    WrongSecret = 11, "WrongSecret";
    /// No group by that id exists.
    NoSuchGroup = 12, "NoSuchGroup";
    /// A lock could not be obtained within the wait bound.
    LockConflict = 13, "LockConflict";
    /// The transaction aborted.
    Aborted = 14, "Aborted";
    /// No transaction by that id is known here.
    NoSuchTransaction = 15, "NoSuchTransaction";
    /// Only the node that created a transaction may commit it.
    NotCoordinator = 16, "NotCoordinator";
    /// The node is shutting down.
    ShuttingDown = 17, "ShuttingDown";
    /// An internal invariant failed (a bug); details in the log.
    Internal = 18, "Internal";
    /// The peer violated the wire protocol (malformed frame, handshake error).
    ProtocolError = 19, "ProtocolError";
    /// The request was refused (e.g. a node id already in use).
    Refused = 20, "Refused";
    /// The service handler returned an application-level error.
    AppError = 21, "AppError";
    /// The outcome of a commit is unknown to the caller (contact was lost
    /// after the commit request was sent).
    InDoubt = 22, "InDoubt";
    /// Temporarily unable to serve (no route yet, still recovering).
    Unavailable = 23, "Unavailable";
    /// The message is larger than the configured maximum message size.
    TooLarge = 24, "TooLarge";
}

impl Status {
    /// True for [`Status::Ok`].
    pub fn is_ok(self) -> bool {
        self == Status::Ok
    }

    /// Parses a status name as printed by [`Status::name`].
    pub fn from_name(name: &str) -> Option<Status> {
        Status::ALL.iter().copied().find(|s| s.name() == name)
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Status::Other(c) => write!(f, "Status({c})"),
            s => f.write_str(s.name()),
        }
    }
}

impl fmt::Debug for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl Serialize for Status {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u16(self.code())
    }
}

impl<'de> Deserialize<'de> for Status {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        u16::deserialize(d).map(Status::from_code)
    }
}

/// An operation that ended with a non-`Ok` status, plus what went wrong in words.
#[derive(Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[error("{status}: {detail}")]
pub struct Failure {
    /// The precise status.
    pub status: Status,
    /// Human-readable context (which node, which service, which limit).
    pub detail: String,
}

impl Failure {
    /// Builds a failure with a status and a detail message.
    pub fn new(status: Status, detail: impl Into<String>) -> Self {
        debug_assert!(status != Status::Ok, "a Failure must not carry Ok");
        Failure {
            status,
            detail: detail.into(),
        }
    }
}

impl fmt::Debug for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Failure({}: {})", self.status, self.detail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_are_unique() {
        let mut seen = std::collections::HashSet::new();
        for s in Status::ALL {
            assert!(seen.insert(s.code()), "duplicate code {}", s.code());
            assert_eq!(Status::from_code(s.code()), *s);
            assert_eq!(Status::from_name(s.name()), Some(*s));
        }
        assert_eq!(Status::from_code(999), Status::Other(999));
        assert_eq!(Status::Other(999).code(), 999);
    }
}

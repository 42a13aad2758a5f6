//! How PostgreSQL errors become weft statuses.
//!
//! Owns the mapping from a SQLSTATE (or a lost connection) to the precise [`Status`] a caller
//! sees, with the server's own message. Must never drop the server's message: it is what tells
//! the user what went wrong.

use tokio_postgres::error::SqlState;
use weft_wire::{Failure, Status};

use crate::client::describe_error;

/// The failure a statement's error becomes. `context` names the branch (`pg:bank t3.1.7`).
///
/// - BadRequest: the statement itself is wrong — syntax or access rule (class 42), data
///   exception (22), feature not supported (0A), or a client-side error (a parameter that does
///   not encode).
/// - LockConflict: deadlock detected (40P01) or lock not available (55P03).
/// - Unavailable: the connection to PostgreSQL was lost or the server is going away (08, 57P0x,
///   53).
/// - AppError: anything else the server refused (constraint violations, serialization failures,
///   raised exceptions...).
pub(crate) fn statement_failure(context: &str, error: &tokio_postgres::Error) -> Failure {
    let detail = format!("{context}: {}", describe_error(error));
    let Some(db) = error.as_db_error() else {
        let status = if error.is_closed() {
            Status::Unavailable
        } else {
            Status::BadRequest
        };
        return Failure::new(status, detail);
    };
    let code = db.code();
    let class = &code.code()[..2];
    let status =
        if *code == SqlState::T_R_DEADLOCK_DETECTED || *code == SqlState::LOCK_NOT_AVAILABLE {
            Status::LockConflict
        } else if matches!(class, "42" | "22" | "0A") {
            Status::BadRequest
        } else if matches!(class, "08" | "53" | "57") && *code != SqlState::QUERY_CANCELED {
            Status::Unavailable
        } else {
            Status::AppError
        };
    Failure::new(status, detail)
}

/// True when `error` is PostgreSQL's "prepared transaction with identifier ... does not exist".
pub(crate) fn is_unknown_gid(error: &tokio_postgres::Error) -> bool {
    error.code() == Some(&SqlState::UNDEFINED_OBJECT)
}

/// True when the statement was cancelled (by us, when the transaction aborted under it, or by a
/// statement timeout).
pub(crate) fn is_cancelled(error: &tokio_postgres::Error) -> bool {
    error.code() == Some(&SqlState::QUERY_CANCELED)
}

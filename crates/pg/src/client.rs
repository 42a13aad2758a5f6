//! Client connections to a [`TempPostgres`].
//!
//! Owns: opening a tokio-postgres connection (without TLS) to a temporary server and driving the
//! connection on its own task. Must never: hide connection errors, or be used against a server
//! other than a [`TempPostgres`] — production connections belong to the resource manager.

use tokio_postgres::{Client, NoTls};

use crate::server::TempPostgres;

/// Connects to database `db` of `server` over TCP as the superuser, without TLS.
///
/// The connection is driven by a task spawned on the current tokio runtime, so this must be
/// called from inside one; the task ends when the [`Client`] is dropped or the server goes away
/// (a connection error is logged at debug level, and later calls on the client fail).
///
/// # Errors
/// Returns the tokio-postgres error when the server refuses or cannot be reached within
/// ten seconds, or the database does not exist.
pub async fn connect(server: &TempPostgres, db: &str) -> Result<Client, tokio_postgres::Error> {
    let (client, connection) = server.client_config(db).connect(NoTls).await?;
    let port = server.port();
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::debug!(port, %error, "postgres connection ended with an error");
        }
    });
    Ok(client)
}

/// Renders a tokio-postgres error with the server's message, which the error's own `Display`
/// leaves out ("db error"): `ERROR 42P01: relation "t" does not exist (DETAIL: …; HINT: …)`.
/// Errors that did not come from the server are shown with their cause.
pub fn describe_error(error: &tokio_postgres::Error) -> String {
    if let Some(db) = error.as_db_error() {
        let mut text = format!("{} {}: {}", db.severity(), db.code().code(), db.message());
        let extra: Vec<String> = [("DETAIL", db.detail()), ("HINT", db.hint())]
            .into_iter()
            .filter_map(|(label, value)| value.map(|v| format!("{label}: {v}")))
            .collect();
        if !extra.is_empty() {
            text.push_str(&format!(" ({})", extra.join("; ")));
        }
        return text;
    }
    match std::error::Error::source(error) {
        Some(cause) => format!("{error}: {cause}"),
        None => error.to_string(),
    }
}

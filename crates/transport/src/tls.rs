//! TLS on TCP links: mutual TLS 1.3 with rustls (the `ring` provider), both
//! ends presenting a certificate signed by the cluster's CA.
//!
//! Owns the TLS settings ([`TlsConfig`], built from PEM files or bytes), the
//! TLS handshake of one TCP connection (before the weft handshake, which
//! then runs inside the TLS stream), and the words a refused end is given.
//! Must never read the environment, never let a byte from a connection whose
//! TLS handshake failed reach a link, and never accept a peer that presents
//! no certificate or one the CA did not sign.
//!
//! Identity: every certificate the cluster CA signed is a cluster
//! certificate. A connecting end checks that the accepting end's certificate
//! is valid for the name [`SERVER_NAME`] (`weft tls init` puts it in every
//! node certificate); which node it is remains the weft handshake's business
//! (the cluster secret and the Hello), as without TLS.

use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::BytesMut;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, Connection, RootCertStore, ServerConfig};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use weft_wire::{decode_frame, encode_frame, Frame, Limits, Refused, Status};

/// The DNS name every node certificate carries and every connecting end
/// checks.
pub const SERVER_NAME: &str = "weft-node";

/// The first byte of a TLS handshake record (a ClientHello starts with it).
pub(crate) const TLS_HANDSHAKE_BYTE: u8 = 0x16;

/// Most plaintext bytes rustls encrypts and holds for one link before they
/// go to the socket (the link's own queue holds the rest). Small, so a
/// large message leaves in slices of two records, each sent as soon as it
/// is sealed: the receiving end decrypts the first while this end seals
/// the next (with 256 KiB, a 1 MiB call's receiver waited for a quarter of
/// it to be sealed, and `weft bench rpc`'s TLS bulk figure was about a
/// tenth lower).
const TLS_BUFFER_LIMIT: usize = 32 << 10;

/// Why TLS settings could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM file could not be read or parsed.
    #[error("cannot read the {what} from {path}: {reason}")]
    File {
        /// Which file: certificate, key or CA.
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// The PEM held no usable item of the kind needed.
    #[error("no {0} found in the PEM given")]
    Missing(&'static str),
    /// rustls refused the certificate, key or CA (key not matching the
    /// certificate, CA not a valid certificate...).
    #[error("invalid TLS settings: {0}")]
    Invalid(String),
}

/// TLS settings of one node or client: its certificate chain and key, and
/// the cluster CA it trusts. Cheap to clone.
#[derive(Clone)]
pub struct TlsConfig {
    server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
}

impl std::fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TlsConfig { .. }")
    }
}

impl TlsConfig {
    /// Loads the certificate chain, private key and CA certificate(s) from
    /// PEM files.
    ///
    /// Fails with [`TlsError::File`] when a file cannot be read or parsed,
    /// [`TlsError::Missing`] or [`TlsError::Invalid`] as [`Self::from_pem`].
    pub fn from_files(cert: &Path, key: &Path, ca: &Path) -> Result<TlsConfig, TlsError> {
        let read = |what: &'static str, path: &Path| {
            std::fs::read(path).map_err(|e| TlsError::File {
                what,
                path: path.to_path_buf(),
                reason: e.to_string(),
            })
        };
        let (c, k, a) = (
            read("certificate", cert)?,
            read("private key", key)?,
            read("CA certificate", ca)?,
        );
        TlsConfig::from_pem(&c, &k, &a).map_err(|e| match e {
            TlsError::Missing(what) => TlsError::File {
                what,
                path: match what {
                    "certificate" => cert,
                    "private key" => key,
                    _ => ca,
                }
                .to_path_buf(),
                reason: "no such PEM item in the file".into(),
            },
            e => e,
        })
    }

    /// Builds the settings from PEM text: `cert` holds this end's
    /// certificate chain (leaf first), `key` its private key, `ca` the
    /// certificate(s) of the cluster CA.
    ///
    /// Fails with [`TlsError::Missing`] when a PEM holds no item of its
    /// kind, [`TlsError::Invalid`] when rustls refuses them (a key that does
    /// not match the certificate, say).
    pub fn from_pem(cert: &[u8], key: &[u8], ca: &[u8]) -> Result<TlsConfig, TlsError> {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert)
            .collect::<Result<_, _>>()
            .map_err(|e| TlsError::Invalid(format!("certificate PEM: {e}")))?;
        if certs.is_empty() {
            return Err(TlsError::Missing("certificate"));
        }
        let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| match e {
            rustls::pki_types::pem::Error::NoItemsFound => TlsError::Missing("private key"),
            e => TlsError::Invalid(format!("private key PEM: {e}")),
        })?;
        let mut roots = RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(ca) {
            let c = c.map_err(|e| TlsError::Invalid(format!("CA PEM: {e}")))?;
            roots
                .add(c)
                .map_err(|e| TlsError::Invalid(format!("CA certificate: {e}")))?;
        }
        if roots.is_empty() {
            return Err(TlsError::Missing("CA certificate"));
        }
        let roots = Arc::new(roots);
        // AES-128-GCM first: with AES-NI it is the cheapest per byte, and
        // 128-bit keys are ample for links that rekey on reconnection.
        let mut provider = rustls::crypto::ring::default_provider();
        provider.cipher_suites = vec![
            rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256,
            rustls::crypto::ring::cipher_suite::TLS13_AES_256_GCM_SHA384,
            rustls::crypto::ring::cipher_suite::TLS13_CHACHA20_POLY1305_SHA256,
        ];
        let provider = Arc::new(provider);
        let invalid = |e: rustls::Error| TlsError::Invalid(e.to_string());

        let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .map_err(|e| TlsError::Invalid(e.to_string()))?;
        let mut server = ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(invalid)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs.clone(), key.clone_key())
            .map_err(invalid)?;
        // Links are long-lived and reconnect rarely: no resumption tickets,
        // so nothing follows the handshake but the weft stream.
        server.send_tls13_tickets = 0;

        let mut client = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(invalid)?
            .with_root_certificates(roots)
            .with_client_auth_cert(certs, key)
            .map_err(invalid)?;
        client.resumption = rustls::client::Resumption::disabled();
        Ok(TlsConfig {
            server: Arc::new(server),
            client: Arc::new(client),
        })
    }
}

/// A TLS connection whose handshake completed: the socket, the rustls state
/// and the plaintext rustls already decrypted (frames the peer sent right
/// after its handshake).
pub(crate) struct Established {
    pub(crate) stream: TcpStream,
    pub(crate) conn: Connection,
    pub(crate) preread: BytesMut,
}

/// Takes what rustls decrypted already, so the reader starts with it.
fn established(stream: TcpStream, mut conn: Connection) -> Established {
    conn.set_buffer_limit(Some(TLS_BUFFER_LIMIT));
    let mut preread = BytesMut::new();
    let mut chunk = [0u8; 4096];
    loop {
        match io::Read::read(&mut conn.reader(), &mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => preread.extend_from_slice(&chunk[..n]),
        }
    }
    Established {
        stream,
        conn,
        preread,
    }
}

/// A hint for a peer that refused this end's certificate (it answers with
/// an alert), or a certificate this end refused.
fn explain(e: &io::Error) -> String {
    let hint = match e.get_ref().and_then(|r| r.downcast_ref::<rustls::Error>()) {
        Some(rustls::Error::AlertReceived(
            rustls::AlertDescription::BadCertificate
            | rustls::AlertDescription::UnknownCA
            | rustls::AlertDescription::CertificateExpired
            | rustls::AlertDescription::CertificateRequired
            | rustls::AlertDescription::CertificateUnknown
            | rustls::AlertDescription::DecryptError,
        )) => {
            "; the peer refused this end's certificate (is it signed by the cluster's CA \
             and still valid?)"
        }
        Some(rustls::Error::InvalidCertificate(_)) => {
            "; the peer's certificate is not one of this cluster's (signed by the CA given \
             with --tls-ca, valid now, for the name weft-node)"
        }
        Some(rustls::Error::NoCertificatesPresented) => {
            "; the peer presented no certificate (mutual TLS: both ends need one)"
        }
        _ => "",
    };
    format!("{e}{hint}")
}

/// The error of a link whose established TLS stream failed (an alert, a
/// record that does not authenticate): the status and the words for it.
pub(crate) fn stream_failure(e: &io::Error) -> (Status, String) {
    (Status::Refused, format!("TLS: {}", explain(e)))
}

/// The failure told to a plaintext weft peer that reached a TLS node.
fn plaintext_refusal() -> Refused {
    Refused {
        status: Status::Refused,
        reason: "this node requires TLS: connect with --tls-cert, --tls-key and --tls-ca \
                 (a certificate signed by the cluster's CA)"
            .into(),
    }
}

/// The words a plaintext node uses for a peer that starts a TLS handshake.
pub(crate) const TLS_TO_PLAINTEXT: &str = "the peer speaks TLS but this node is not configured \
     for TLS (start it with --tls-cert, --tls-key and --tls-ca)";

/// Accepts a connection on a TLS node: a peer that speaks plaintext weft is
/// told in plaintext that TLS is required; anything else must complete a
/// mutual-TLS handshake with a certificate the CA signed.
///
/// Fails with the reason to log; nothing the peer sent is handed on.
pub(crate) async fn accept(cfg: &TlsConfig, stream: TcpStream) -> Result<Established, String> {
    let mut first = [0u8; 1];
    match stream.peek(&mut first).await {
        Ok(0) => return Err("closed before saying anything".into()),
        Ok(_) => {}
        Err(e) => return Err(format!("read failed: {e}")),
    }
    if first[0] != TLS_HANDSHAKE_BYTE {
        let mut stream = stream;
        let mut out = BytesMut::new();
        if encode_frame(&Frame::Refused(plaintext_refusal()), &mut out).is_ok() {
            let _ = stream.write_all(&out).await;
        }
        let _ = stream.shutdown().await;
        return Err("plaintext peer refused: this node requires TLS".into());
    }
    let acceptor = tokio_rustls::TlsAcceptor::from(cfg.server.clone());
    match acceptor.accept(stream).await {
        Ok(tls) => {
            let (stream, conn) = tls.into_inner();
            Ok(established(stream, Connection::Server(conn)))
        }
        Err(e) => Err(format!("TLS handshake failed: {}", explain(&e))),
    }
}

/// Bytes of a peer's first answer kept to explain a failed handshake.
const SNIFF: usize = 512;

/// A socket that remembers the first bytes it read, so a failed handshake
/// can tell a plaintext weft answer (a Refused frame) from a TLS error.
struct Sniff {
    inner: TcpStream,
    /// Shared, so it outlives a failed handshake (which drops the socket).
    first: Arc<parking_lot::Mutex<Vec<u8>>>,
}

impl AsyncRead for Sniff {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        let mut first = self.first.lock();
        if first.len() < SNIFF {
            let new = &buf.filled()[before..];
            let take = new.len().min(SNIFF - first.len());
            first.extend_from_slice(&new[..take]);
        }
        drop(first);
        r
    }
}

impl AsyncWrite for Sniff {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Runs the TLS handshake as the connecting end.
///
/// Fails with Refused and a reason: the node answered in plaintext (it is
/// not configured for TLS; its own Refused reason is quoted), or the TLS
/// handshake failed (the certificate it presented is not the cluster's, it
/// refused ours...).
pub(crate) async fn connect(
    cfg: &TlsConfig,
    stream: TcpStream,
    addr: std::net::SocketAddr,
) -> Result<Established, (Status, String)> {
    let connector = tokio_rustls::TlsConnector::from(cfg.client.clone());
    let name = ServerName::try_from(SERVER_NAME).expect("a valid DNS name");
    let first = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let sniff = Sniff {
        inner: stream,
        first: first.clone(),
    };
    match connector.connect(name, sniff).await {
        Ok(tls) => {
            let (sniff, conn) = tls.into_inner();
            Ok(established(sniff.inner, Connection::Client(conn)))
        }
        Err(e) => {
            let first = first.lock();
            if first.first() == Some(&weft_wire::codec::MAGIC[0]) {
                let answer = plaintext_answer(&first);
                if let Some(r) = answer.as_ref().filter(|r| r.status == Status::Unavailable) {
                    // A TLS node too busy to handshake turns away in
                    // plaintext, before reading anything.
                    return Err((
                        Status::Unavailable,
                        format!(
                            "the node at {addr} turned the connection away: {}",
                            r.reason
                        ),
                    ));
                }
                let said = answer
                    .map(|r| format!(" (it said: {})", r.reason))
                    .unwrap_or_default();
                return Err((
                    Status::Refused,
                    format!(
                        "the node at {addr} answered in plaintext: it is not configured for \
                         TLS{said}"
                    ),
                ));
            }
            Err((
                Status::Refused,
                format!("TLS handshake with {addr} failed: {}", explain(&e)),
            ))
        }
    }
}

/// The plaintext weft answer to a ClientHello, if `bytes` start with a
/// whole Refused frame.
fn plaintext_answer(bytes: &[u8]) -> Option<Refused> {
    let mut buf = BytesMut::from(bytes);
    match decode_frame(&mut buf, &Limits::default().handshake()) {
        Ok(Some(Frame::Refused(r))) => Some(r),
        _ => None,
    }
}

//! Issuing the certificates of a TLS cluster (`weft tls init`, tests): a
//! cluster CA, node certificates and client certificates that the checks in
//! [`crate::tls`] accept.
//!
//! Owns what a weft certificate carries (the names, the key usages, the
//! validity). Must never write files or read the environment: callers get
//! PEM text and decide where it goes.

use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};

use crate::tls::SERVER_NAME;

/// Why a certificate could not be made.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    /// rcgen failed (key generation, a name it cannot encode, signing).
    #[error("cannot make the certificate: {0}")]
    Rcgen(#[from] rcgen::Error),
    /// A validity that ends before it begins.
    #[error("a certificate must end after it begins")]
    BadValidity,
}

/// When a certificate is valid.
#[derive(Clone, Copy, Debug)]
pub struct Validity {
    /// First instant of validity.
    pub not_before: SystemTime,
    /// Last instant of validity.
    pub not_after: SystemTime,
}

impl Validity {
    /// From an hour ago (clocks differ a little) for `days` days.
    pub fn days(days: u32) -> Validity {
        let now = SystemTime::now();
        Validity {
            not_before: now - Duration::from_secs(3600),
            not_after: now + Duration::from_secs(86_400 * u64::from(days)),
        }
    }

    fn apply(&self, p: &mut CertificateParams) -> Result<(), CertError> {
        if self.not_after <= self.not_before {
            return Err(CertError::BadValidity);
        }
        p.not_before = self.not_before.into();
        p.not_after = self.not_after.into();
        Ok(())
    }
}

/// A certificate and its private key, PEM encoded.
#[derive(Clone, Debug)]
pub struct Pem {
    /// The certificate.
    pub cert: String,
    /// Its private key (PKCS#8).
    pub key: String,
}

/// A cluster certificate authority: signs the certificates of the nodes
/// and clients of one cluster.
pub struct ClusterCa {
    cert: rcgen::Certificate,
    key: KeyPair,
}

fn named(cn: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "weft");
    dn.push(DnType::CommonName, cn);
    dn
}

impl ClusterCa {
    /// A new CA with a fresh ECDSA P-256 key.
    ///
    /// Fails with [`CertError`] when rcgen cannot make it or the validity
    /// is empty.
    pub fn generate(validity: Validity) -> Result<ClusterCa, CertError> {
        let key = KeyPair::generate()?;
        let mut p = CertificateParams::default();
        // A name of its own: a certificate from another cluster's CA must
        // not even name this one as its issuer.
        let id: u64 = rand::random();
        p.distinguished_name = named(&format!("weft cluster CA {id:016x}"));
        p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        validity.apply(&mut p)?;
        let cert = p.self_signed(&key)?;
        Ok(ClusterCa { cert, key })
    }

    /// The CA certificate (what `--tls-ca` names).
    pub fn cert_pem(&self) -> String {
        self.cert.pem()
    }

    /// The CA's private key: keep it offline; only needed to issue more.
    pub fn key_pem(&self) -> String {
        self.key.serialize_pem()
    }

    fn issue(
        &self,
        cn: &str,
        sans: Vec<SanType>,
        usages: Vec<ExtendedKeyUsagePurpose>,
        validity: Validity,
    ) -> Result<Pem, CertError> {
        let key = KeyPair::generate()?;
        let mut p = CertificateParams::default();
        p.distinguished_name = named(cn);
        p.subject_alt_names = sans;
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = usages;
        validity.apply(&mut p)?;
        let cert = p.signed_by(&key, &self.cert, &self.key)?;
        Ok(Pem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        })
    }

    /// The certificate of node `node`: valid for [`SERVER_NAME`] (what
    /// every connecting end checks), `node-N`, `localhost` and 127.0.0.1,
    /// for both ends of a TLS connection (nodes accept and connect).
    ///
    /// Fails with [`CertError`] as [`ClusterCa::generate`].
    pub fn issue_node(&self, node: u32, validity: Validity) -> Result<Pem, CertError> {
        let dns = |s: &str| -> Result<SanType, CertError> { Ok(SanType::DnsName(s.try_into()?)) };
        let sans = vec![
            dns(SERVER_NAME)?,
            dns(&format!("node-{node}"))?,
            dns("localhost")?,
            SanType::IpAddress(std::net::Ipv4Addr::LOCALHOST.into()),
        ];
        self.issue(
            &format!("weft node {node}"),
            sans,
            vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
            validity,
        )
    }

    /// A client certificate: good for connecting only.
    ///
    /// Fails with [`CertError`] as [`ClusterCa::generate`].
    pub fn issue_client(&self, validity: Validity) -> Result<Pem, CertError> {
        self.issue(
            "weft client",
            vec![SanType::DnsName("weft-client".try_into()?)],
            vec![ExtendedKeyUsagePurpose::ClientAuth],
            validity,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tls::TlsConfig;

    #[test]
    fn issued_pairs_load_as_tls_settings() {
        let ca = ClusterCa::generate(Validity::days(1)).unwrap();
        let node = ca.issue_node(3, Validity::days(1)).unwrap();
        let client = ca.issue_client(Validity::days(1)).unwrap();
        let ca_pem = ca.cert_pem();
        TlsConfig::from_pem(node.cert.as_bytes(), node.key.as_bytes(), ca_pem.as_bytes()).unwrap();
        TlsConfig::from_pem(
            client.cert.as_bytes(),
            client.key.as_bytes(),
            ca_pem.as_bytes(),
        )
        .unwrap();
        // A key that is not the certificate's is refused when loading.
        let err = TlsConfig::from_pem(
            node.cert.as_bytes(),
            client.key.as_bytes(),
            ca_pem.as_bytes(),
        );
        assert!(err.is_err(), "a mismatched key must be refused");
    }

    #[test]
    fn an_empty_validity_is_refused() {
        let now = SystemTime::now();
        let v = Validity {
            not_before: now,
            not_after: now - Duration::from_secs(1),
        };
        assert!(matches!(
            ClusterCa::generate(v),
            Err(CertError::BadValidity)
        ));
    }

    #[test]
    fn missing_pem_items_are_named() {
        let ca = ClusterCa::generate(Validity::days(1)).unwrap();
        let node = ca.issue_node(1, Validity::days(1)).unwrap();
        let r = TlsConfig::from_pem(b"", node.key.as_bytes(), ca.cert_pem().as_bytes());
        assert!(matches!(
            r,
            Err(crate::tls::TlsError::Missing("certificate"))
        ));
        let r = TlsConfig::from_pem(node.cert.as_bytes(), b"", ca.cert_pem().as_bytes());
        assert!(matches!(
            r,
            Err(crate::tls::TlsError::Missing("private key"))
        ));
        let r = TlsConfig::from_pem(node.cert.as_bytes(), node.key.as_bytes(), b"");
        assert!(matches!(
            r,
            Err(crate::tls::TlsError::Missing("CA certificate"))
        ));
    }
}

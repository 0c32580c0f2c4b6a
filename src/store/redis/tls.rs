//! TLS to Redis (`rediss://` URLs): which servers to trust, and the
//! certificate this client shows to a server that asks for one.
//!
//! rustls does the TLS (the redis crate's `tokio-rustls-comp`), with the
//! aws-lc-rs provider. Without a CA file the system's roots are trusted
//! (`rustls-native-certs`: the OS store, or `SSL_CERT_FILE` /
//! `SSL_CERT_DIR` if set), read at each connection, as a managed Redis with
//! a public certificate needs. With one, only its certificates are trusted:
//! a private CA. Certificate checks cannot be turned off (the redis crate's
//! `#insecure` URL fragment is refused by config validation).
//!
//! The files are read and checked at start-up ([`check_ca`],
//! [`check_identity`], called by config validation), so a bad file fails
//! there, naming its field, instead of at the first connection.

use redis::{RedisError, RedisResult};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::error::Error;
use std::sync::{Arc, Once};

/// What TLS connections to Redis trust and show (used with `rediss://`
/// URLs only). The default trusts the system's roots and shows nothing.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct RedisTls {
    /// PEM certificates of the CAs to trust instead of the system's roots.
    pub ca: Option<Vec<u8>>,
    /// A client certificate and its key, for servers that ask for one
    /// (`tls-auth-clients`).
    pub client: Option<ClientIdentity>,
}

/// A client certificate chain and its private key, PEM.
#[derive(Clone, PartialEq, Eq)]
pub struct ClientIdentity {
    /// The chain, the client's own certificate first.
    pub cert: Vec<u8>,
    /// Its private key.
    pub key: Vec<u8>,
}

impl std::fmt::Debug for ClientIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClientIdentity(<redacted>)")
    }
}

impl std::fmt::Debug for RedisTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key; the certificates are not secret, but say little.
        f.debug_struct("RedisTls")
            .field("ca", &self.ca.as_ref().map(|_| "<file>"))
            .field("client", &self.client.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl RedisTls {
    /// The redis crate's form, if anything differs from the default.
    pub(super) fn certificates(&self) -> Option<redis::TlsCertificates> {
        if *self == Self::default() {
            return None;
        }
        Some(redis::TlsCertificates {
            client_tls: self.client.as_ref().map(|c| redis::ClientTlsConfig {
                client_cert: c.cert.clone(),
                client_key: c.key.clone(),
            }),
            root_cert: self.ca.clone(),
        })
    }

    /// The rustls configuration of a connection ([`super::pipe`]): the CA
    /// file's certificates, or else the system's roots (read now, so a
    /// rotated store is seen by the next connection), and the client
    /// identity if there is one.
    pub(super) fn client_config(&self) -> RedisResult<Arc<rustls::ClientConfig>> {
        let invalid = |what: &'static str, e: String| {
            RedisError::from((redis::ErrorKind::InvalidClientConfig, what, e))
        };
        let roots = match &self.ca {
            Some(pem) => ca_roots(pem).map_err(|e| invalid("redis.tls_ca_file", e))?,
            None => {
                let mut roots = rustls::RootCertStore::empty();
                let native = rustls_native_certs::load_native_certs();
                // Certificates the store holds that rustls cannot use are
                // skipped, as a browser would; none usable is an error.
                roots.add_parsable_certificates(native.certs);
                if roots.is_empty() {
                    let errors = native.errors.iter().map(ToString::to_string);
                    return Err(invalid(
                        "no usable system root certificates",
                        errors.collect::<Vec<_>>().join("; "),
                    ));
                }
                roots
            }
        };
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| invalid("TLS versions", e.to_string()))?
            .with_root_certificates(roots);
        let config = match &self.client {
            Some(identity) => {
                let (chain, key) =
                    identity_parts(&identity.cert, &identity.key).map_err(|e| match e {
                        IdentityError::Cert(e) => invalid("redis.tls_client_cert", e),
                        IdentityError::Key(e) => invalid("redis.tls_client_key", e),
                    })?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| invalid("redis.tls_client_key", e.to_string()))?
            }
            None => builder.with_no_client_auth(),
        };
        Ok(Arc::new(config))
    }
}

/// The crypto provider of every TLS connection to Redis.
fn provider() -> CryptoProvider {
    rustls::crypto::aws_lc_rs::default_provider()
}

/// Makes aws-lc-rs the process's rustls provider, once. rustls picks a
/// provider by itself only when exactly one is compiled in; a build that
/// also enables another (a workspace's unified features, a dependency's
/// choice) would otherwise panic at the first TLS connection. An
/// application that installed its own first keeps it.
pub fn install_crypto_provider() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        // Err: one is installed already, which is as good.
        let _ = provider().install_default();
    });
}

/// Checks a CA file's contents: at least one PEM certificate, each one
/// rustls can use as a trust anchor. The error says what is wrong (the
/// caller names the field and the file).
pub fn check_ca(pem: &[u8]) -> Result<(), String> {
    ca_roots(pem).map(drop)
}

/// A CA file's certificates as trust anchors ([`check_ca`] at start-up,
/// then each TLS connection).
fn ca_roots(pem: &[u8]) -> Result<rustls::RootCertStore, String> {
    let mut roots = rustls::RootCertStore::empty();
    for (i, cert) in CertificateDer::pem_slice_iter(pem).enumerate() {
        let cert = cert.map_err(|e| format!("certificate {} is not valid PEM: {e}", i + 1))?;
        roots
            .add(cert)
            .map_err(|e| format!("certificate {} cannot be trusted: {e}", i + 1))?;
    }
    if roots.is_empty() {
        return Err("holds no PEM certificate (-----BEGIN CERTIFICATE-----)".into());
    }
    Ok(roots)
}

/// Which half of a client identity is at fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdentityError {
    /// The certificate (chain).
    Cert(String),
    /// The key, or the key does not belong to the certificate.
    Key(String),
}

/// Checks a client certificate chain and key: PEM, a key rustls can sign
/// with, and the key of the first certificate.
pub fn check_identity(cert: &[u8], key: &[u8]) -> Result<(), IdentityError> {
    let (chain, key) = identity_parts(cert, key)?;
    rustls::sign::CertifiedKey::from_der(chain, key, &provider())
        .map_err(|e| IdentityError::Key(format!("does not fit the certificate: {e}")))?;
    Ok(())
}

/// A client identity's chain and key, parsed from PEM ([`check_identity`]
/// at start-up, then each TLS connection).
fn identity_parts(
    cert: &[u8],
    key: &[u8],
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), IdentityError> {
    let chain = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| IdentityError::Cert(format!("not valid PEM: {e}")))?;
    if chain.is_empty() {
        return Err(IdentityError::Cert(
            "holds no PEM certificate (-----BEGIN CERTIFICATE-----)".into(),
        ));
    }
    let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => {
            IdentityError::Key("holds no PEM private key (-----BEGIN PRIVATE KEY-----)".into())
        }
        e => IdentityError::Key(format!("not a valid PEM private key: {e}")),
    })?;
    Ok((chain, key))
}

/// Whether `e` is a TLS failure (a certificate not trusted or not for this
/// host, a handshake or client certificate refused, TLS spoken to a
/// plaintext port or the reverse), not a network one. The redis crate
/// reports these as I/O errors; rustls's error is inside.
pub fn is_tls_error(e: &RedisError) -> bool {
    e.source().is_some_and(has_rustls_error)
}

fn has_rustls_error(e: &(dyn Error + 'static)) -> bool {
    if e.is::<rustls::Error>() {
        return true;
    }
    // The redis crate holds its cause as an `Arc<dyn Error>`, and an
    // `io::Error`'s `source` skips the error it wraps: look inside both.
    if let Some(arc) = e.downcast_ref::<Arc<dyn Error + Send + Sync>>() {
        return has_rustls_error(&**arc);
    }
    if let Some(inner) = e
        .downcast_ref::<std::io::Error>()
        .and_then(std::io::Error::get_ref)
    {
        return has_rustls_error(inner);
    }
    e.source().is_some_and(has_rustls_error)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ca_file_must_hold_usable_certificates() {
        assert!(check_ca(b"").unwrap_err().contains("no PEM certificate"));
        assert!(
            check_ca(b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
                .unwrap_err()
                .contains("no PEM certificate")
        );
        let garbage =
            b"-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n";
        let err = check_ca(garbage).unwrap_err();
        assert!(err.contains("certificate 1 cannot be trusted"), "{err}");
        let broken = b"-----BEGIN CERTIFICATE-----\n!!!\n-----END CERTIFICATE-----\n";
        let err = check_ca(broken).unwrap_err();
        assert!(err.contains("certificate 1 is not valid PEM"), "{err}");
    }

    #[test]
    fn an_identity_names_the_half_at_fault() {
        let err = check_identity(b"", b"").unwrap_err();
        assert!(matches!(err, IdentityError::Cert(ref m) if m.contains("no PEM certificate")));
    }

    #[test]
    fn the_default_asks_the_redis_crate_for_nothing() {
        assert!(RedisTls::default().certificates().is_none());
        let tls = RedisTls {
            ca: Some(b"ca".to_vec()),
            client: Some(ClientIdentity {
                cert: b"cert".to_vec(),
                key: b"secret key".to_vec(),
            }),
        };
        let certificates = tls.certificates().unwrap();
        assert_eq!(certificates.root_cert.as_deref(), Some(&b"ca"[..]));
        assert!(!format!("{tls:?}").contains("secret"));
    }

    #[test]
    fn rustls_failures_inside_io_errors_are_tls_errors() {
        let handshake = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer),
        );
        assert!(is_tls_error(&RedisError::from(handshake)));
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert!(!is_tls_error(&RedisError::from(reset)));
        let other = std::io::Error::new(std::io::ErrorKind::InvalidData, "not tls");
        assert!(!is_tls_error(&RedisError::from(other)));
    }
}

//! Certificates for TLS tests, made by `openssl` in a scratch directory
//! removed on drop: a CA, a server certificate for 127.0.0.1 and
//! localhost, a client certificate, and a second CA that signed neither.
//! EC P-256 keys, valid for two days.

use crate::process::TempDir;
use anyhow::{Context, bail};
use std::path::{Path, PathBuf};
use std::process::Command;

/// A test PKI. See the module docs.
#[derive(Debug)]
pub struct TestCerts {
    /// The CA that signed the server and client certificates (PEM).
    pub ca: PathBuf,
    /// A CA that signed nothing here: trusting it alone must fail.
    pub other_ca: PathBuf,
    /// The server's certificate: `IP:127.0.0.1` and `DNS:localhost`,
    /// usable as a client certificate too (a cluster node is both).
    pub server_cert: PathBuf,
    /// Its key.
    pub server_key: PathBuf,
    /// A client certificate signed by [`TestCerts::ca`].
    pub client_cert: PathBuf,
    /// Its key.
    pub client_key: PathBuf,
    dir: TempDir,
}

/// OpenSSL configuration: the CAs' and the leaves' extensions, written
/// out rather than taken from the system's openssl.cnf.
const CONFIG: &str = "\
[req]
distinguished_name = dn
prompt = no
x509_extensions = ca
[dn]
CN = ratelimiter test
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = critical, CA:FALSE
subjectAltName = IP:127.0.0.1, DNS:localhost
extendedKeyUsage = serverAuth, clientAuth
[client]
basicConstraints = critical, CA:FALSE
extendedKeyUsage = clientAuth
";

impl TestCerts {
    /// Generates them (a few `openssl` runs, well under a second).
    pub fn generate() -> anyhow::Result<Self> {
        let dir = TempDir::new("tls")?;
        std::fs::write(dir.0.join("openssl.cnf"), CONFIG)?;
        let path = |name: &str| dir.0.join(name);
        let key = "-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes";
        for ca in ["ca", "other-ca"] {
            openssl(
                &dir.0,
                &format!(
                    "req -x509 -config openssl.cnf {key} -days 2 -subj /CN=ratelimiter-test-{ca} \
                     -keyout {ca}.key -out {ca}.crt"
                ),
            )?;
        }
        for leaf in ["server", "client"] {
            openssl(
                &dir.0,
                &format!(
                    "req -new -config openssl.cnf {key} -subj /CN=ratelimiter-test-{leaf} \
                     -keyout {leaf}.key -out {leaf}.csr"
                ),
            )?;
            openssl(
                &dir.0,
                &format!(
                    "x509 -req -in {leaf}.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 \
                     -extfile openssl.cnf -extensions {leaf} -out {leaf}.crt"
                ),
            )?;
        }
        Ok(Self {
            ca: path("ca.crt"),
            other_ca: path("other-ca.crt"),
            server_cert: path("server.crt"),
            server_key: path("server.key"),
            client_cert: path("client.crt"),
            client_key: path("client.key"),
            dir,
        })
    }

    /// The directory holding them (to write more files beside them).
    pub fn dir(&self) -> &Path {
        &self.dir.0
    }
}

/// Runs `openssl <args>` (split at whitespace) in `dir`.
fn openssl(dir: &Path, args: &str) -> anyhow::Result<()> {
    let args: Vec<&str> = args.split_whitespace().collect();
    let out = Command::new("openssl")
        .args(&args)
        .current_dir(dir)
        .output()
        .context("cannot run openssl (Debian: apt-get install openssl)")?;
    if !out.status.success() {
        bail!(
            "openssl {}: {}",
            args.first().copied().unwrap_or_default(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

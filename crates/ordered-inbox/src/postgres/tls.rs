//! TLS to a PostgreSQL server, with libpq's `sslmode` meanings: `require` encrypts and checks
//! nothing of the certificate, `verify-ca` checks that a trusted CA signed it, `verify-full`
//! also that it names the host connected to. rustls with the ring provider.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};

use super::error::PostgresError;

/// libpq's `sslmode`, the four values taken here (`allow` and `prefer` may silently fall back
/// to plain TCP, so they are not offered).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SslMode {
    /// Plain TCP or a Unix socket.
    #[default]
    Disable,
    /// Encrypted; the server's certificate is not checked (an active attacker can read it).
    Require,
    /// Encrypted; the certificate must chain to the configured CA.
    VerifyCa,
    /// As `VerifyCa`, and the certificate must name the host connected to.
    VerifyFull,
}

impl SslMode {
    /// libpq's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }

    /// Whether the mode checks the server's certificate against a CA.
    pub fn verifies(self) -> bool {
        matches!(self, SslMode::VerifyCa | SslMode::VerifyFull)
    }
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SslMode {
    type Err = String;

    fn from_str(text: &str) -> Result<SslMode, String> {
        match text {
            "disable" => Ok(SslMode::Disable),
            "require" => Ok(SslMode::Require),
            "verify-ca" => Ok(SslMode::VerifyCa),
            "verify-full" => Ok(SslMode::VerifyFull),
            other => Err(format!(
                "'{other}' is not one of disable, require, verify-ca, verify-full"
            )),
        }
    }
}

/// A client certificate (PEM chain) and its private key (PEM), for servers that ask for one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientCertificate {
    /// The certificate file (PEM).
    pub certificate: PathBuf,
    /// Its private key file (PEM).
    pub key: PathBuf,
}

/// How a target is reached: TLS settings and the password. `Debug` hides the password.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Remote {
    /// Whether and how TLS is used.
    pub sslmode: SslMode,
    /// The CA file (PEM) the server's certificate must chain to; required by `verify-ca` and
    /// `verify-full`.
    pub root_certificate: Option<PathBuf>,
    /// A client certificate to authenticate with, if the server asks for one.
    pub client_certificate: Option<ClientCertificate>,
    /// The password for SCRAM-SHA-256 (or whatever the server asks for).
    pub password: Option<String>,
}

impl fmt::Debug for Remote {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Remote")
            .field("sslmode", &self.sslmode)
            .field("root_certificate", &self.root_certificate)
            .field("client_certificate", &self.client_certificate)
            .field("password", &self.password.as_ref().map(|_| "…"))
            .finish()
    }
}

fn file_error(path: &Path, reason: impl fmt::Display) -> PostgresError {
    PostgresError::TlsFile {
        file: path.display().to_string(),
        reason: reason.to_string(),
    }
}

/// Every certificate of a PEM file; none is an error.
pub fn read_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, PostgresError> {
    let certificates = CertificateDer::pem_file_iter(path)
        .map_err(|error| file_error(path, error))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| file_error(path, error))?;
    if certificates.is_empty() {
        return Err(file_error(path, "holds no PEM certificate"));
    }
    Ok(certificates)
}

/// The private key of a PEM file.
pub fn read_private_key(path: &Path) -> Result<PrivateKeyDer<'static>, PostgresError> {
    PrivateKeyDer::from_pem_file(path).map_err(|error| file_error(path, error))
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The rustls client configuration of `remote.sslmode` (not `Disable`).
pub(crate) fn client_config(remote: &Remote) -> Result<ClientConfig, PostgresError> {
    let provider = provider();
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|error| PostgresError::BadUrl(format!("TLS: {error}")))?;
    let verifier: Arc<dyn ServerCertVerifier> = match remote.sslmode {
        SslMode::Disable | SslMode::Require => Arc::new(AnyCertificate(provider)),
        SslMode::VerifyCa | SslMode::VerifyFull => {
            let Some(path) = &remote.root_certificate else {
                return Err(PostgresError::BadUrl(format!(
                    "sslmode {} needs a root certificate (sslrootcert)",
                    remote.sslmode
                )));
            };
            let mut roots = RootCertStore::empty();
            for certificate in read_certificates(path)? {
                roots
                    .add(certificate)
                    .map_err(|error| file_error(path, error))?;
            }
            let webpki = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|error| file_error(path, error))?;
            if remote.sslmode == SslMode::VerifyFull {
                webpki
            } else {
                Arc::new(AnyHostName(webpki))
            }
        }
    };
    let builder = builder
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    match &remote.client_certificate {
        None => Ok(builder.with_no_client_auth()),
        Some(client) => {
            let chain = read_certificates(&client.certificate)?;
            let key = read_private_key(&client.key)?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|error| file_error(&client.key, error))
        }
    }
}

/// `sslmode = require`: any certificate is taken; the handshake's signatures are still checked,
/// so the session is encrypted to whoever holds the certificate's key.
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `sslmode = verify-ca`: the chain is checked as `verify-full` checks it, but a certificate
/// that does not name the host is taken.
#[derive(Debug)]
struct AnyHostName(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for AnyHostName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

//! TLS for a listener: the certificate chain and private key read from PEM files and served by
//! rustls with ring's provider (ALPN `http/1.1`, the only protocol the connection server
//! speaks). The configuration can be swapped in place ([`ReloadingTls::reload`], on SIGHUP with
//! [`ReloadingTls::spawn_reload_on_sighup`], or [`ReloadingTls::install`] of a pair built
//! beforehand, as the gate's configuration reload does) so that a renewed certificate takes effect without a
//! restart: each new connection shakes hands with the configuration current at its accept, while
//! connections already open keep theirs. A pair that does not load keeps the old one in place.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;
use rustls::ServerConfig;
use rustls_pki_types::pem::{self, PemObject};
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

/// Where the PEM files are: the certificate chain (leaf first) and its private key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub certificate: PathBuf,
    pub key: PathBuf,
}

/// Why a certificate and key could not be served, naming the file at fault.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The certificate file is unreadable or holds no PEM certificate.
    #[error("{path}: {reason}")]
    Certificate { path: String, reason: String },
    /// The key file is unreadable or holds no PEM private key.
    #[error("{path}: {reason}")]
    Key { path: String, reason: String },
    /// Both files parse, but rustls refuses them together (e.g. the key is not the
    /// certificate's).
    #[error("{key} does not go with {certificate}: {reason}")]
    Pair {
        certificate: String,
        key: String,
        reason: String,
    },
}

/// Reads every certificate of a PEM chain; at least one is required.
pub fn load_certificate_chain(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let fail = |reason: String| TlsError::Certificate {
        path: path.display().to_string(),
        reason,
    };
    let chain = CertificateDer::pem_file_iter(path)
        .and_then(Iterator::collect::<Result<Vec<_>, _>>)
        .map_err(|error| fail(pem_reason(&error, "CERTIFICATE")))?;
    if chain.is_empty() {
        return Err(fail(pem_reason(&pem::Error::NoItemsFound, "CERTIFICATE")));
    }
    Ok(chain)
}

/// Reads the first private key (PKCS#8, PKCS#1 or SEC1) of a PEM file.
pub fn load_private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|error| TlsError::Key {
        path: path.display().to_string(),
        reason: pem_reason(&error, "PRIVATE KEY"),
    })
}

/// A PEM error in words (the crate's own text shows byte arrays).
fn pem_reason(error: &pem::Error, kind: &str) -> String {
    match error {
        pem::Error::Io(error) => format!("cannot read: {error}"),
        pem::Error::NoItemsFound => format!("not a PEM file with a {kind} block"),
        pem::Error::MissingSectionEnd { end_marker } => format!(
            "not valid PEM: missing '{}'",
            String::from_utf8_lossy(end_marker)
        ),
        pem::Error::IllegalSectionStart { line } => format!(
            "not valid PEM: bad section start '{}'",
            String::from_utf8_lossy(line)
        ),
        other => format!("not valid PEM: {other}"),
    }
}

/// The rustls configuration of one certificate and key, with ring's provider.
pub fn server_config(files: &TlsFiles) -> Result<Arc<ServerConfig>, TlsError> {
    let chain = load_certificate_chain(&files.certificate)?;
    let key = load_private_key(&files.key)?;
    let pair = |reason: String| TlsError::Pair {
        certificate: files.certificate.display().to_string(),
        key: files.key.display().to_string(),
        reason,
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|error| pair(error.to_string()))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|error| pair(error.to_string()))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The current TLS configuration of a listener, replaceable while it serves. Clones share it.
#[derive(Clone)]
pub struct ReloadingTls {
    files: Arc<TlsFiles>,
    current: Arc<ArcSwap<ServerConfig>>,
}

impl std::fmt::Debug for ReloadingTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReloadingTls")
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

impl ReloadingTls {
    /// Loads the pair once; the same files are read again on each reload.
    pub fn load(files: &TlsFiles) -> Result<ReloadingTls, TlsError> {
        Ok(ReloadingTls {
            current: Arc::new(ArcSwap::new(server_config(files)?)),
            files: Arc::new(files.clone()),
        })
    }

    /// Reads the files again and serves the new pair to new connections; when it does not load,
    /// the old one stays and the error is logged and returned.
    pub fn reload(&self) -> Result<(), TlsError> {
        match server_config(&self.files) {
            Ok(config) => {
                self.current.store(config);
                tracing::info!(target: "production_lab::tls", certificate = %self.files.certificate.display(), "TLS certificate reloaded");
                Ok(())
            }
            Err(error) => {
                tracing::error!(target: "production_lab::tls", %error, "TLS certificate not reloaded; the previous one stays in use");
                Err(error)
            }
        }
    }

    /// Serves `config` (built by [`server_config`]) to new connections from now on.
    pub fn install(&self, config: Arc<ServerConfig>) {
        self.current.store(config);
    }

    /// An acceptor with the configuration current now.
    pub fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.current.load_full())
    }

    /// Reloads on every SIGHUP until `stop` is cancelled. The handler is registered before this
    /// returns, so a SIGHUP sent right after is not lost to the default action (which ends the
    /// process). Call it inside the runtime.
    #[cfg(unix)]
    pub fn spawn_reload_on_sighup(
        &self,
        stop: CancellationToken,
    ) -> std::io::Result<tokio::task::JoinHandle<()>> {
        use tokio::signal::unix::{SignalKind, signal};
        let mut hangups = signal(SignalKind::hangup())?;
        let tls = self.clone();
        Ok(tokio::spawn(async move {
            loop {
                tokio::select! {
                    received = hangups.recv() => match received {
                        // Logged by reload either way.
                        Some(()) => { let _ = tls.reload(); }
                        None => return,
                    },
                    () = stop.cancelled() => return,
                }
            }
        }))
    }
}

//! The gate's configuration reloaded on SIGHUP: the file given by `--config` is read and checked
//! again, the message types (their schemas compiled, with their `gap_alert_after_ms`), the
//! readers' tokens and, with `[tls]`, the certificate and key are all built, and only then
//! swapped in together. A file with a mistake
//! changes nothing: each mistake is logged with the file and its key, and the gate serves on
//! with the previous set. Each reload that takes effect counts one more configuration
//! generation (`/ready`'s `generation`, the `gate_config_generation` gauge).
//!
//! The keys a running gate cannot take up (the listen address, the store, NATS, the limits,
//! metrics, the log, anonymous writes, and whether there is `[tls]` at all) keep the values the
//! gate started with; when the file's differ, the log says they wait for a restart.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use rustls::ServerConfig;
use tokio_util::sync::CancellationToken;

use super::auth::Access;
use super::config::{ConfigError, GateConfig};
use super::handler::SharedTypes;
use super::schemas::MessageTypes;
use http_edge::metrics::Metrics;
use http_edge::tls::{self, ReloadingTls, TlsError};

const TARGET: &str = "production_lab::gate";

/// The configuration's generation: 1 as started, one more at each reload that takes effect.
/// Clones share it.
#[derive(Debug, Clone)]
pub struct ConfigGeneration(Arc<AtomicU64>);

impl ConfigGeneration {
    pub fn new() -> ConfigGeneration {
        ConfigGeneration(Arc::new(AtomicU64::new(1)))
    }

    pub fn current(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }

    /// Counts one reload that took effect; answers the new generation.
    fn advance(&self) -> u64 {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }
}

impl Default for ConfigGeneration {
    fn default() -> Self {
        ConfigGeneration::new()
    }
}

/// What a reload replaces, and what it compares the file with.
pub struct Reloader {
    /// The file read at start; `None` for a gate built from a configuration in memory.
    source: Option<PathBuf>,
    /// The configuration the gate started with: the keys that wait for a restart keep its
    /// values.
    started: GateConfig,
    types: SharedTypes,
    access: Access,
    tls: Option<ReloadingTls>,
    generation: ConfigGeneration,
    metrics: Metrics,
}

/// Everything a new configuration puts in place, built whole before any of it is.
struct Prepared {
    types: MessageTypes,
    readers: Vec<(String, String)>,
    tls: Option<Arc<ServerConfig>>,
}

impl Reloader {
    /// A reloader of the running gate's parts, at generation 1 (shown by `metrics` at once).
    pub fn new(
        started: GateConfig,
        types: SharedTypes,
        access: Access,
        tls: Option<ReloadingTls>,
        metrics: Metrics,
    ) -> Reloader {
        let generation = ConfigGeneration::new();
        metrics.config_generation(generation.current());
        Reloader {
            source: None,
            started,
            types,
            access,
            tls,
            generation,
            metrics,
        }
    }

    /// Reloads read `path` (the file the gate started with).
    pub fn with_source(mut self, path: PathBuf) -> Reloader {
        self.source = Some(path);
        self
    }

    pub fn generation(&self) -> ConfigGeneration {
        self.generation.clone()
    }

    /// The message types in use, replaced at each reload that takes effect.
    pub fn types(&self) -> SharedTypes {
        self.types.clone()
    }

    /// Reads the file again and, when all of it loads, puts the new types, readers and TLS pair
    /// in place together and answers the new generation. Otherwise nothing changes and the
    /// mistakes (each with its key; a file's names the file) are answered and logged.
    pub fn reload(&self) -> Result<u64, Vec<ConfigError>> {
        let Some(source) = &self.source else {
            tracing::info!(target: TARGET, "SIGHUP received: the configuration was not read from a file, nothing to reload");
            return Ok(self.generation.current());
        };
        let loaded = GateConfig::load(source).map_err(|errors| errors.0);
        let prepared = loaded.and_then(|config| {
            let prepared = self.prepare(&config)?;
            Ok((config, prepared))
        });
        match prepared {
            Ok((config, prepared)) => {
                let generation = self.install(prepared);
                tracing::info!(target: TARGET, file = %source.display(), generation, "configuration reloaded: message types, readers' tokens and the TLS pair");
                self.log_keys_waiting_for_a_restart(&config);
                Ok(generation)
            }
            Err(errors) => {
                for error in &errors {
                    tracing::error!(target: TARGET, file = %source.display(), key = %error.key, error = %error.message, generation = self.generation.current(), "configuration not reloaded; the previous one stays in use");
                }
                Err(errors)
            }
        }
    }

    /// The new configuration's parts, each built completely.
    fn prepare(&self, config: &GateConfig) -> Result<Prepared, Vec<ConfigError>> {
        let types = MessageTypes::compile(config.types.clone())
            .map_err(|(name, why)| {
                vec![ConfigError {
                    key: format!("types.{name:?}.schema"),
                    message: why,
                }]
            })?
            .with_gap_alerts(config.gap_alerts.clone());
        // Whether the gate serves TLS at all is the listener's: a restart's.
        let tls = match (&self.tls, &config.tls) {
            (Some(_), Some(files)) => Some(tls::server_config(files).map_err(tls_error)?),
            _ => None,
        };
        let readers = config
            .auth
            .readers
            .iter()
            .map(|reader| (reader.name.clone(), reader.token.expose().to_owned()))
            .collect();
        Ok(Prepared {
            types,
            readers,
            tls,
        })
    }

    /// Swaps every part in; answers the new generation.
    fn install(&self, prepared: Prepared) -> u64 {
        // Reloads run one at a time, so the next generation is known before it is counted: the
        // types carry it from the moment they are in place.
        let next = self.generation.current() + 1;
        self.types
            .store(Arc::new(prepared.types.with_generation(next)));
        self.access.replace_readers(prepared.readers);
        if let (Some(running), Some(pair)) = (&self.tls, prepared.tls) {
            running.install(pair);
        }
        let generation = self.generation.advance();
        self.metrics.config_generation(generation);
        generation
    }

    /// One warning for each key whose new value only a restart takes up.
    fn log_keys_waiting_for_a_restart(&self, config: &GateConfig) {
        let started = &self.started;
        let differing = [
            ("listen", started.listen != config.listen),
            ("tls", started.tls.is_some() != config.tls.is_some()),
            ("store", started.store != config.store),
            ("nats", started.nats != config.nats),
            ("limits", started.limits != config.limits),
            ("metrics", started.metrics != config.metrics),
            ("log", started.log != config.log),
            ("retention", started.retention != config.retention),
            (
                "auth.anonymous_writes",
                started.auth.anonymous_writes != config.auth.anonymous_writes,
            ),
        ];
        for (key, _) in differing.iter().filter(|(_, differs)| *differs) {
            tracing::warn!(target: TARGET, key, "changed in the file, but only a restart takes it up; the running value stays");
        }
    }

    /// Reloads on every SIGHUP until `stop` is cancelled. The handler is registered before this
    /// returns, so a SIGHUP sent right after is not lost to the default action (which ends the
    /// process).
    #[cfg(unix)]
    pub fn spawn_on_sighup(self, stop: CancellationToken) -> std::io::Result<()> {
        use tokio::signal::unix::{SignalKind, signal};
        let mut hangups = signal(SignalKind::hangup())?;
        let reloader = Arc::new(self);
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    received = hangups.recv() => match received {
                        Some(()) => reloader.clone().reload_off_the_runtime().await,
                        None => return,
                    },
                    () = stop.cancelled() => return,
                }
            }
        });
        Ok(())
    }
}

impl Reloader {
    /// [`Reloader::reload`] on a blocking thread: it reads files and compiles schemas. One
    /// reload at a time, as the signals come.
    async fn reload_off_the_runtime(self: Arc<Self>) {
        // Logged by reload either way.
        let _ = tokio::task::spawn_blocking(move || self.reload()).await;
    }
}

/// A TLS file's mistake at its key, as the configuration's check names it.
fn tls_error(error: TlsError) -> Vec<ConfigError> {
    let key = match &error {
        TlsError::Certificate { .. } => "tls.certificate",
        TlsError::Key { .. } => "tls.key",
        TlsError::Pair { .. } => "tls",
    };
    vec![ConfigError {
        key: key.to_owned(),
        message: error.to_string(),
    }]
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;
    use std::time::Duration;

    use arc_swap::ArcSwap;

    use super::*;
    use crate::auth::DeliveryRate;

    const PLACED: &str = "order.placed";

    /// A gate file with `order.placed` and, when given, its `gap_alert_after_ms` line.
    fn write_config(dir: &tempfile::TempDir, gap_alert: &str) -> PathBuf {
        std::fs::write(dir.path().join("placed.json"), r#"{"type": "object"}"#)
            .expect("the schema file");
        let path = dir.path().join("gate.toml");
        let text = format!("[types.\"{PLACED}\"]\nschema = \"placed.json\"\n{gap_alert}");
        std::fs::write(&path, text).expect("the gate file");
        path
    }

    #[test]
    fn a_reload_takes_up_a_types_new_gap_alert_and_a_refused_one_keeps_the_old() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = write_config(&dir, "");
        let config = GateConfig::load(&path).expect("the first file loads");
        let compiled = MessageTypes::compile(config.types.clone()).expect("compiles");
        let types: SharedTypes = Arc::new(ArcSwap::from_pointee(compiled));
        let rate = DeliveryRate {
            per_second: NonZeroU32::MIN,
            burst: NonZeroU32::MIN,
        };
        let access = Access::new(false, Vec::new(), rate);
        let reloader = Reloader::new(config, types.clone(), access, None, Metrics::new())
            .with_source(path.clone());
        assert_eq!(types.load().gap_alert_after(PLACED), None);

        write_config(&dir, "gap_alert_after_ms = 1500\n");
        assert_eq!(reloader.reload().expect("reloaded"), 2);
        assert_eq!(
            types.load().generation(),
            2,
            "the types carry their generation"
        );
        assert_eq!(
            types.load().gap_alert_after(PLACED),
            Some(Duration::from_millis(1500))
        );

        write_config(&dir, "gap_alert_after_ms = 0\n");
        let refused = reloader.reload().expect_err("refused");
        assert_eq!(refused[0].key, "types.\"order.placed\".gap_alert_after_ms");
        assert_eq!(
            types.load().gap_alert_after(PLACED),
            Some(Duration::from_millis(1500))
        );
    }
}

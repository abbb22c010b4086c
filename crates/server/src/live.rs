//! Live configuration: the config file and the RLS config read again on SIGHUP, or when
//! either changes on disk, and applied whole or not at all.
//!
//! A reload reads and validates everything first, off the runtime's threads: a config with
//! any error is refused whole (the log names the file, the place in it and why; the old one
//! goes on serving). A valid one is swapped in at once (the defined limits, what requests
//! may carry, the RLS rules, the web origins and host names): a request finishes under the
//! config it started with, the next one sees the new one, and every state in the store is
//! kept. Settings that cannot change while serving (listen addresses, the store, tokens,
//! timeouts) are logged as waiting for a restart; the rest of the reload is applied.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use sha2::{Digest, Sha256};
use tollgate::RateLimiter;
use tollgate::core::Carry;

use crate::config::{FileConfig, Overrides, SETTINGS, Settings};
use crate::engine::Defined;
use crate::rls::RlsConfig;
use crate::store::DynStore;

/// Where the config comes from: the file (if any), and the flags and environment read once
/// at start.
#[derive(Clone, Debug, Default)]
pub struct Sources {
    /// `--config` (or `TOLLGATE_CONFIG`).
    pub config: Option<PathBuf>,
    /// Flags and variables.
    pub overrides: Overrides,
}

/// A config read and validated, ready to serve.
#[derive(Debug)]
pub struct Loaded {
    /// The settings and limits.
    pub settings: Settings,
    /// The RLS configuration, with `rlsConfig`.
    pub rls: Option<RlsConfig>,
    /// A digest of every file read (their paths and texts): 12 hex digits.
    pub version: String,
    /// The settings a reload applies that a flag or variable overrides (see
    /// [`FileConfig::overridden_live`]).
    pub overridden: Vec<(&'static str, String, String)>,
}

impl Sources {
    /// Reads and validates what `tollgate serve` serves. Blocking: it reads files.
    ///
    /// # Errors
    ///
    /// A file that cannot be read, or any error in it: the file, the place in it and why.
    pub fn load(&self) -> anyhow::Result<Loaded> {
        let mut digest = Sha256::new();
        let mut read = |path: &Path, text: &str| {
            digest.update(path.as_os_str().as_encoded_bytes());
            digest.update([0]);
            digest.update(text.as_bytes());
            digest.update([0]);
        };
        let file = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("cannot read {}", path.display()))?;
                read(path, &text);
                FileConfig::parse(&text).with_context(|| format!("in {}", path.display()))?
            }
            None => FileConfig::default(),
        };
        let settings =
            file.settings(&self.overrides, self.config.is_none()).with_context(|| {
                match &self.config {
                    Some(path) => format!("in {}", path.display()),
                    None => "in the flags and environment".to_owned(),
                }
            })?;
        let rls = match &settings.rls_config {
            Some(path) => Some(RlsConfig::load_observed(path, &mut read)?),
            None => None,
        };
        let version = digest.finalize().iter().take(6).map(|b| format!("{b:02x}")).collect();
        let overridden = file.overridden_live(&self.overrides);
        Ok(Loaded { settings, rls, version, overridden })
    }

    /// What to watch for changes: the directory of the config file, and the RLS config's
    /// (whole directories, so that a file replaced by a rename, or a Kubernetes ConfigMap's
    /// symlink swapped, is seen).
    fn watched(&self, rls: Option<&Path>) -> Watched {
        let mut watched = Watched::default();
        let mut file = |path: &Path| {
            let dir = match path.parent() {
                Some(dir) if !dir.as_os_str().is_empty() => dir.to_owned(),
                _ => PathBuf::from("."),
            };
            let dir = std::fs::canonicalize(&dir).unwrap_or(dir);
            if !watched.dirs.contains(&dir) {
                watched.dirs.push(dir);
            }
            if let Some(name) = path.file_name() {
                watched.names.push(name.to_owned());
            }
        };
        if let Some(config) = &self.config {
            file(config);
            // A symlink to a file elsewhere, written in place there, changes it too.
            if let Ok(target) = std::fs::canonicalize(config) {
                file(&target);
            }
        }
        match rls {
            Some(rls) if rls.is_dir() => {
                watched.trees.push(std::fs::canonicalize(rls).unwrap_or_else(|_| rls.to_owned()));
            }
            Some(rls) => file(rls),
            None => {}
        }
        watched
    }
}

/// The directories a server watches, and what in them is its config.
#[derive(Debug, Default)]
struct Watched {
    /// Directories holding a file of the config, watched alone (not what is under them).
    dirs: Vec<PathBuf>,
    /// The names of those files.
    names: Vec<std::ffi::OsString>,
    /// Directories of RLS files, watched with all under them.
    trees: Vec<PathBuf>,
}

impl Watched {
    /// Whether a change of `path` may change the config: one of its files, anything under
    /// an RLS directory, or a ConfigMap's `..data` (and the `..<time>` directories that
    /// Kubernetes swaps in). Not a store's file beside the config (SQLite writes it all
    /// the time).
    fn concerns(&self, path: &Path) -> bool {
        let name = path.file_name().unwrap_or_default();
        self.names.iter().any(|n| n == name)
            || name.as_encoded_bytes().starts_with(b"..")
            || self.trees.iter().any(|tree| path.starts_with(tree))
    }
}

/// The `[server]` settings that differ between `old` and `new` and that a reload does not
/// apply (their names in the file).
pub fn restart_needed(old: &Settings, new: &Settings) -> Vec<&'static str> {
    let changed = |field: &str| match field {
        "listen" => old.listen != new.listen,
        "store" => old.store != new.store,
        "tokens" => old.tokens != new.tokens,
        "readTokens" => old.read_tokens != new.read_tokens,
        "maxKeys" => old.max_keys != new.max_keys,
        "storeDeadline" => old.store_deadline != new.store_deadline,
        "headerTimeout" => old.http.header_timeout != new.http.header_timeout,
        "bodyTimeout" => old.http.body_timeout != new.http.body_timeout,
        "maxConnections" => old.http.max_connections != new.http.max_connections,
        "shutdownDeadline" => old.http.shutdown_deadline != new.http.shutdown_deadline,
        "drainDelay" => old.http.drain_delay != new.http.drain_delay,
        "rlsListen" => old.rls_listen != new.rls_listen,
        "rlsConfig" => old.rls_config != new.rls_config,
        "respListen" => old.resp_listen != new.resp_listen,
        "respThrottleName" => old.resp_throttle_name != new.resp_throttle_name,
        "respIdleTimeout" => old.resp_idle_timeout != new.resp_idle_timeout,
        "respMaxPeriod" => old.resp_max_period != new.resp_max_period,
        "publicMetrics" => old.public_metrics != new.public_metrics,
        _ => false,
    };
    SETTINGS.iter().filter(|s| !s.live && changed(s.field)).map(|s| s.field).collect()
}

/// What `/healthz` and `/metrics` tell of reloads and of stopping.
#[derive(Debug, Default)]
pub struct Status {
    /// Reloads applied.
    pub reloads: AtomicU64,
    /// Reloads refused.
    pub reload_errors: AtomicU64,
    /// SIGTERM came: `/healthz` answers 503.
    pub draining: AtomicBool,
}

/// What a reload swaps (the limits, the RLS rules, what web pages may ask), and where it
/// says how it went.
pub struct Swapped {
    /// The limits (and the store whose states a changed limit carries).
    pub engine: Arc<crate::engine::Engine>,
    /// The rate limit service's rules, if it runs.
    pub rls: Option<Arc<crate::rls::Rls>>,
    /// What web pages may ask.
    pub browsers: crate::browsers::SharedRules,
    /// Reloads applied and refused.
    pub status: Arc<Status>,
}

/// Reloads the config of a running server.
pub struct Reloader {
    sources: Sources,
    /// What the server started with: the settings a reload cannot change.
    started: Settings,
    parts: Swapped,
    /// One reload at a time; the file's values of the settings a flag or variable overrides
    /// (see [`Loaded::overridden`]) as last read.
    one: tokio::sync::Mutex<Vec<(&'static str, String, String)>>,
}

/// How long the files must be quiet before a change is read: an editor's write, or a
/// ConfigMap's swap, is several events.
const QUIET: Duration = Duration::from_millis(150);

impl Reloader {
    /// A reloader of `parts`, which were started with `started` (whose overridden settings
    /// are `overridden`) from `sources`.
    pub fn new(
        sources: Sources,
        started: Settings,
        overridden: Vec<(&'static str, String, String)>,
        parts: Swapped,
    ) -> Self {
        Reloader { sources, started, parts, one: tokio::sync::Mutex::new(overridden) }
    }

    /// Reads the config again and applies it, or refuses it whole; `why` says what asked.
    /// An unchanged config (the same version) is left as it is.
    pub async fn reload(&self, why: &str) {
        let mut overridden = self.one.lock().await;
        let sources = self.sources.clone();
        let loaded = tokio::task::spawn_blocking(move || sources.load()).await;
        let serving = self.parts.engine.current().version.clone();
        match loaded.map_err(anyhow::Error::from).and_then(|loaded| loaded) {
            Ok(loaded) if loaded.version == serving => {
                tracing::debug!(version = serving, "config unchanged ({why})");
            }
            Ok(loaded) => {
                // A setting the file changed that a flag or variable overrides: said, since
                // the change is not applied.
                for (field, from, value) in &loaded.overridden {
                    let before = overridden.iter().find(|(f, _, _)| f == field);
                    if before.is_some_and(|(_, _, was)| was != value) {
                        tracing::warn!(
                            setting = field,
                            "[server] {field} changed in the file, but {from} overrides it: \
                             the file's value is not applied"
                        );
                    }
                }
                *overridden = loaded.overridden.clone();
                self.apply(loaded, why).await;
            }
            Err(e) => {
                self.parts.status.reload_errors.fetch_add(1, Ordering::Relaxed);
                tracing::error!(
                    version = serving,
                    "config reload ({why}) refused, version {serving} goes on serving: {e:#}"
                );
            }
        }
    }

    async fn apply(&self, mut loaded: Loaded, why: &str) {
        // A leased limit's holders were made with its config at start (the store serves them
        // with it): a change of it, or of which limits are leased, waits for a restart.
        let started = &self.started;
        if loaded.settings.lease != started.lease {
            tracing::warn!("[limits] lease changed: it takes a restart to apply");
        }
        for (name, config) in &mut loaded.settings.limits {
            let before = started.limits.iter().find(|(n, _)| n == name).map(|(_, c)| *c);
            if let Some(before) = before
                && started.lease.iter().any(|(leased, _)| leased == name)
                && *config != before
            {
                tracing::warn!(
                    "[limits.{name}] is leased: its new config takes a restart; it keeps the \
                     one it started with"
                );
                *config = before;
            }
        }
        let new = &loaded.settings;
        for field in restart_needed(&self.started, new) {
            tracing::warn!(
                setting = field,
                "[server] {field} changed: it takes a restart to apply; the rest of this \
                 reload is applied"
            );
        }
        let engine = &self.parts.engine;
        let before = engine.current();
        let changes = match &engine.stored {
            Some(stored) => crate::carry::changes(before.limiter(), &new.limits, stored),
            None => Vec::new(),
        };
        // A change of kind or shards is carried before the new config reads a state.
        let mut converted = std::collections::HashMap::new();
        for change in changes.iter().filter(|c| c.carry == Carry::Convert) {
            let carried = self.carry(before.limiter(), change, None).await;
            converted.insert(change.name.clone(), carried);
        }
        let store = before.limiter().store().clone();
        engine.replace(Defined::of_settings(store, new, loaded.version.clone()));
        if let (Some(rls), Some(config)) = (&self.parts.rls, loaded.rls) {
            rls.replace(config);
        }
        self.parts.browsers.store(Arc::new(crate::browsers::BrowserRules::new(
            !self.started.tokens.is_empty(),
            self.started.listen,
            &new.cors_origins,
            &new.allowed_hosts,
        )));
        self.parts.status.reloads.fetch_add(1, Ordering::Relaxed);
        let names: Vec<&str> = new.limits.iter().map(|(n, _)| n.as_str()).collect();
        tracing::info!(
            version = loaded.version,
            "config reloaded ({why}): version {}, limits: {}",
            loaded.version,
            crate::names::names_line(&names)
        );
        if !changes.is_empty() {
            // The requests that started under the old config may still write under it: once
            // they are done (within the store deadline), nothing does.
            let most = self.started.store_deadline + Duration::from_secs(1);
            let waiting = std::time::Instant::now();
            while Arc::strong_count(&before) > 1 && waiting.elapsed() < most {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            for change in &changes {
                let skip = converted.get(&change.name);
                self.carry(before.limiter(), change, skip).await;
            }
        }
    }

    /// Carries the states of `change` to its new config (see [`crate::carry`]), skipping
    /// the keys in `skip`; says in the log what it did. The keys carried.
    async fn carry(
        &self,
        limiter: &RateLimiter<DynStore>,
        change: &crate::carry::Change,
        skip: Option<&std::collections::HashSet<Option<String>>>,
    ) -> std::collections::HashSet<Option<String>> {
        let Some(stored) = &self.parts.engine.stored else { return Default::default() };
        let name = crate::names::limits_table(&change.name);
        match crate::carry::carry(limiter, stored, change, skip).await {
            Ok(carried) => {
                if carried.states > 0 {
                    tracing::info!(
                        "{name} changed: {} states of {} keys carried to its new config",
                        carried.states,
                        carried.carried
                    );
                }
                if let (n, Some(e)) = &carried.failed {
                    self.parts.status.reload_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::error!(
                        "{name} changed: {n} keys could not be carried to its new \
                         config ({e}); until they are reset or refilled they read as the \
                         store keeps them"
                    );
                }
                carried.keys
            }
            Err(e) => {
                self.parts.status.reload_errors.fetch_add(1, Ordering::Relaxed);
                tracing::error!(
                    "{name} changed, but its states could not be listed to carry them \
                     to its new config: {e}"
                );
                Default::default()
            }
        }
    }

    /// Reloads on SIGHUP, until the process ends.
    pub fn on_hangup(self: &Arc<Self>) {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            let Ok(mut hangup) = signal(SignalKind::hangup()) else {
                tracing::warn!("cannot listen for SIGHUP: reload by changing the files");
                return;
            };
            let reloader = Arc::clone(self);
            tokio::spawn(async move {
                while hangup.recv().await.is_some() {
                    reloader.reload("SIGHUP").await;
                }
            });
        }
    }

    /// Reloads when the config file or the RLS config changes on disk (a write in place,
    /// a file renamed over it, a ConfigMap's symlink swapped), once the files have been
    /// quiet for 150 ms. The watcher stops when what is returned is dropped.
    ///
    /// # Errors
    ///
    /// A directory cannot be watched.
    pub fn on_change(self: &Arc<Self>) -> anyhow::Result<Option<notify::RecommendedWatcher>> {
        use notify::{EventKind, RecursiveMode, Watcher as _};
        let watched = self.sources.watched(self.started.rls_config.as_deref());
        if watched.dirs.is_empty() && watched.trees.is_empty() {
            return Ok(None);
        }
        let dirs: Vec<(PathBuf, RecursiveMode)> = (watched.dirs.iter())
            .map(|d| (d.clone(), RecursiveMode::NonRecursive))
            .chain(watched.trees.iter().map(|d| (d.clone(), RecursiveMode::Recursive)))
            .collect();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<()>();
        let mut watcher =
            notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
                // Reading the files is an access too: only changes count.
                let Ok(event) = event else { return };
                if !matches!(event.kind, EventKind::Access(_))
                    && event.paths.iter().any(|p| watched.concerns(p))
                {
                    let _ = tx.send(());
                }
            })
            .context("cannot watch the config's files")?;
        for (dir, mode) in dirs {
            watcher.watch(&dir, mode).with_context(|| format!("cannot watch {}", dir.display()))?;
        }
        let reloader = Arc::clone(self);
        tokio::spawn(async move {
            while rx.recv().await.is_some() {
                while let Ok(Some(())) = tokio::time::timeout(QUIET, rx.recv()).await {}
                reloader.reload("a file changed").await;
            }
        });
        Ok(Some(watcher))
    }
}

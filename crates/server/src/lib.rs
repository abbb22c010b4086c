//! The `tollgate` binary: `serve` (HTTP/JSON), `simulate` (JSON lines), and client commands.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};

pub mod answer;
pub mod auth;
pub mod browsers;
pub mod carry;
pub mod client;
pub mod config;
mod digest;
pub mod engine;
pub mod error_log;
pub mod fields;
pub mod http;
pub mod listen;
pub mod live;
pub mod metrics;
pub mod names;
pub mod otel;
pub mod plot;
pub mod resp;
pub mod rls;
pub mod simulate;
pub mod stats;
pub mod store;
pub mod types;

use config::{FileConfig, Overrides, Settings};
use engine::Engine;

/// Rate limits as a service: token buckets and fixed windows stored as two numbers.
#[derive(Debug, Parser)]
#[command(name = "tollgate", version, about)]
pub struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the HTTP API (the default command).
    Serve(ServeArgs),
    /// Replay JSON lines from stdin deterministically; one JSON line out per line in.
    Simulate {
        /// A config file whose [limits.*] tables define named limits.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Fixes every random choice (window alignments, shard choices).
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Also draw, per (name, key), the tokens over the simulated time with every request
        /// marked granted, refused or reserved: an SVG written to FILE.
        #[arg(long, value_name = "FILE")]
        plot: Option<PathBuf>,
    },
    /// Take tokens from a limit on a running server.
    Limit(client::ClientArgs),
    /// Ask whether a limit would grant tokens, taking nothing.
    Check(client::ClientArgs),
    /// Forget a limit's state for a key.
    Reset(client::ClientArgs),
    /// Show a limit's value for a key.
    Value(client::ClientArgs),
    /// Print the limits a server defines as a TypeScript declaration for the
    /// `tollgate-client` npm package (its compiler then accepts those names).
    Types(types::TypesArgs),
    /// Load the config as `serve` would (file, RLS config, flags, environment) and say
    /// whether it is valid: exit 0 if it is, 1 with each error if not. Opens no store.
    CheckConfig(CheckArgs),
}

#[derive(Debug, Args, Default)]
struct CheckArgs {
    /// The config file (default: TOLLGATE_CONFIG, if set).
    #[arg(long)]
    config: Option<PathBuf>,
    /// envoyproxy/ratelimit's configuration: a YAML file, or a directory of them.
    #[arg(long, value_name = "PATH")]
    rls_config: Option<PathBuf>,
    /// The address `serve` would listen on (as its --listen).
    #[arg(long)]
    listen: Option<String>,
    /// The store `serve` would open (as its --store): only its form is checked.
    #[arg(long)]
    store: Option<String>,
    /// The Redis protocol's address `serve` would listen on (as its --resp-listen).
    #[arg(long, value_name = "ADDR")]
    resp_listen: Option<String>,
    /// As `serve --allow-unauthenticated-public`: a non-loopback address without tokens.
    #[arg(long)]
    allow_unauthenticated_public: bool,
}

#[derive(Debug, Args, Default)]
#[command(after_help = environment_help())]
struct ServeArgs {
    /// The config file (TOML: [server] and [limits.<name>] tables); read again on SIGHUP
    /// and when it changes.
    #[arg(long)]
    config: Option<PathBuf>,
    /// The address to listen on (default 127.0.0.1:8787).
    #[arg(long)]
    listen: Option<String>,
    /// The store: memory, sqlite://PATH[?synchronous=full], redis://HOST:PORT[/DB],
    /// redis+cluster://HOST:PORT,HOST:PORT, redis+sentinel://HOST:PORT,HOST:PORT/MASTER
    /// (rediss… over TLS; ?ca=FILE, ?replicas=N and more: see the guide,
    /// docs/src/operations/redis-ha.md) or postgres://USER@HOST/DB (default
    /// sqlite://tollgate.db).
    #[arg(long)]
    store: Option<String>,
    /// Listen on a non-loopback address without tokens, knowing anyone who can reach it can
    /// use and reset the limits.
    #[arg(long)]
    allow_unauthenticated_public: bool,
    /// Also serve Envoy's rate limit service (RLS v3, gRPC) on this address, for example
    /// 127.0.0.1:8081; needs --rls-config.
    #[arg(long, value_name = "ADDR")]
    rls_listen: Option<String>,
    /// envoyproxy/ratelimit's configuration: a YAML file, or a directory of them (one domain
    /// each); read again on SIGHUP and when it changes. Also enables `POST /json` on the
    /// HTTP listener.
    #[arg(long, value_name = "PATH")]
    rls_config: Option<PathBuf>,
    /// Also serve the Redis protocol on this address, for example 127.0.0.1:6380:
    /// redis-cell's CL.THROTTLE and the TG.* commands, for any Redis client.
    #[arg(long, value_name = "ADDR")]
    resp_listen: Option<String>,
}

/// `serve --help`'s list of variables.
fn environment_help() -> String {
    let mut help = String::from(
        "Environment (a flag overrides its variable, which overrides the file's [server]):\n",
    );
    help.push_str(&format!("  {:<32} the config file (--config)\n", config::CONFIG_VAR));
    for s in config::SETTINGS {
        let how = match s.kind {
            config::Kind::Text => "",
            config::Kind::List => ", comma-separated",
            config::Kind::Bool => ", true or false",
            config::Kind::Count => ", a whole number",
            config::Kind::Duration => ", ms or 10s, 1m",
        };
        let added = if s.field.ends_with("okens") { ", added to the file's" } else { "" };
        let reload = if s.live { "; a reload applies it" } else { "" };
        help.push_str(&format!("  {:<32} [server] {}{how}{added}{reload}\n", s.var, s.field));
    }
    help.push_str(
        "\nSIGHUP, or a change of the config's files, reloads the limits, allowInlineConfig, \
         allowConfigOverride, corsOrigins, allowedHosts and the RLS rules at once, keeping every \
         state; an invalid config is refused whole. SIGTERM drains: /healthz answers 503 for \
         drainDelay, then requests in flight get shutdownDeadline to finish.",
    );
    if cfg!(feature = "otel") {
        help.push_str(
            "\n\nTracing (OpenTelemetry): with OTEL_EXPORTER_OTLP_ENDPOINT (or \
             OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) set, each rate-limit request is a span \
             exported over OTLP/HTTP, its parent the caller's traceparent. The standard \
             OTEL_EXPORTER_OTLP_PROTOCOL (http/protobuf or http/json), _HEADERS, _TIMEOUT, \
             OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER(_ARG), OTEL_BSP_*, \
             OTEL_TRACES_EXPORTER=none and OTEL_SDK_DISABLED apply. Without an endpoint nothing \
             is exported.",
        );
    }
    help
}

/// Where `serve` and `check-config` read their config: the file, flags, the environment.
fn sources(
    config: Option<PathBuf>,
    flags: Vec<(&'static str, &str, Option<String>)>,
) -> live::Sources {
    let vars = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)));
    let mut overrides = Overrides::from_env(vars);
    for (field, flag, value) in flags {
        overrides = overrides.flag(field, flag, value);
    }
    let config = config.or_else(|| std::env::var_os(config::CONFIG_VAR).map(PathBuf::from));
    live::Sources { config, overrides }
}

/// What a runtime thread of `serve` runs each time it runs out of work (see [`when_idle`]).
static IDLE: std::sync::OnceLock<fn()> = std::sync::OnceLock::new();

/// Has each of the server's runtime threads run `idle` whenever it runs out of work (tokio's
/// `on_thread_park`), from the next [`run`] on: the binary gives its allocator's freed memory
/// back to the system there (`main.rs`). Set once; `false` if it was set already.
pub fn when_idle(idle: fn()) -> bool {
    IDLE.set(idle).is_ok()
}

/// Runs the command line; what `main` calls.
///
/// # Errors
///
/// Whatever stopped the command, for `main` to print.
pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command.unwrap_or(Command::Serve(ServeArgs::default())) {
        Command::Serve(args) => serve(args),
        Command::Simulate { config, seed, plot } => {
            let (limits, concurrency) = match config {
                Some(path) => {
                    let file = FileConfig::load(&path)?;
                    (file.named_limits()?, file.named_concurrency()?)
                }
                None => (Vec::new(), Vec::new()),
            };
            let sim = simulate::Simulation::with_concurrency(&limits, &concurrency, seed);
            let stdin = std::io::stdin();
            if stdin.is_terminal() {
                eprintln!("tollgate simulate: reading JSON lines from stdin, e.g.");
                eprintln!(
                    r#"  {{"at": 0, "op": "limit", "name": "a", "config": {{"kind": "token bucket", "rate": 10, "period": "1m"}}}}"#
                );
            }
            let sim = if plot.is_some() { sim.recording() } else { sim };
            sim.run(stdin.lock(), std::io::stdout().lock())?;
            if let (Some(path), Some(svg)) = (&plot, sim.plot()) {
                std::fs::write(path, svg)
                    .with_context(|| format!("cannot write the plot to {}", path.display()))?;
                eprintln!("tollgate simulate: plot written to {}", path.display());
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Limit(args) => client::run("limit", args),
        Command::Check(args) => client::run("check", args),
        Command::Reset(args) => client::run("reset", args),
        Command::Value(args) => client::run("value", args),
        Command::Types(args) => types::run(&args).map(|()| ExitCode::SUCCESS),
        Command::CheckConfig(args) => Ok(check_config(args)),
    }
}

/// `check-config`: every check `serve` runs before it opens the store (the files, the
/// variables, the store URL's form, the rule on public addresses without tokens).
fn check_config(args: CheckArgs) -> ExitCode {
    let rls_config = args.rls_config.map(|p| p.display().to_string());
    let sources = sources(
        args.config,
        vec![
            ("listen", "--listen", args.listen),
            ("store", "--store", args.store),
            ("rlsConfig", "--rls-config", rls_config),
            ("respListen", "--resp-listen", args.resp_listen),
        ],
    );
    let checked = sources.load().and_then(|loaded| {
        loaded.settings.public_without_tokens(args.allow_unauthenticated_public)?;
        Ok(loaded)
    });
    match checked {
        Ok(loaded) => {
            let file = match &sources.config {
                Some(path) => path.display().to_string(),
                None => "no config file (the example limits)".to_owned(),
            };
            let settings = &loaded.settings;
            let rates = settings.limits.iter().map(|(n, _)| n.as_str());
            let names: Vec<&str> =
                rates.chain(settings.concurrency.iter().map(|(n, _)| n.as_str())).collect();
            println!("{file}: ok, version {}", loaded.version);
            println!("  limits: {}", names::names_line(&names));
            if let (Some(path), Some(rls)) = (&loaded.settings.rls_config, &loaded.rls) {
                println!(
                    "  rls:    {} (domains: {})",
                    path.display(),
                    rls.domain_names().join(", ")
                );
            }
            println!(
                "  store:  {} (its form checked; not connected)",
                tollgate::store::redacted_url(&loaded.settings.store)
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn serve(args: ServeArgs) -> anyhow::Result<ExitCode> {
    let rls_config = args.rls_config.map(|p| p.display().to_string());
    let sources = sources(
        args.config,
        vec![
            ("listen", "--listen", args.listen),
            ("store", "--store", args.store),
            ("rlsListen", "--rls-listen", args.rls_listen),
            ("rlsConfig", "--rls-config", rls_config),
            ("respListen", "--resp-listen", args.resp_listen),
        ],
    );
    let loaded = sources.load()?;
    loaded.settings.public_without_tokens(args.allow_unauthenticated_public)?;
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    // Before the runtime: the exporter's blocking client must not be made on one of its
    // threads.
    let telemetry = otel::start()?;
    let tracing = telemetry.as_ref().map(otel::Exporting::describe);
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(idle) = IDLE.get().copied() {
        builder.on_thread_park(idle);
    }
    let runtime = builder.enable_all().build()?;
    let served = runtime.block_on(serve_async(sources, loaded, tracing));
    drop(runtime);
    if let Some(telemetry) = telemetry {
        telemetry.shutdown();
    }
    served?;
    Ok(ExitCode::SUCCESS)
}

/// Builds the app for `settings`: the store, the limiter, the router's state.
///
/// # Errors
///
/// The store cannot be opened, or the RLS config loaded.
pub async fn app(settings: &Settings) -> anyhow::Result<(Arc<http::App>, Sweeps)> {
    let rls = match &settings.rls_config {
        None => None,
        Some(path) => Some(rls::RlsConfig::load(path)?),
    };
    app_of(settings, rls, String::new()).await
}

/// Builds the app for `settings` and `rls`, the config of `version`.
///
/// # Errors
///
/// The store cannot be opened.
pub async fn app_of(
    settings: &Settings,
    rls: Option<rls::RlsConfig>,
    version: String,
) -> anyhow::Result<(Arc<http::App>, Sweeps)> {
    let opened =
        store::open(&settings.store, settings.max_keys, settings.store_deadline, &settings.lease)
            .await?;
    // When tracing, a request's time in the store is one of its span's fields.
    let store = otel::Timed::wrap(Arc::clone(&opened.store));
    let engine = Arc::new(Engine::opened(store, &opened, settings, version));
    let rls = rls.map(|config| Arc::new(rls::Rls::new(Arc::clone(&engine), config)));
    // usize::MAX until the first sweep has counted the file's states.
    let sqlite_states = Arc::new(std::sync::atomic::AtomicUsize::new(usize::MAX));
    let app = http::App {
        engine: Arc::clone(&engine),
        rls,
        tokens: auth::Tokens { full: settings.tokens.clone(), read: settings.read_tokens.clone() },
        metrics: Arc::default(),
        memory: opened.memory.clone(),
        breaker: opened.breaker.clone(),
        leases: opened.leases.clone(),
        health_deadline: settings.store_deadline,
        errors: Arc::default(),
        accept_errors: Arc::new(error_log::ErrorLog::new("connections could not be accepted")),
        body_timeout: settings.http.body_timeout,
        sqlite_states: Arc::clone(&sqlite_states),
        browsers: browsers::BrowserRules::new(
            !settings.tokens.is_empty(),
            settings.listen,
            &settings.cors_origins,
            &settings.allowed_hosts,
        )
        .shared(),
        public_metrics: settings.public_metrics,
        sqlite: opened.sqlite.clone(),
        live: Arc::default(),
    };
    let sweeps = Sweeps { sqlite: opened.sqlite, memory: opened.memory, engine, sqlite_states };
    Ok((Arc::new(app), sweeps))
}

/// The stores whose full states the server deletes now and then (Redis expires them by
/// itself; PostgreSQL's stay until a request leaves them full).
pub struct Sweeps {
    sqlite: Option<Arc<tollgate::store::SqliteStore>>,
    memory: Option<Arc<tollgate::MemoryStore>>,
    /// The limits defined now (a reload changes them).
    engine: Arc<Engine>,
    /// The SQLite file's states after the last sweep, for `/metrics`.
    sqlite_states: Arc<std::sync::atomic::AtomicUsize>,
}

/// How often the memory store is swept of full states: soon enough that memory goes back
/// within seconds of a flood of keys refilling. (A segment is swept on its own too, each
/// time it has doubled in size.)
const MEMORY_SWEEP: Duration = Duration::from_secs(10);

/// How often the SQLite store is swept: a sweep reads the whole table.
const SQLITE_SWEEP: Duration = Duration::from_secs(60);

/// How often the SQLite store is checked (its file still there, and writable).
const SQLITE_CHECK: Duration = Duration::from_secs(10);

impl Sweeps {
    /// Sweeps the stores on their schedules, off the runtime's threads, until the process
    /// ends.
    pub fn start(self) {
        if let Some(memory) = self.memory {
            tokio::spawn(async move {
                let mut every = tokio::time::interval(MEMORY_SWEEP);
                loop {
                    every.tick().await;
                    let memory = Arc::clone(&memory);
                    let swept = tokio::task::spawn_blocking(move || memory.sweep()).await;
                    tracing::debug!(swept = swept.unwrap_or(0), "dropped full states");
                }
            });
        }
        if let Some(sqlite) = &self.sqlite {
            // The file can still be written where it should: said in the log when that
            // changes (`/healthz` says it at every call).
            let sqlite = Arc::clone(sqlite);
            tokio::spawn(async move {
                let mut every = tokio::time::interval(SQLITE_CHECK);
                let mut failing = false;
                loop {
                    every.tick().await;
                    let sqlite = Arc::clone(&sqlite);
                    let checked = tokio::task::spawn_blocking(move || sqlite.check()).await;
                    match checked {
                        Ok(Err(e)) if !failing => {
                            tracing::error!("{e}");
                            failing = true;
                        }
                        Ok(Ok(())) if failing => {
                            tracing::info!("sqlite: the file can be written again");
                            failing = false;
                        }
                        _ => {}
                    }
                }
            });
        }
        if let Some(sqlite) = self.sqlite {
            let (engine, states) = (self.engine, self.sqlite_states);
            tokio::spawn(async move {
                let mut every = tokio::time::interval(SQLITE_SWEEP);
                loop {
                    every.tick().await;
                    // Copied out, so that a reload waiting for the old config's requests
                    // does not wait for a sweep.
                    let limits: Vec<(String, tollgate::Config)> = (engine.current().limiter())
                        .defined()
                        .map(|(n, c)| (n.to_owned(), *c))
                        .collect();
                    let sqlite = Arc::clone(&sqlite);
                    let states = Arc::clone(&states);
                    let swept = tokio::task::spawn_blocking(move || {
                        // Every state with its time to be full; then, by name, the states an
                        // earlier version wrote without it.
                        let full = sqlite.sweep_full().unwrap_or(0);
                        let named: usize =
                            limits.iter().map(|(name, c)| sqlite.sweep(name, c).unwrap_or(0)).sum();
                        if let Ok(count) = sqlite.count() {
                            states.store(count, std::sync::atomic::Ordering::Relaxed);
                        }
                        full + named
                    })
                    .await;
                    tracing::debug!(swept = swept.unwrap_or(0), "deleted full states");
                }
            });
        }
    }
}

async fn serve_async(
    sources: live::Sources,
    loaded: live::Loaded,
    tracing: Option<String>,
) -> anyhow::Result<()> {
    let (settings, overridden) = (loaded.settings, loaded.overridden);
    let (app, sweeps) = app_of(&settings, loaded.rls, loaded.version).await?;
    let listener = tokio::net::TcpListener::bind(settings.listen)
        .await
        .with_context(|| format!("cannot listen on {}", settings.listen))?;
    let addr: SocketAddr = listener.local_addr()?;
    let (rls_listener, rls_addr) = bind_if_set(settings.rls_listen).await?;
    let (resp_listener, resp_addr) = bind_if_set(settings.resp_listen).await?;
    warn_of_weak_settings(&settings);
    // Each listener may hold maxConnections; all must fit in the open files allowed.
    let listeners = 1 + u64::from(rls_addr.is_some()) + u64::from(resp_addr.is_some());
    let http_limits = config::HttpLimits {
        max_connections: listen::fit_open_files(settings.http.max_connections, listeners),
        ..settings.http
    };
    // Full states carry no information: delete them now and then.
    sweeps.start();
    // SIGHUP, or a change of the files, reloads the config.
    let parts = live::Swapped {
        engine: Arc::clone(&app.engine),
        rls: app.rls.clone(),
        browsers: Arc::clone(&app.browsers),
        status: Arc::clone(&app.live),
    };
    let reloader = Arc::new(live::Reloader::new(sources, settings.clone(), overridden, parts));
    reloader.on_hangup();
    let _watcher = match reloader.on_change() {
        Ok(watcher) => watcher,
        Err(e) => {
            tracing::warn!("{e:#}; reload with SIGHUP");
            None
        }
    };
    // One signal drains both listeners, then stops them: /healthz (and gRPC health) say so
    // at once, and the listeners go on accepting for drainDelay.
    let (drain_tx, drain_rx) = tokio::sync::watch::channel(false);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let drain_delay = settings.http.drain_delay;
    let live = Arc::clone(&app.live);
    let signalled = shutdown();
    tokio::spawn(async move {
        signalled.await;
        live.draining.store(true, std::sync::atomic::Ordering::Relaxed);
        let _ = drain_tx.send(true);
        if !drain_delay.is_zero() {
            tracing::info!("draining: /healthz says so; accepting for {drain_delay:?} more");
            tokio::time::sleep(drain_delay).await;
        }
        let _ = stop_tx.send(true);
    });
    let when = |rx: tokio::sync::watch::Receiver<bool>| {
        let mut rx = rx.clone();
        async move {
            let _ = rx.wait_for(|yes| *yes).await;
        }
    };
    let stopped = || when(stop_rx.clone());
    let rls_server = match (rls_listener, &app.rls) {
        (Some(listener), Some(rls)) => {
            let service = rls::service::Service::new(
                Arc::clone(rls),
                app.tokens.clone(),
                Arc::clone(&app.errors),
            );
            let deadline = settings.http.body_timeout + settings.store_deadline;
            Some(tokio::spawn(rls::service::serve(
                listener,
                service,
                http_limits,
                deadline,
                Arc::clone(&app.accept_errors),
                when(drain_rx.clone()),
                stopped(),
            )))
        }
        _ => None,
    };
    let resp_server = resp_listener.map(|listener| {
        let resp = resp::Resp {
            engine: Arc::clone(&app.engine),
            tokens: app.tokens.clone(),
            metrics: Arc::clone(&app.metrics),
            errors: Arc::clone(&app.errors),
            throttle_name: settings.resp_throttle_name.clone(),
            idle_timeout: settings.resp_idle_timeout,
            command_timeout: settings.http.body_timeout,
            auth_timeout: settings.http.header_timeout,
            max_period: settings.resp_max_period,
            guesses: resp::guesses::Guesses::default(),
            next_id: std::sync::atomic::AtomicU64::new(0),
        };
        tokio::spawn(resp::serve(
            listener,
            Arc::new(resp),
            http_limits,
            Arc::clone(&app.accept_errors),
            stopped(),
        ))
    });
    // Summing up failed requests in the log, when an interval of them is over.
    let errors = Arc::clone(&app);
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(1));
        loop {
            every.tick().await;
            errors.errors.flush();
            errors.accept_errors.flush();
        }
    });
    let accept_errors = Arc::clone(&app.accept_errors);
    let leases = app.leases.clone();
    // Last, once every signal has its handler: whoever reads the banner may send them.
    print_banner(&settings, addr, rls_addr, resp_addr, tracing.as_deref());
    serve_http(listener, http::router(app), http_limits, accept_errors, stopped()).await?;
    if let Some(rls_server) = rls_server {
        rls_server.await??;
    }
    if let Some(resp_server) = resp_server {
        resp_server.await??;
    }
    // Leased tokens go back to the limit now, not when their leases expire.
    if let Some(leasing) = leases {
        match tokio::time::timeout(settings.store_deadline, leasing.release()).await {
            Ok(Ok(())) => tracing::info!("leases returned"),
            Ok(Err(e)) => tracing::warn!("leases not returned ({e}); they expire by themselves"),
            Err(_) => tracing::warn!("leases not returned in time; they expire by themselves"),
        }
    }
    tracing::info!("stopped");
    Ok(())
}

/// Tokens shorter than this are warned of at start.
const SHORT_TOKEN: usize = 16;

/// Warns, at start, of settings that work but are likely not what was meant: a token short
/// enough to guess, and a `respThrottleName` that names a limit of `[limits]` (whose config
/// then decides what `CL.THROTTLE` may take).
fn warn_of_weak_settings(settings: &Settings) {
    for (field, tokens) in [("tokens", &settings.tokens), ("readTokens", &settings.read_tokens)] {
        for token in tokens.iter().filter(|t| t.chars().count() < SHORT_TOKEN) {
            tracing::warn!(
                "a token of [server] {field} is {} characters long: one that short can be \
                 guessed; use {SHORT_TOKEN} random characters or more (openssl rand -hex 16 \
                 gives 32)",
                token.chars().count()
            );
        }
    }
    let name = &settings.resp_throttle_name;
    let defined = settings.limits.iter().find(|(n, _)| n == name);
    if let (Some(_), Some((_, config))) = (settings.resp_listen, defined) {
        let takes = if settings.allow_config_override {
            "its arguments replace the config (allowConfigOverride = true)".to_owned()
        } else {
            format!(
                "only arguments that make its config ({}) take from it; others are refused",
                resp::throttle::as_arguments(config)
            )
        };
        tracing::warn!(
            "respThrottleName {name:?} is a limit of [limits]: CL.THROTTLE takes from it, and \
             {takes}"
        );
    }
}

/// A listener bound to `addr` if one is set, and the address it got (port 0: the one the
/// system picked).
async fn bind_if_set(
    addr: Option<SocketAddr>,
) -> anyhow::Result<(Option<tokio::net::TcpListener>, Option<SocketAddr>)> {
    let Some(addr) = addr else { return Ok((None, None)) };
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    let bound = listener.local_addr()?;
    Ok((Some(listener), Some(bound)))
}

/// Serves `router` on `listener` over HTTP/1.1 until `stop` resolves, with the limits of
/// `limits`: a connection slow to send a request's headers, or idle between requests, for
/// longer than `header_timeout` is closed; connections beyond `max_connections` are closed
/// when accepted (see [`listen::serve_connections`]); once `stop` resolves no connection is
/// accepted, requests in flight get `shutdown_deadline` to finish, and any connection left
/// then is cut.
///
/// # Errors
///
/// The listener fails for good.
pub async fn serve_http(
    listener: tokio::net::TcpListener,
    router: http::Service,
    limits: config::HttpLimits,
    accept_errors: Arc<error_log::ErrorLog>,
    stop: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::service::TowerToHyperService;

    let header_timeout = limits.header_timeout;
    listen::serve_connections(
        listener,
        "http",
        limits,
        b"",
        accept_errors,
        stop,
        |tcp, mut stopping| {
            let service = TowerToHyperService::new(router.clone());
            async move {
                let connection = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(header_timeout)
                    .serve_connection(TokioIo::new(tcp), service);
                let mut connection = std::pin::pin!(connection);
                tokio::select! {
                    // The connection first, and no random order to draw at every wake-up.
                    biased;
                    _ = connection.as_mut() => {}
                    () = stopping.wait() => {
                        connection.as_mut().graceful_shutdown();
                        let _ = connection.await;
                    }
                }
            }
        },
    )
    .await
}

fn print_banner(
    settings: &Settings,
    addr: SocketAddr,
    rls: Option<SocketAddr>,
    resp: Option<SocketAddr>,
    tracing: Option<&str>,
) {
    let rates = settings.limits.iter().map(|(n, _)| n.as_str());
    let names: Vec<&str> =
        rates.chain(settings.concurrency.iter().map(|(n, _)| n.as_str())).collect();
    println!("tollgate listening on http://{addr}");
    let memory = settings.store == "memory" || settings.store == "memory://";
    let forgets =
        if memory { " (in this process only: a restart forgets every state)" } else { "" };
    println!("  store:  {}{forgets}", tollgate::store::redacted_url(&settings.store));
    println!("  limits: {}", names::names_line(&names));
    if let Some(tracing) = tracing {
        println!("  traces: {tracing}");
    }
    println!("  auth:   {}", if settings.tokens.is_empty() { "none" } else { "bearer tokens" });
    if let Some(rls) = rls {
        println!("  rls:    grpc://{rls} (envoy.service.ratelimit.v3)");
    }
    if let Some(resp) = resp {
        println!("  resp:   redis://{resp} (CL.THROTTLE as {}, TG.*)", settings.resp_throttle_name);
    }
    if let Some(name) = names.first() {
        let auth =
            if settings.tokens.is_empty() { "" } else { " -H 'Authorization: Bearer <token>'" };
        println!("try:");
        println!(
            "  curl -s{auth} -X POST http://{addr}/v1/limit -d '{{\"name\":\"{name}\",\"key\":\"alice\"}}'"
        );
    }
}

/// Resolves on Ctrl-C or SIGTERM; in-flight requests are then finished before exit. The
/// handlers are installed when this is called, not when the future is first polled, so that
/// a signal sent as soon as the banner is out is caught.
fn shutdown() -> impl std::future::Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let term = signal(SignalKind::terminate());
        let interrupt = signal(SignalKind::interrupt());
        async move {
            match (term, interrupt) {
                (Ok(mut term), Ok(mut interrupt)) => {
                    tokio::select! {
                        _ = term.recv() => {},
                        _ = interrupt.recv() => {},
                    }
                }
                _ => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        }
    }
    #[cfg(not(unix))]
    async {
        let _ = tokio::signal::ctrl_c().await;
    }
}

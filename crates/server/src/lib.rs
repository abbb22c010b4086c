//! The `tollgate` binary: `serve` (HTTP/JSON), `simulate` (JSON lines), and client commands.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand};

pub mod client;
pub mod config;
pub mod engine;
pub mod http;
pub mod metrics;
pub mod simulate;
pub mod store;

use config::{FileConfig, Overrides, Settings};
use engine::Engine;
use tollgate::RateLimiter;

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
    },
    /// Take tokens from a limit on a running server.
    Limit(client::ClientArgs),
    /// Ask whether a limit would grant tokens, taking nothing.
    Check(client::ClientArgs),
    /// Forget a limit's state for a key.
    Reset(client::ClientArgs),
    /// Show a limit's value for a key.
    Value(client::ClientArgs),
}

#[derive(Debug, Args, Default)]
struct ServeArgs {
    /// The config file (TOML: [server] and [limits.<name>] tables).
    #[arg(long)]
    config: Option<PathBuf>,
    /// The address to listen on (default 127.0.0.1:8787).
    #[arg(long)]
    listen: Option<String>,
    /// The store: memory, sqlite://PATH[?synchronous=full], redis://HOST:PORT[/DB],
    /// redis+cluster://HOST:PORT,HOST:PORT or postgres://USER@HOST/DB (default
    /// sqlite://tollgate.db).
    #[arg(long)]
    store: Option<String>,
    /// Listen on a non-loopback address without tokens, knowing anyone who can reach it can
    /// use and reset the limits.
    #[arg(long)]
    allow_unauthenticated_public: bool,
}

/// Runs the command line; what `main` calls.
///
/// # Errors
///
/// Whatever stopped the command, for `main` to print.
pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command.unwrap_or(Command::Serve(ServeArgs::default())) {
        Command::Serve(args) => serve(args),
        Command::Simulate { config, seed } => {
            let limits = match config {
                Some(path) => FileConfig::load(&path)?.named_limits()?,
                None => Vec::new(),
            };
            let sim = simulate::Simulation::new(&limits, seed);
            let stdin = std::io::stdin();
            if stdin.is_terminal() {
                eprintln!("tollgate simulate: reading JSON lines from stdin, e.g.");
                eprintln!(
                    r#"  {{"at": 0, "op": "limit", "name": "a", "config": {{"kind": "token bucket", "rate": 10, "period": "1m"}}}}"#
                );
            }
            sim.run(stdin.lock(), std::io::stdout().lock())?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Limit(args) => client::run("limit", args),
        Command::Check(args) => client::run("check", args),
        Command::Reset(args) => client::run("reset", args),
        Command::Value(args) => client::run("value", args),
    }
}

fn serve(args: ServeArgs) -> anyhow::Result<ExitCode> {
    let file = match &args.config {
        Some(path) => FileConfig::load(path)?,
        None => FileConfig::default(),
    };
    let overrides = Overrides {
        listen: args.listen.clone(),
        store: args.store.clone(),
        tokens_env: std::env::var("TOLLGATE_TOKENS").ok(),
    };
    let settings = file.settings(&overrides, args.config.is_none())?;
    if settings.tokens.is_empty()
        && !settings.listen.ip().is_loopback()
        && !args.allow_unauthenticated_public
    {
        bail!(
            "refusing to listen on {} without tokens: anyone who can reach it could use and reset \
             your limits. Set [server] tokens or TOLLGATE_TOKENS, or pass --allow-unauthenticated-public.",
            settings.listen
        );
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(serve_async(settings))?;
    Ok(ExitCode::SUCCESS)
}

/// Builds the app for `settings`: the store, the limiter, the router's state.
///
/// # Errors
///
/// The store cannot be opened.
pub async fn app(settings: &Settings) -> anyhow::Result<(Arc<http::App>, Sweeps)> {
    let opened = store::open(&settings.store, settings.max_keys).await?;
    let mut builder = RateLimiter::builder(opened.store);
    for (name, config) in &settings.limits {
        builder = builder.define(name.as_str(), *config);
    }
    for name in &settings.fail_open {
        builder = builder.fail_open(name.as_str());
    }
    let permissions = engine::Permissions {
        inline_config: settings.allow_inline_config,
        config_override: settings.allow_config_override,
    };
    let engine = Engine::new(builder.build(), permissions);
    let app = http::App {
        engine: Arc::new(engine),
        tokens: settings.tokens.clone(),
        metrics: metrics::Metrics::default(),
        memory: opened.memory.clone(),
    };
    let sweeps =
        Sweeps { sqlite: opened.sqlite, memory: opened.memory, limits: settings.limits.clone() };
    Ok((Arc::new(app), sweeps))
}

/// The stores whose full states the server deletes now and then (Redis expires them by
/// itself; PostgreSQL's stay until a request leaves them full).
pub struct Sweeps {
    sqlite: Option<Arc<tollgate::store::SqliteStore>>,
    memory: Option<Arc<tollgate::MemoryStore>>,
    limits: Vec<(String, tollgate::Config)>,
}

/// How often the memory store is swept of full states: soon enough that memory goes back
/// within seconds of a flood of keys refilling. (A segment is swept on its own too, each
/// time it has doubled in size.)
const MEMORY_SWEEP: Duration = Duration::from_secs(10);

/// How often the SQLite store is swept: a sweep reads the whole table.
const SQLITE_SWEEP: Duration = Duration::from_secs(60);

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
        if let Some(sqlite) = self.sqlite {
            let limits = self.limits;
            tokio::spawn(async move {
                let mut every = tokio::time::interval(SQLITE_SWEEP);
                loop {
                    every.tick().await;
                    let (sqlite, limits) = (Arc::clone(&sqlite), limits.clone());
                    let swept = tokio::task::spawn_blocking(move || {
                        // Every state with its time to be full; then, by name, the states an
                        // earlier version wrote without it.
                        let full = sqlite.sweep_full().unwrap_or(0);
                        let named: usize =
                            limits.iter().map(|(name, c)| sqlite.sweep(name, c).unwrap_or(0)).sum();
                        full + named
                    })
                    .await;
                    tracing::debug!(swept = swept.unwrap_or(0), "deleted full states");
                }
            });
        }
    }
}

async fn serve_async(settings: Settings) -> anyhow::Result<()> {
    let (app, sweeps) = app(&settings).await?;
    let listener = tokio::net::TcpListener::bind(settings.listen)
        .await
        .with_context(|| format!("cannot listen on {}", settings.listen))?;
    let addr: SocketAddr = listener.local_addr()?;
    print_banner(&settings, addr);
    // Full states carry no information: delete them now and then.
    sweeps.start();
    // Answers are small and each one is a single write: send it at once rather than let
    // Nagle's algorithm hold it back waiting for an ACK.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::warn!("cannot set TCP_NODELAY: {e}");
        }
    });
    axum::serve(listener, http::router(app)).with_graceful_shutdown(shutdown()).await?;
    tracing::info!("stopped");
    Ok(())
}

fn print_banner(settings: &Settings, addr: SocketAddr) {
    let names: Vec<&str> = settings.limits.iter().map(|(n, _)| n.as_str()).collect();
    println!("tollgate listening on http://{addr}");
    println!("  store:  {}", settings.store);
    println!(
        "  limits: {}",
        if names.is_empty() { "(none defined)".into() } else { names.join(", ") }
    );
    println!("  auth:   {}", if settings.tokens.is_empty() { "none" } else { "bearer tokens" });
    if let Some(name) = names.first() {
        let auth =
            if settings.tokens.is_empty() { "" } else { " -H 'Authorization: Bearer <token>'" };
        println!("try:");
        println!(
            "  curl -s{auth} -X POST http://{addr}/v1/limit -d '{{\"name\":\"{name}\",\"key\":\"alice\"}}'"
        );
    }
}

/// Resolves on Ctrl-C or SIGTERM; in-flight requests are then finished before exit.
async fn shutdown() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        if let Ok(mut term) =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        {
            term.recv().await;
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
    tracing::info!("shutting down: finishing requests in flight");
}

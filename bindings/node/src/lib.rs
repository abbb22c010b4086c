//! The native half of the `tollgate` npm package: tollgate's engine inside a Node process.
//!
//! Each operation takes the JSON body of its HTTP request and gives back what the server
//! would answer (status, body, `RateLimit` header fields), from the same engine, so that the
//! package's TypeScript half reads answers exactly as `tollgate-client` reads the server's.
//! Store work runs on napi-rs's tokio runtime, never on Node's event loop; an operation that
//! needs no I/O (the memory store, a take from a lease) is answered at once ([`Limiter::run`]).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures_util::FutureExt;
use napi::JsValue;
use napi::bindgen_prelude::*;
use napi_derive::napi;
use tollgate_server::config::Settings;
use tollgate_server::engine::{Engine, Op};
use tollgate_server::store::{self, Leasing};

mod take;

use take::{Settler, reply};

/// mimalloc, not the C library's allocator: a call on a networked store allocates on Node's
/// thread and frees on the runtime's (and the other way), which glibc's allocator pays for
/// in locks and consolidation (a fifth of Node's thread on Redis, by `perf`); with mimalloc
/// the process used about a quarter less CPU for the same calls (BENCHMARKS.md).
///
/// Its v2 line (Cargo.toml), not v3: mimalloc takes the thread that loads it for the
/// process's main thread. In a worker thread that loaded the addon first, v3.3 tore that
/// heap down when the worker exited, and the next thread given the same thread id (glibc
/// reuses an exited thread's descriptor, and the id is its address) took the torn heap for
/// its own and crashed at its first allocation: the second worker to load the package, when
/// the main thread never had (mimalloc's issue 1287, fixed after the v3 the crate ships).
/// v2 keeps the main heap for the process, whoever exits.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The settings of `config`: JSON of a config file's shape (its `[server]` store settings and
/// its `[limits.*]`), checked as a file is.
fn settings(config: &str) -> Result<Settings> {
    Settings::from_json(config).map_err(|e| Error::new(Status::InvalidArg, format!("{e:#}")))
}

/// Checks `config` as [`open`] would, opening nothing: a bad store URL or limit throws at
/// once, where the constructor is called.
#[napi]
pub fn validate(config: String) -> Result<()> {
    settings(&config).map(|_| ())
}

/// A limit's header fields as an in-process engine writes them.
#[napi(object)]
pub struct Policy {
    /// Its `RateLimit-Policy` member: `"name";q=10;w=60`.
    pub member: String,
    /// Its capacity, which ranks how tight it is when the fields list only the tightest.
    pub capacity: f64,
}

/// The policy of each limit of `config` named in `names` (null for a name it does not
/// define), as the engine's header fields give them, without opening a store: what a
/// middleware writes its fields with from its first request.
#[napi]
pub fn policies(config: String, names: Vec<String>) -> Result<Vec<Option<Policy>>> {
    let settings = settings(&config)?;
    let policy = |name: &String| {
        let (_, config) = settings.limits.iter().find(|(defined, _)| defined == name)?;
        let member = tollgate::tower::fields::policy_member(name, config);
        Some(Policy { member, capacity: config.capacity() })
    };
    Ok(names.iter().map(policy).collect())
}

/// Opens the store and defines the limits of `config` (see [`validate`]).
#[napi]
pub async fn open(config: String) -> Result<Limiter> {
    let settings = settings(&config)?;
    let opened =
        store::open(&settings.store, settings.max_keys, settings.store_deadline, &settings.lease)
            .await
            .map_err(|e| Error::new(Status::GenericFailure, format!("{e:#}")))?;
    let engine = Engine::in_process(&opened, &settings);
    Ok(Limiter {
        engine: Arc::new(engine),
        settler: Arc::new(OnceLock::new()),
        leases: opened.leases,
        deadline: settings.store_deadline,
    })
}

/// A store opened, with the limits defined on it.
#[napi]
pub struct Limiter {
    engine: Arc<Engine>,
    /// Where the answers of its take functions that waited go (set once, by `settleWith`).
    settler: Arc<OnceLock<Arc<Settler>>>,
    leases: Option<Leasing>,
    deadline: Duration,
}

#[napi]
impl Limiter {
    /// Answers `op` (`limit`, `check`, `transaction`, `reset`, `value`, `adjust`) with the
    /// JSON `body` (the string of `reply`). The work is polled once here, inside the runtime's
    /// context: what needs no I/O (the memory store, a leased limit's take from its lease) is
    /// answered now, as a string; the rest goes on on the runtime's threads, and a promise is
    /// answered.
    #[napi(ts_return_type = "string | Promise<string>")]
    pub fn run<'e>(
        &self,
        env: &'e Env,
        op: String,
        body: String,
    ) -> Result<Either<String, PromiseRaw<'e, String>>> {
        let op = operation(&op)?;
        let engine = Arc::clone(&self.engine);
        let mut work = Box::pin(async move { engine.run(op, body.as_bytes()).await });
        match within_runtime_if_available(|| (&mut work).now_or_never()) {
            Some(answer) => Ok(Either::A(reply(answer))),
            None => Ok(Either::B(env.spawn_future(async move { Ok(reply(work.await)) })?)),
        }
    }

    /// Sets the function through which the answers of the take functions that had to wait
    /// come back, as `[id, answer]`; once per limiter.
    #[napi]
    pub fn settle_with(&self, settler: Settler) -> Result<()> {
        self.settler
            .set(Arc::new(settler))
            .map_err(|_| Error::new(Status::GenericFailure, "settleWith was called already"))
    }

    /// The function that takes from the limit `name` (see `take::function`), or null if no
    /// limit has that name.
    #[napi(ts_return_type = "NativeTake | null")]
    pub fn taker(&self, env: &Env, name: String) -> Result<Option<take::Raw>> {
        let Some(named) = self.engine.named(&name) else { return Ok(None) };
        take::function(env.raw(), Arc::clone(&self.settler), named).map(Some)
    }

    /// The function that takes from every limit of `names` at once, all or nothing (with
    /// `counts[i]` tokens from `names[i]`, 1 where that is null), and writes the numbers of
    /// the middleware's header fields into `out` (see `take::limits_function`); null if a
    /// name is not defined.
    #[napi(ts_return_type = "NativeTakeAll | null")]
    pub fn limits_taker(
        &self,
        env: &Env,
        names: Vec<String>,
        counts: Vec<Option<f64>>,
        out: Unknown<'_>,
    ) -> Result<Option<take::Raw>> {
        let limits: Vec<(&str, Option<f64>)> = names
            .iter()
            .map(String::as_str)
            .zip(counts.iter().copied().chain(std::iter::repeat(None)))
            .collect();
        let Some(named) = self.engine.named_limits(&limits) else { return Ok(None) };
        take::limits_function(env.raw(), Arc::clone(&self.settler), named, out.value().value)
            .map(Some)
    }

    /// The store's clock (`{"now": ms}`), as `GET /v1/time` answers it.
    #[napi]
    pub async fn time(&self) -> Result<String> {
        Ok(reply(self.engine.time().await))
    }

    /// The limits defined, every default filled in, as `GET /v1/config` answers them.
    #[napi]
    pub fn config(&self) -> String {
        reply(self.engine.config())
    }

    /// Gives back every lease this process holds (a leased limit's tokens not used yet go
    /// back to the store for other processes), waiting at most the store deadline.
    #[napi]
    pub async fn close(&self) -> Result<()> {
        let Some(leasing) = self.leases.clone() else { return Ok(()) };
        match tokio_timeout(self.deadline, leasing.release()).await {
            Some(Ok(())) => Ok(()),
            Some(Err(e)) => Err(Error::new(Status::GenericFailure, e.to_string())),
            None => Err(Error::new(
                Status::GenericFailure,
                format!("the leases were not all given back within {:?}", self.deadline),
            )),
        }
    }
}

/// `work`, or none if it takes longer than `deadline`.
async fn tokio_timeout<T>(deadline: Duration, work: impl Future<Output = T>) -> Option<T> {
    tokio::time::timeout(deadline, work).await.ok()
}

fn operation(name: &str) -> Result<Op> {
    Op::parse(name)
        .ok_or_else(|| Error::new(Status::InvalidArg, format!("unknown operation {name:?}")))
}

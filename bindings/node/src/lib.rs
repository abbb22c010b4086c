//! The native half of the `tollgate` npm package: tollgate's engine inside a Node process.
//!
//! Each operation takes the JSON body of its HTTP request and gives back what the server
//! would answer (status, body, `RateLimit` header fields), from the same engine, so that the
//! package's TypeScript half reads answers exactly as `tollgate-client` reads the server's.
//! Store work runs on napi-rs's tokio runtime, never on Node's event loop; an operation that
//! needs no I/O (the memory store, a take from a lease) is answered at once ([`Limiter::run`]).

use std::cell::RefCell;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures_util::FutureExt;
use napi::bindgen_prelude::*;
use napi::threadsafe_function::{ThreadsafeFunction, ThreadsafeFunctionCallMode};
use napi::{JsString, JsValue};
use napi_derive::napi;
use tollgate_server::answer::Answer;
use tollgate_server::config::Settings;
use tollgate_server::engine::{Engine, Op};
use tollgate_server::store::{self, Leasing};

/// What an operation is answered, as one string (one string crosses into JavaScript for
/// less than an object of three fields does): the HTTP status the server would send (three
/// digits), the JSON body (compact: no newline in it), then each header field
/// (`RateLimit-Policy`, `RateLimit`, `Retry-After`) as `\n` name `\n` value.
fn reply(answer: Answer) -> String {
    let mut out = answer.status.as_u16().to_string();
    out.push_str(&answer.body.to_json());
    for (name, value) in answer.headers {
        out.push('\n');
        out.push_str(name.as_str());
        out.push('\n');
        out.push_str(&value);
    }
    out
}

/// A decision as a number, or an answer that is not one as its string (see [`take`]).
type Taken = Either<f64, String>;

/// The function the answers of `take` that had to wait come back through, as `[id, answer]`,
/// on the event loop: one for the limiter, made once (a thread-safe function of its own per
/// call, as a promise from Rust makes, cost more than the call). Weak: the package's
/// JavaScript holds the event loop open while answers are awaited.
type Settler = ThreadsafeFunction<(u32, Taken), (), (u32, Taken), Status, false, true>;

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
        taker: Arc::new(Taker {
            engine: Arc::new(engine),
            settler: OnceLock::new(),
            immediate: opened.memory.is_some(),
        }),
        handle: AtomicU32::new(NO_HANDLE),
        leases: opened.leases,
        deadline: settings.store_deadline,
    })
}

/// What [`take`] needs of a limiter.
struct Taker {
    engine: Arc<Engine>,
    /// Where the answers of `take` that waited go (set once, by `settleWith`).
    settler: OnceLock<Arc<Settler>>,
    /// The memory store: every operation is ready at its first poll.
    immediate: bool,
}

/// A limiter not given a handle yet.
const NO_HANDLE: u32 = u32::MAX;

thread_local! {
    /// The limiters of this JavaScript thread, by the handle [`Limiter::handle`] gave:
    /// [`take`] finds its limiter here by a number. Reaching it through the object as a
    /// method (`napi_unwrap`, napi-rs's type tag check and borrow bookkeeping) was a fifth
    /// of a call on the memory store.
    static TAKERS: RefCell<Vec<Option<Arc<Taker>>>> = const { RefCell::new(Vec::new()) };
}

/// A store opened, with the limits defined on it.
#[napi]
pub struct Limiter {
    taker: Arc<Taker>,
    /// Its handle among [`TAKERS`] of the thread that asked for one, or [`NO_HANDLE`].
    handle: AtomicU32,
    leases: Option<Leasing>,
    deadline: Duration,
}

impl Drop for Limiter {
    /// Gives its handle back (on the thread that finalizes it, the one whose handle it is).
    fn drop(&mut self) {
        let handle = self.handle.load(Ordering::Relaxed);
        if handle == NO_HANDLE {
            return;
        }
        let _ = TAKERS.try_with(|takers| {
            let mut takers = takers.borrow_mut();
            if let Some(slot) = takers.get_mut(handle as usize)
                && slot.as_ref().is_some_and(|t| Arc::ptr_eq(t, &self.taker))
            {
                *slot = None;
            }
        });
    }
}

#[napi]
impl Limiter {
    /// Answers `op` (`limit`, `check`, `transaction`, `reset`, `value`) with the JSON `body`
    /// (the string of `reply`). The work is polled once here, inside the runtime's context: what needs
    /// no I/O (the memory store, a leased limit's take from its lease) is answered now, as a
    /// string; the rest goes on on the runtime's threads, and a promise is answered.
    #[napi(ts_return_type = "string | Promise<string>")]
    pub fn run<'e>(
        &self,
        env: &'e Env,
        op: String,
        body: String,
    ) -> Result<Either<String, PromiseRaw<'e, String>>> {
        let op = operation(&op)?;
        let engine = Arc::clone(&self.taker.engine);
        let mut work = Box::pin(async move { engine.run(op, body.as_bytes()).await });
        match within_runtime_if_available(|| (&mut work).now_or_never()) {
            Some(answer) => Ok(Either::A(reply(answer))),
            None => Ok(Either::B(env.spawn_future(async move { Ok(reply(work.await)) })?)),
        }
    }

    /// Sets the function through which the answers of [`take`] that had to wait
    /// come back, as `[id, answer]`; once per limiter.
    #[napi]
    pub fn settle_with(&self, settler: Settler) -> Result<()> {
        self.taker
            .settler
            .set(Arc::new(settler))
            .map_err(|_| Error::new(Status::GenericFailure, "settleWith was called already"))
    }

    /// This limiter's handle for [`take`] on the calling thread, given once.
    #[napi]
    pub fn handle(&self) -> Result<u32> {
        let given = self.handle.load(Ordering::Relaxed);
        if given != NO_HANDLE {
            return Ok(given);
        }
        let handle = TAKERS.with(|takers| {
            let mut takers = takers.borrow_mut();
            let free = takers.iter().position(Option::is_none);
            let handle = free.unwrap_or(takers.len());
            if handle == takers.len() {
                takers.push(None);
            }
            takers[handle] = Some(Arc::clone(&self.taker));
            handle
        });
        self.handle.store(handle as u32, Ordering::Relaxed);
        Ok(handle as u32)
    }

    /// The store's clock (`{"now": ms}`), as `GET /v1/time` answers it.
    #[napi]
    pub async fn time(&self) -> Result<String> {
        Ok(reply(self.taker.engine.time().await))
    }

    /// The limits defined, every default filled in, as `GET /v1/config` answers them.
    #[napi]
    pub fn config(&self) -> String {
        reply(self.taker.engine.config())
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

/// `take`'s `flags`: a key was given (else `key` is ignored: no key differs from the empty key).
const KEY: u32 = 1;
/// A count was given (else `count` is ignored and the default, 1, taken).
const COUNT: u32 = 2;
/// Reserve (SPEC §4).
const RESERVE: u32 = 4;
/// A `limit` (else a `check`, which writes nothing).
const WRITES: u32 = 8;

/// A `limit` or `check` of a limit defined at open, by the limiter's `handle` (see
/// [`Limiter::handle`]), without JSON: the calls made most. `flags` is the sum of 1 (a key is
/// given), 2 (a count is given), 4 (reserve) and 8 (a `limit`, which writes). A decision is
/// a number (`-1`: granted with tokens on hand; `w >= 0`: granted after a wait of `w` ms, a
/// reservation; `-2 - w`: refused, retry in `w` ms); anything else is the answer
/// [`Limiter::run`] would give (an error), as its string. Answered now when no I/O was
/// needed; else nothing is returned, and the answer comes back through the settler (see
/// `settleWith`) with `id`. Throws for an argument of the wrong type or a handle of no
/// limiter (then nothing was taken).
#[napi(ts_return_type = "number | string | null")]
pub fn take(
    handle: u32,
    name: JsString<'_>,
    key: JsString<'_>,
    count: f64,
    flags: u32,
    id: u32,
) -> Result<Option<Taken>> {
    let taker = TAKERS.with(|takers| takers.borrow().get(handle as usize).cloned().flatten());
    let Some(taker) = taker else {
        return Err(Error::new(Status::InvalidArg, format!("no limiter has the handle {handle}")));
    };
    let count = (flags & COUNT != 0).then_some(count);
    let (reserve, writes) = (flags & RESERVE != 0, flags & WRITES != 0);
    let number = |taken: std::result::Result<tollgate::Decision, Answer>| match taken {
        Ok(decision) => Either::A(Engine::decision_number(decision)),
        Err(answer) => Either::B(reply(answer)),
    };
    let (mut name_buf, mut key_buf) = ([0; SHORT], [0; SHORT]);
    let name = read_str(name, &mut name_buf)?;
    let key = if flags & KEY != 0 { Some(read_str(key, &mut key_buf)?) } else { None };
    if taker.immediate {
        // The memory store: ready at the first poll, polled where it stands (no box, no
        // runtime: it has no timer or socket), the strings where they were read.
        let work = taker.engine.take(&name, key.as_deref(), count, reserve, writes);
        return match work.now_or_never() {
            Some(taken) => Ok(Some(number(taken))),
            None => {
                Err(Error::new(Status::GenericFailure, "the memory store did not answer at once"))
            }
        };
    }
    let Some(settler) = taker.settler.get().cloned() else {
        return Err(Error::new(Status::GenericFailure, "settleWith was not called"));
    };
    let (name, key) = (name.into_owned(), key.map(std::borrow::Cow::into_owned));
    let engine = Arc::clone(&taker.engine);
    let mut work = Box::pin(async move {
        number(engine.take(&name, key.as_deref(), count, reserve, writes).await)
    });
    if let Some(answer) = within_runtime_if_available(|| (&mut work).now_or_never()) {
        return Ok(Some(answer));
    }
    napi::bindgen_prelude::spawn(async move {
        let answer = work.await;
        settler.call((id, answer), ThreadsafeFunctionCallMode::NonBlocking);
    });
    Ok(None)
}

/// The bytes of a string argument [`read_str`] reads into the stack; a longer one is read as
/// napi-rs reads a `String`.
const SHORT: usize = 128;

/// The string `value`, read into `buf` with one Node-API call where it fits (napi-rs's
/// `String` asks twice, for the length and then the bytes, and allocates: a tenth of a call
/// on the memory store for a name and a key).
#[allow(unsafe_code)]
fn read_str<'b>(
    value: JsString<'_>,
    buf: &'b mut [u8; SHORT],
) -> Result<std::borrow::Cow<'b, str>> {
    let raw = value.value();
    let mut written = 0;
    // SAFETY: `buf` is writable for `SHORT` bytes, and Node writes at most `SHORT - 1` of a
    // string's UTF-8 and a NUL into it; `raw` is a handle of this call's arguments, alive
    // until the call returns.
    let status = unsafe {
        napi::sys::napi_get_value_string_utf8(
            raw.env,
            raw.value,
            buf.as_mut_ptr().cast(),
            SHORT,
            &mut written,
        )
    };
    if status != napi::sys::Status::napi_ok {
        return Err(Error::new(Status::StringExpected, "a string was expected"));
    }
    // Node writes whole characters only (of at most 4 bytes), so a string that did not fit
    // left fewer than 4 bytes free: below that it is all there.
    if written + 4 < SHORT {
        let text = std::str::from_utf8(&buf[..written])
            .map_err(|e| Error::new(Status::InvalidArg, e.to_string()))?;
        return Ok(std::borrow::Cow::Borrowed(text));
    }
    Ok(std::borrow::Cow::Owned(value.into_utf8()?.into_owned()?))
}

/// `work`, or none if it takes longer than `deadline`.
async fn tokio_timeout<T>(deadline: Duration, work: impl Future<Output = T>) -> Option<T> {
    tokio::time::timeout(deadline, work).await.ok()
}

fn operation(name: &str) -> Result<Op> {
    Op::parse(name)
        .ok_or_else(|| Error::new(Status::InvalidArg, format!("unknown operation {name:?}")))
}

//! The native half of the `pytollgate` Python package: tollgate's engine inside a Python
//! process.
//!
//! Each operation takes the JSON body of its HTTP request and gives back what the server would
//! answer (status and body), from the same engine, so that the package's Python half reads
//! answers with `tollgate_client`'s own readers. The work is polled once where it is asked
//! (inside the runtime's context): what needs no I/O (the memory store, a take from a lease)
//! is answered there. The rest runs on this module's tokio runtime: a blocking call waits for
//! it with the GIL released; an asyncio call gets its answer through the event loop's
//! `call_soon_threadsafe`, with no thread of its own.
//!
//! After `fork` the child has none of the parent's threads: `forked` (called by
//! `os.register_at_fork`) makes the next call start a runtime of the child's own, and the
//! Python half opens its networked stores anew on it.

use std::future::Future;
use std::pin::Pin;
use std::ptr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::time::Duration;

use futures_util::FutureExt;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyBytes};
use tokio::runtime::Runtime;
use tollgate::{
    Call, Config, MemoryStore, RateLimiter, Request, Status, Taken as TakenStatus, Target,
    TransactionTaken,
};
use tollgate_server::answer::Answer;
use tollgate_server::config::Settings;
use tollgate_server::engine::{Defined, Engine as Served, Op};
use tollgate_server::fields::{Member, rate_limit_fields};
use tollgate_server::store::{self, Leasing, Stored};

/// The runtime every store's I/O runs on (its threads, not Python's), once made: one per
/// process. Every runtime made is leaked, never dropped: in a forked child the parent's has
/// no threads, and dropping it would wait for them.
static RUNTIME: AtomicPtr<Runtime> = AtomicPtr::new(ptr::null_mut());

/// This process's runtime, started by its first use.
fn runtime() -> &'static Runtime {
    let current = RUNTIME.load(Ordering::Acquire);
    if current.is_null() {
        return start_runtime();
    }
    // SAFETY: RUNTIME only ever holds null or a pointer of `Box::into_raw` that is never
    // freed (see `start_runtime`): a valid `Runtime` for the rest of the process.
    #[allow(unsafe_code)]
    unsafe {
        &*current
    }
}

#[cold]
#[inline(never)]
fn start_runtime() -> &'static Runtime {
    let made = tokio::runtime::Builder::new_multi_thread()
        .thread_name("tollgate")
        .enable_all()
        .build()
        .expect("the tokio runtime of pytollgate could not start");
    let made = Box::into_raw(Box::new(made));
    match RUNTIME.compare_exchange(ptr::null_mut(), made, Ordering::AcqRel, Ordering::Acquire) {
        // SAFETY: `made` is now RUNTIME's, and never freed.
        #[allow(unsafe_code)]
        Ok(_) => unsafe { &*made },
        Err(_) => {
            // Another thread started one first: ours was never shared, and is dropped (its
            // threads shut down) here.
            // SAFETY: `made` came from `Box::into_raw` above and was never published.
            #[allow(unsafe_code)]
            drop(unsafe { Box::from_raw(made) });
            runtime()
        }
    }
}

/// Called in a child right after `fork` (`os.register_at_fork(after_in_child=...)`): the
/// parent's runtime has no threads here, so nothing would drive its I/O or its timers. It is
/// forgotten (leaked) and the next call starts this process's own; the runtime threads that
/// were handing answers to Python in the parent are not here either.
#[pyfunction]
fn forked() {
    RUNTIME.store(ptr::null_mut(), Ordering::Release);
    ATTACHED.store(0, Ordering::SeqCst);
}

/// How often a blocking wait comes back to let Python run its signal handlers (Ctrl-C's
/// `KeyboardInterrupt`), which run only between bytecodes of the main thread: a wait for a
/// store that does not answer must not hold them until the store deadline.
const SIGNALS_EVERY: Duration = Duration::from_millis(50);

/// `work` to its end on the runtime, the GIL released while it waits; a signal handler that
/// raises (Ctrl-C) ends the wait, and the work is dropped.
fn wait<T: Send>(py: Python<'_>, mut work: Work<T>) -> PyResult<T> {
    loop {
        let slice = py.detach(|| {
            runtime().block_on(async { tokio::time::timeout(SIGNALS_EVERY, &mut work).await })
        });
        match slice {
            Ok(done) => return Ok(done),
            Err(_) => py.check_signals()?,
        }
    }
}

/// An answer: the HTTP status the server would send, its JSON body, and its header fields
/// (`RateLimit-Policy`, `RateLimit`, `Retry-After`: names in lower case).
type Reply = (u16, Vec<u8>, Vec<(String, String)>);

fn reply(answer: Answer) -> Reply {
    let headers = answer.headers.into_iter().map(|(n, v)| (n.as_str().to_owned(), v)).collect();
    (answer.status.as_u16(), answer.body.to_json().into_bytes(), headers)
}

/// A decision as a number (`-1`: granted with tokens on hand; `w >= 0`: granted after a wait
/// of `w` ms; `-2 - w`: refused, retry in `w` ms), or an answer that is not one.
enum Taken {
    Decision(f64),
    Answer(Reply),
}

impl Taken {
    fn of(taken: Result<tollgate::Decision, Answer>) -> Self {
        match taken {
            Ok(decision) => Taken::Decision(Served::decision_number(decision)),
            Err(answer) => Taken::Answer(reply(answer)),
        }
    }

    fn into_py(self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        match self {
            Taken::Decision(n) => Ok(n.into_pyobject(py)?.into_any().unbind()),
            Taken::Answer(answer) => reply_py(py, answer),
        }
    }
}

/// The settings of `config`: JSON of a config file's shape, checked as a file is.
fn settings(config: &str) -> PyResult<Settings> {
    Settings::from_json(config).map_err(|e| PyValueError::new_err(format!("{e:#}")))
}

/// Checks `config` as `open` would, opening nothing: a bad store URL or limit raises
/// `ValueError` at once.
#[pyfunction]
fn validate(config: &str) -> PyResult<()> {
    settings(config).map(|_| ())
}

/// Opens the store of `config` and defines its limits, waiting with the GIL released.
#[pyfunction]
fn open(py: Python<'_>, config: &str) -> PyResult<Engine> {
    let settings = settings(config)?;
    wait(py, Box::pin(Engine::open(settings)))?
}

/// The same without waiting: `done(True, engine)` or `done(False, error)` is called on a
/// runtime thread (with the GIL) once it is open or has failed. Tied to no event loop: every
/// loop waiting for it is told by `done`.
#[pyfunction]
fn open_async(config: &str, done: Py<PyAny>) -> PyResult<()> {
    let settings = settings(config)?;
    runtime().spawn(async move {
        let opened = Engine::open(settings).await;
        attach_from_runtime(|py| {
            let called = match opened.and_then(|engine| Ok(Py::new(py, engine)?.into_any())) {
                Ok(engine) => done.call1(py, (true, engine)),
                Err(e) => done.call1(py, (false, e.into_value(py))),
            };
            if let Err(e) = called {
                e.write_unraisable(py, None);
            }
        });
    });
    Ok(())
}

/// Set when the interpreter begins to exit ([`quiesce`]): a runtime thread that would take
/// the GIL then must not (a thread that asks for it during finalization is ended where it
/// stands, and its unwinding drops Python objects without the GIL: a crash).
static EXITING: AtomicBool = AtomicBool::new(false);
/// Runtime threads between deciding to take the GIL and having given it back.
static ATTACHED: AtomicUsize = AtomicUsize::new(0);

/// Runs `f` with the GIL from a runtime thread, unless the interpreter is exiting (then the
/// Python objects `f` would have touched are dropped without it: their references are freed
/// later, or never, which is no matter at exit).
fn attach_from_runtime(f: impl FnOnce(Python<'_>)) {
    ATTACHED.fetch_add(1, Ordering::SeqCst);
    if !EXITING.load(Ordering::SeqCst) {
        Python::attach(f);
    }
    ATTACHED.fetch_sub(1, Ordering::SeqCst);
}

/// Registered with `atexit`: from now on no runtime thread takes the GIL, and those that
/// have decided to are waited for (at most a second, the GIL released meanwhile).
#[pyfunction]
fn quiesce(py: Python<'_>) {
    EXITING.store(true, Ordering::SeqCst);
    py.detach(|| {
        let deadline = std::time::Instant::now() + Duration::from_secs(1);
        while ATTACHED.load(Ordering::SeqCst) > 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    });
}

/// Sets `future`'s result (or exception) from the event loop's own thread, unless it was
/// cancelled meanwhile (see `pytollgate._aio.settle`).
fn settle(py: Python<'_>, event_loop: &Py<PyAny>, future: &Py<PyAny>, value: PyResult<Py<PyAny>>) {
    static SETTLE: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let result = (|| -> PyResult<()> {
        let settle = SETTLE.get_or_try_init(py, || {
            Ok::<_, PyErr>(py.import("pytollgate._aio")?.getattr("settle")?.unbind())
        })?;
        let (ok, value) = match value {
            Ok(value) => (true, value),
            Err(e) => (false, e.into_value(py).into_any()),
        };
        event_loop.call_method1(py, "call_soon_threadsafe", (settle, future, ok, value))?;
        Ok(())
    })();
    if let Err(e) = result {
        // A loop closed with calls in flight (asyncio.run ended, a task's loop stopped): no
        // one waits for those answers, and saying so once per call would bury the log.
        let closed = event_loop
            .call_method0(py, "is_closed")
            .and_then(|closed| closed.is_truthy(py))
            .unwrap_or(false);
        if !closed {
            e.write_unraisable(py, None);
        }
    }
}

/// A store opened, with its limits defined.
#[pyclass(frozen, module = "pytollgate._native")]
struct Engine {
    engine: Arc<Served>,
    /// The memory store: every operation is ready at its first poll.
    immediate: bool,
    leases: Option<Leasing>,
    deadline: Duration,
}

type Work<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl Engine {
    async fn open(settings: Settings) -> PyResult<Engine> {
        let opened = store::open(
            &settings.store,
            settings.max_keys,
            settings.store_deadline,
            &settings.lease,
        )
        .await
        .map_err(|e| PyRuntimeError::new_err(format!("{e:#}")))?;
        let engine = Served::in_process(&opened, &settings);
        Ok(Engine {
            engine: Arc::new(engine),
            immediate: opened.memory.is_some(),
            leases: opened.leases,
            deadline: settings.store_deadline,
        })
    }

    /// `work` answered now if it needs no I/O; else the work, to go on.
    fn now<T>(mut work: Work<T>) -> Result<T, Work<T>> {
        let _runtime = runtime().enter();
        (&mut work).now_or_never().ok_or(work)
    }

    /// `work` to its end, blocking with the GIL released if it must wait.
    fn blocking<T: Send>(py: Python<'_>, work: Work<T>) -> PyResult<T> {
        match Self::now(work) {
            Ok(done) => Ok(done),
            Err(work) => wait(py, work),
        }
    }

    /// `work` to its end for asyncio: `Some` when it is answered now, else `None` and
    /// `future` gets it.
    fn awaited<T: Send + 'static>(
        work: Work<T>,
        event_loop: Py<PyAny>,
        future: Py<PyAny>,
        into_py: fn(Python<'_>, T) -> PyResult<Py<PyAny>>,
    ) -> Option<T> {
        match Self::now(work) {
            Ok(done) => Some(done),
            Err(work) => {
                runtime().spawn(async move {
                    let done = work.await;
                    attach_from_runtime(|py| {
                        let value = into_py(py, done);
                        settle(py, &event_loop, &future, value);
                    });
                });
                None
            }
        }
    }

    fn run_work(&self, op: &str, body: &[u8]) -> PyResult<Work<Reply>> {
        let op = Op::parse(op)
            .ok_or_else(|| PyValueError::new_err(format!("unknown operation {op:?}")))?;
        let (engine, body) = (Arc::clone(&self.engine), body.to_vec());
        Ok(Box::pin(async move { reply(engine.run_in_process(op, &body).await) }))
    }

    fn take_work(
        &self,
        name: String,
        key: Option<String>,
        count: Option<&Bound<'_, PyAny>>,
        reserve: bool,
        writes: bool,
    ) -> PyResult<Work<Taken>> {
        let count = count.map(number).transpose()?;
        let engine = Arc::clone(&self.engine);
        Ok(Box::pin(async move {
            Taken::of(engine.take(&name, key.as_deref(), count, reserve, writes).await)
        }))
    }
}

/// A count as a number: `True` is no count (a `TypeError`, so that the JSON path refuses it
/// as it refuses it from every door), though Python's bools are ints.
fn number(count: &Bound<'_, PyAny>) -> PyResult<f64> {
    if count.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err("count is a number, not a bool"));
    }
    count.extract()
}

fn reply_py(py: Python<'_>, (status, body, headers): Reply) -> PyResult<Py<PyAny>> {
    Ok((status, PyBytes::new(py, &body), headers).into_pyobject(py)?.into_any().unbind())
}

fn taken_py(py: Python<'_>, taken: Taken) -> PyResult<Py<PyAny>> {
    taken.into_py(py)
}

#[pymethods]
impl Engine {
    /// Whether operations are answered at once (the memory store).
    #[getter]
    fn immediate(&self) -> bool {
        self.immediate
    }

    /// Answers `op` (`limit`, `check`, `transaction`, `reset`, `value`, `adjust`) with the
    /// JSON `body`: `(status, body, headers)`.
    fn run(&self, py: Python<'_>, op: &str, body: &[u8]) -> PyResult<Py<PyAny>> {
        let work = self.run_work(op, body)?;
        reply_py(py, Self::blocking(py, work)?)
    }

    /// The same for asyncio: the answer now, or None and `future` gets it.
    fn run_async(
        &self,
        py: Python<'_>,
        op: &str,
        body: &[u8],
        event_loop: Py<PyAny>,
        future: Py<PyAny>,
    ) -> PyResult<Option<Py<PyAny>>> {
        let work = self.run_work(op, body)?;
        Self::awaited(work, event_loop, future, reply_py).map(|done| reply_py(py, done)).transpose()
    }

    /// A `limit` (`writes`) or `check` of a limit defined at open, without JSON: a decision as
    /// a number (see `Taken`), or `(status, body, headers)` for anything else.
    #[pyo3(signature = (name, key, count, reserve, writes))]
    fn take(
        &self,
        py: Python<'_>,
        name: String,
        key: Option<String>,
        count: Option<&Bound<'_, PyAny>>,
        reserve: bool,
        writes: bool,
    ) -> PyResult<Py<PyAny>> {
        let work = self.take_work(name, key, count, reserve, writes)?;
        if self.immediate {
            // The memory store: ready where it stands, with the GIL held (no I/O).
            return match Self::now(work) {
                Ok(done) => done.into_py(py),
                Err(_) => Err(PyRuntimeError::new_err("the memory store did not answer at once")),
            };
        }
        Self::blocking(py, work)?.into_py(py)
    }

    /// The same for asyncio: the answer now, or None and `future` gets it.
    #[pyo3(signature = (name, key, count, reserve, writes, event_loop, future))]
    #[allow(clippy::too_many_arguments)]
    fn take_async(
        &self,
        py: Python<'_>,
        name: String,
        key: Option<String>,
        count: Option<&Bound<'_, PyAny>>,
        reserve: bool,
        writes: bool,
        event_loop: Py<PyAny>,
        future: Py<PyAny>,
    ) -> PyResult<Option<Py<PyAny>>> {
        let work = self.take_work(name, key, count, reserve, writes)?;
        Self::awaited(work, event_loop, future, taken_py).map(|done| done.into_py(py)).transpose()
    }

    /// The store's clock, as `GET /v1/time` answers it: `(status, body, headers)`.
    fn time(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let engine = Arc::clone(&self.engine);
        reply_py(py, Self::blocking(py, Box::pin(async move { reply(engine.time().await) }))?)
    }

    /// The same for asyncio.
    fn time_async(
        &self,
        py: Python<'_>,
        event_loop: Py<PyAny>,
        future: Py<PyAny>,
    ) -> PyResult<Option<Py<PyAny>>> {
        let engine = Arc::clone(&self.engine);
        let work: Work<Reply> = Box::pin(async move { reply(engine.time().await) });
        Self::awaited(work, event_loop, future, reply_py).map(|done| reply_py(py, done)).transpose()
    }

    /// The limits defined, every default filled in, as `GET /v1/config` answers them.
    fn config(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        reply_py(py, reply(self.engine.config()))
    }

    /// The limits of a middleware, `(name, count)` each, resolved now: a name not defined
    /// raises `ValueError` with the names that are.
    fn gate(&self, limits: Vec<(String, f64)>) -> PyResult<Gate> {
        Gate::new(&self.engine, limits)
    }

    /// Gives back every lease this process holds, waiting at most the store deadline (GIL
    /// released).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let Some(leasing) = self.leases.clone() else { return Ok(()) };
        let deadline = self.deadline;
        let releasing = async move { tokio::time::timeout(deadline, leasing.release()).await };
        let released = wait(py, Box::pin(releasing))?;
        match released {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(PyRuntimeError::new_err(e.to_string())),
            Err(_) => Err(PyRuntimeError::new_err(format!(
                "the leases were not all given back within {deadline:?}"
            ))),
        }
    }
}

/// One limit of a middleware, its config and header members made once.
struct GateLimit {
    name: Box<str>,
    config: Config,
    count: f64,
    /// Its `RateLimit-Policy` member.
    policy: String,
}

impl GateLimit {
    fn target(&self) -> Target<'_> {
        Target::Inline(&self.name, self.config)
    }

    fn request<'k>(&self, key: Option<&'k str>) -> Request<'k> {
        let request = Request::new().count(self.count);
        match key {
            Some(key) => request.key(key),
            None => request,
        }
    }
}

/// The limits of a middleware (one or several, taken all or nothing), resolved when the
/// middleware is made: each request takes them with its key, and what its header fields
/// need comes back with the decision, with no JSON and no look-up by name.
#[pyclass(frozen, module = "pytollgate._native")]
struct Gate {
    /// The limits defined when the gate was made (the engine's, which no reload replaces
    /// in-process).
    defined: Arc<Defined>,
    limits: Arc<[GateLimit]>,
    /// The limiter on the memory store as itself, when that is the store: its takes are
    /// made here, without a future.
    memory: Option<RateLimiter<Arc<MemoryStore>>>,
    /// `RateLimit-Policy` of a gate of one limit.
    policy: Option<String>,
}

/// A gate's answer: the decision and its header fields' numbers, or the store's failure
/// (`Err((status, message, may_have_taken))`).
type Gated = Result<Passage, (u16, String, bool)>;

/// A decision of a gate, with what the middleware writes of it.
struct Passage {
    ok: bool,
    /// Refused: the wait of the limit that refuses longest (ms).
    wait: f64,
    /// The limit that decides: the one refusing longest, else the one with the least left.
    index: usize,
    /// That limit's capacity, what it has left (NaN if unknown: granted by a fail-open
    /// limit while the store failed) and the ms until it is full.
    limit: f64,
    remaining: f64,
    reset: f64,
    /// `RateLimit-Policy` and `RateLimit`, unless unknown (a fail-open grant); the first is
    /// `None` for a gate of one limit, whose policy the gate holds.
    fields: Option<(Option<String>, String)>,
}

impl Gate {
    fn new(engine: &Served, limits: Vec<(String, f64)>) -> PyResult<Gate> {
        let defined = engine.current();
        let mut resolved = Vec::with_capacity(limits.len());
        for (name, count) in limits {
            let Some(config) = defined.limiter().defined_config(&name) else {
                let mut names: Vec<&str> = defined.limiter().defined().map(|(n, _)| n).collect();
                names.sort_unstable();
                return Err(PyValueError::new_err(format!(
                    "the limit {name:?} is not defined on this limiter (its limits: {}); define \
                     it in the limiter's limits={{...}}, or fix the name",
                    names.join(", ")
                )));
            };
            let policy = tollgate::tower::fields::policy_member(&name, &config);
            resolved.push(GateLimit { name: name.into(), config, count, policy });
        }
        if resolved.is_empty() {
            return Err(PyValueError::new_err("a middleware takes at least one limit"));
        }
        let memory = match &engine.stored {
            Some(Stored::Memory(memory)) => Some(defined.limiter().on(Arc::clone(memory))),
            _ => None,
        };
        let policy = match &resolved[..] {
            [one] => Some(one.policy.clone()),
            _ => None,
        };
        Ok(Gate { defined, limits: resolved.into(), memory, policy })
    }

    fn calls<'a>(limits: &'a [GateLimit], key: Option<&'a str>) -> Vec<Call<'a>> {
        limits.iter().map(|l| l.target().with(l.request(key))).collect()
    }

    /// The store failed, or the request cannot be taken (a key too long).
    fn failure(e: tollgate::Error) -> (u16, String, bool) {
        match e {
            tollgate::Error::Store(e) => (503, e.to_string(), e.may_have_taken()),
            e => (400, e.to_string(), false),
        }
    }

    fn of_single(limits: &[GateLimit], taken: Result<TakenStatus, tollgate::Error>) -> Gated {
        let taken = taken.map_err(Self::failure)?;
        Ok(Self::passage(limits, taken.decision.ok, &[taken.decision], &[taken.status]))
    }

    fn of_transaction(
        limits: &[GateLimit],
        taken: Result<TransactionTaken, tollgate::Error>,
    ) -> Gated {
        let taken = taken.map_err(Self::failure)?;
        Ok(Self::passage(limits, taken.decision.ok, &taken.decision.results, &taken.statuses))
    }

    fn passage(
        limits: &[GateLimit],
        ok: bool,
        results: &[tollgate::Decision],
        statuses: &[Status],
    ) -> Passage {
        let index = match tollgate::core::longest_refusal(results) {
            Some(i) => i,
            None => {
                // The least left of its capacity, the first of equals.
                let left = |i: usize| statuses[i].remaining / limits[i].config.capacity();
                (1..limits.len()).fold(0, |best, i| if left(i) < left(best) { i } else { best })
            }
        };
        let fields = if let [one] = limits {
            statuses[0]
                .is_known()
                .then(|| (None, tollgate::tower::fields::status_member(&one.name, &statuses[0])))
        } else {
            let members: Vec<Member<'_>> = limits
                .iter()
                .zip(statuses)
                .map(|(l, status)| Member {
                    name: &l.name,
                    policy: std::borrow::Cow::Borrowed(l.policy.as_str()),
                    capacity: l.config.capacity(),
                    status: *status,
                })
                .collect();
            rate_limit_fields(&members).map(|(policy, current)| (Some(policy), current))
        };
        Passage {
            ok,
            wait: if ok { 0.0 } else { results[index].retry_after.unwrap_or(0.0) },
            index,
            limit: limits[index].config.capacity(),
            remaining: statuses[index].remaining,
            reset: statuses[index].reset_after,
            fields,
        }
    }

    /// The decision for `key`, on the memory store made here; else its work. One limit is
    /// taken as itself (no transaction's plan to build), several as a transaction.
    fn work(&self, key: Option<&str>) -> Result<Gated, Work<Gated>> {
        if let Some(memory) = &self.memory {
            return Ok(match &self.limits[..] {
                [one] => Self::of_single(
                    &self.limits,
                    memory.limit_with_status(one.target(), one.request(key)),
                ),
                many => Self::of_transaction(
                    many,
                    memory.transaction_with_status(&Self::calls(many, key)),
                ),
            });
        }
        let (defined, limits) = (Arc::clone(&self.defined), Arc::clone(&self.limits));
        let key = key.map(str::to_owned);
        Err(Box::pin(async move {
            let limiter = defined.limiter();
            match &limits[..] {
                [one] => {
                    let taken =
                        limiter.limit_with_status_async(one.target(), one.request(key.as_deref()));
                    Self::of_single(&limits, taken.await)
                }
                many => {
                    let calls = Self::calls(many, key.as_deref());
                    Self::of_transaction(many, limiter.transaction_with_status_async(&calls).await)
                }
            }
        }))
    }
}

/// `(ok, wait, index, limit, remaining, reset, policy, current)`, or `(status, message,
/// may_have_taken)` for a failure. `policy` is None for a gate of one limit, whose policy
/// is the gate's (`Gate.policy`, made once), and both are None when unknown.
fn gated_py(py: Python<'_>, gated: Gated) -> PyResult<Py<PyAny>> {
    let tuple = match gated {
        Ok(p) => {
            let (policy, current) = match p.fields {
                Some((policy, current)) => (policy, Some(current)),
                None => (None, None),
            };
            (p.ok, p.wait, p.index, p.limit, p.remaining, p.reset, policy, current)
                .into_pyobject(py)?
        }
        Err(failed) => failed.into_pyobject(py)?,
    };
    Ok(tuple.into_any().unbind())
}

#[pymethods]
impl Gate {
    /// The decision for `key` (None: the limits' global value), blocking with the GIL
    /// released if the store must be waited for.
    fn decide(&self, py: Python<'_>, key: Option<&str>) -> PyResult<Py<PyAny>> {
        let gated = match self.work(key) {
            Ok(now) => now,
            Err(work) => Engine::blocking(py, work)?,
        };
        gated_py(py, gated)
    }

    /// The same for asyncio: the answer now, or None and `future` gets it.
    fn decide_async(
        &self,
        py: Python<'_>,
        key: Option<&str>,
        event_loop: Py<PyAny>,
        future: Py<PyAny>,
    ) -> PyResult<Option<Py<PyAny>>> {
        match self.work(key) {
            Ok(now) => gated_py(py, now).map(Some),
            Err(work) => Engine::awaited(work, event_loop, future, gated_py)
                .map(|done| gated_py(py, done))
                .transpose(),
        }
    }

    /// `RateLimit-Policy` of a gate of one limit (None for several: each decision brings
    /// the members that are listed).
    #[getter]
    fn policy(&self) -> Option<String> {
        self.policy.clone()
    }
}

/// tollgate's engine, for `pytollgate`.
#[pymodule]
fn _native(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_function(wrap_pyfunction!(validate, module)?)?;
    module.add_function(wrap_pyfunction!(open, module)?)?;
    module.add_function(wrap_pyfunction!(open_async, module)?)?;
    module.add_function(wrap_pyfunction!(forked, module)?)?;
    module.add_class::<Engine>()?;
    module.add_class::<Gate>()?;
    let quiesce = wrap_pyfunction!(quiesce, module)?;
    module.py().import("atexit")?.call_method1("register", (quiesce,))?;
    Ok(())
}

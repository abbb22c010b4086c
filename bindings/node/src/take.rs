//! The package's hottest calls, a `limit` or `check` of a limit defined at open and a
//! middleware's transaction of its limits, as a function of its own per limit (per
//! middleware), made with Node-API directly.
//!
//! Through napi-rs, a call paid for its per-call bookkeeping (a borrow scope with two
//! allocations, thread-local look-ups, a conversion per argument) and, through the engine,
//! for finding the limit by its name (the name's string read across, two hash look-ups):
//! together about half the instructions of a call on the memory store (BENCHMARKS.md). Here
//! the limit is found once, when its function is made ([`function`]); a call reads its
//! arguments with one Node-API call each and takes.
#![allow(unsafe_code)]

use std::borrow::Cow;
use std::ffi::{CString, c_void};
use std::panic::AssertUnwindSafe;
use std::ptr;
use std::sync::{Arc, OnceLock};

use futures_util::FutureExt;
use napi::bindgen_prelude::{Either3, Status, ToNapiValue, within_runtime_if_available};
use napi::sys;
use napi::threadsafe_function::{ThreadsafeFunction, ThreadsafeFunctionCallMode};
use tollgate::Clock as _;
use tollgate_server::answer::Answer;
use tollgate_server::engine::{Engine, Named, NamedLimits};

/// What an operation is answered, as one string (one string crosses into JavaScript for
/// less than an object of three fields does): the HTTP status the server would send (three
/// digits), the JSON body (compact: no newline in it), then each header field
/// (`RateLimit-Policy`, `RateLimit`, `Retry-After`) as `\n` name `\n` value.
pub(crate) fn reply(answer: Answer) -> String {
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

/// A decision as a number, or an answer that is not one as its string (see [`function`]),
/// or a transaction's numbers (see [`limits_function`]).
pub(crate) type Taken = Either3<f64, String, Vec<f64>>;

/// The function the answers of the take functions that had to wait come back through, as
/// `[id, answer]`, on the event loop: one for the limiter, made once (a thread-safe function
/// of its own per call, as a promise from Rust makes, cost more than the call). Weak: the
/// package's JavaScript holds the event loop open while answers are awaited. It holds that
/// JavaScript's engine weakly, since this limiter holds it (ts/index.ts, `settler`).
pub(crate) type Settler = ThreadsafeFunction<(u32, Taken), (), (u32, Taken), Status, false, true>;

/// `flags`: a key was given (else `key` is ignored: no key differs from the empty key).
const KEY: u32 = 1;
/// A count was given (else `count` is ignored and the default, 1, taken).
const COUNT: u32 = 2;
/// Reserve (SPEC §4).
const RESERVE: u32 = 4;
/// A `limit` (else a `check`, which writes nothing).
const WRITES: u32 = 8;

/// What a limit's function holds: its limit, and its limiter's settler.
struct Limit {
    settler: Arc<OnceLock<Arc<Settler>>>,
    named: Arc<Named>,
}

/// What a middleware's function holds: its limits, its limiter's settler, and the numbers
/// of its `Float64Array` (see [`limits_function`]), which it holds a reference to.
struct Limits {
    settler: Arc<OnceLock<Arc<Settler>>>,
    named: Arc<NamedLimits>,
    out: *mut f64,
    out_ref: sys::napi_ref,
}

/// What a function made here does when called: a take, with the call's arguments.
trait Takes {
    fn take(
        &self,
        env: sys::napi_env,
        argv: &[sys::napi_value; 4],
    ) -> Result<sys::napi_value, String>;

    /// Lets go of what it holds in JavaScript, as its function is collected.
    fn release(&self, _env: sys::napi_env) {}
}

/// A JavaScript value made here, handed to napi-rs as it is.
pub struct Raw(sys::napi_value);

impl ToNapiValue for Raw {
    unsafe fn to_napi_value(_: sys::napi_env, raw: Self) -> napi::Result<sys::napi_value> {
        Ok(raw.0)
    }
}

/// The function `(key, count, flags, id)` that takes from `named`: `flags` is the sum of 1
/// (a key is given), 2 (a count is given), 4 (reserve) and 8 (a `limit`, which writes). A
/// decision is a number (`-1`: granted with tokens on hand; `w >= 0`: granted after a wait
/// of `w` ms, a reservation; `-2 - w`: refused, retry in `w` ms); anything else is the
/// answer `run` would give (an error), as its string. Answered now when no I/O was needed;
/// else it returns null, and the answer comes back through the limiter's settler with
/// `id`. Throws a `TypeError` for an argument of the wrong type (then nothing was taken).
pub(crate) fn function(
    env: sys::napi_env,
    settler: Arc<OnceLock<Arc<Settler>>>,
    named: Named,
) -> napi::Result<Raw> {
    make(env, c"take", Limit { settler, named: Arc::new(named) })
}

/// The function `(key, flags, id)` that takes from every limit of `named` at once, all
/// or nothing, with one key (`flags` 1: a key is given, else none is), and gives its numbers:
/// the transaction's decision (a number, as [`function`]'s), then per limit its decision, the
/// tokens it has left and the ms until it is full (NaN, NaN when not known: granted because
/// the store failed and the limit fails open), and last the time they were written, ms since
/// the Unix epoch (the process's clock, `SystemClock`: a read of the CPU's counter, where
/// JavaScript's `Date.now()` costs a call into V8's runtime and the system's clock; the
/// middleware's `resetTime` is counted from it). Answered now when no I/O was needed: the
/// numbers are written into `out` (a `Float64Array` of at least `2 + 3 * limits`, given
/// once, here) and it returns 0; else it returns null, and the numbers come back through the limiter's settler
/// with `id`, as an array. An error is the answer `run` would give, as its string. Throws a
/// `TypeError` for an argument of the wrong type (then nothing was taken).
pub(crate) fn limits_function(
    env: sys::napi_env,
    settler: Arc<OnceLock<Arc<Settler>>>,
    named: NamedLimits,
    out: sys::napi_value,
) -> napi::Result<Raw> {
    let numbers = read_f64s(env, out, 2 + 3 * named.len()).map_err(napi::Error::from_reason)?;
    let mut out_ref = ptr::null_mut();
    // SAFETY: `out` is an argument of this call. The reference keeps the array, and so its
    // numbers, alive (and where they are: an ArrayBuffer's store never moves once made, and
    // reading it above made it) until the function is collected.
    if unsafe { sys::napi_create_reference(env, out, 1, &mut out_ref) } != sys::Status::napi_ok {
        return Err(napi::Error::from_reason("the take function could not hold its numbers"));
    }
    let out = numbers.as_mut_ptr();
    make(env, c"takeAll", Limits { settler, named: Arc::new(named), out, out_ref })
}

/// A JavaScript function named `name` that calls `data`'s [`Takes::take`].
fn make<T: Takes>(env: sys::napi_env, name: &std::ffi::CStr, data: T) -> napi::Result<Raw> {
    let data = Box::into_raw(Box::new(data));
    let mut function = ptr::null_mut();
    // SAFETY: `env` is the env of the call that makes the function; the function's data is
    // `data`, which the finalizer added next frees once the function is collected (or
    // here, if either call fails).
    unsafe {
        let made = sys::napi_create_function(
            env,
            name.as_ptr(),
            name.count_bytes() as isize,
            Some(call::<T>),
            data.cast(),
            &mut function,
        );
        if made != sys::Status::napi_ok
            || sys::napi_add_finalizer(
                env,
                function,
                data.cast(),
                Some(finalize::<T>),
                ptr::null_mut(),
                ptr::null_mut(),
            ) != sys::Status::napi_ok
        {
            drop(Box::from_raw(data));
            return Err(napi::Error::from_reason("the take function could not be made"));
        }
    }
    Ok(Raw(function))
}

/// Frees a function's data once the function is collected.
unsafe extern "C" fn finalize<T: Takes>(env: sys::napi_env, data: *mut c_void, _: *mut c_void) {
    // SAFETY: `data` is the box `make` made for this function, freed only here.
    let data = unsafe { Box::from_raw(data.cast::<T>()) };
    data.release(env);
}

/// The function's body: reads the arguments, takes, and makes the answer's value.
unsafe extern "C" fn call<T: Takes>(
    env: sys::napi_env,
    info: sys::napi_callback_info,
) -> sys::napi_value {
    let mut argc = 4;
    let mut argv = [ptr::null_mut(); 4];
    let mut data = ptr::null_mut();
    // SAFETY: `argv` has room for `argc` values; Node fills those not passed with undefined.
    let status = unsafe {
        sys::napi_get_cb_info(env, info, &mut argc, argv.as_mut_ptr(), ptr::null_mut(), &mut data)
    };
    if status != sys::Status::napi_ok {
        return throw(env, "tollgate: the call's arguments could not be read");
    }
    // SAFETY: `data` is the `T` of this function, alive while the function is.
    let data = unsafe { &*data.cast::<T>() };
    // A panic must not unwind into Node: it is thrown as an error instead.
    match std::panic::catch_unwind(AssertUnwindSafe(|| data.take(env, &argv))) {
        Ok(Ok(value)) => value,
        Ok(Err(message)) => throw(env, &message),
        Err(_) => throw(env, "tollgate: a take failed inside the addon"),
    }
}

impl Takes for Limit {
    /// A take of the limit with the arguments `argv` (see [`function`]).
    fn take(
        &self,
        env: sys::napi_env,
        argv: &[sys::napi_value; 4],
    ) -> Result<sys::napi_value, String> {
        let limit = self;
        let flags = read_u32(env, argv[2], "flags")?;
        let count = if flags & COUNT != 0 { Some(read_f64(env, argv[1], "count")?) } else { None };
        let (reserve, writes) = (flags & RESERVE != 0, flags & WRITES != 0);
        let mut key_buf = [0; SHORT];
        let key = if flags & KEY != 0 { Some(read_str(env, argv[0], &mut key_buf)?) } else { None };
        let Limit { settler, named } = limit;
        // The memory store: answered here, the key where it was read.
        if let Some(taken) = named.take_now(key.as_deref(), count, reserve, writes) {
            return answer(env, number(taken));
        }
        let Some(settler) = settler.get().cloned() else {
            return Err("tollgate: settleWith was not called".to_owned());
        };
        let id = read_u32(env, argv[3], "id")?;
        let (named, key) = (Arc::clone(named), key.map(Cow::into_owned));
        let mut work =
            Box::pin(
                async move { number(named.take(key.as_deref(), count, reserve, writes).await) },
            );
        if let Some(taken) = within_runtime_if_available(|| (&mut work).now_or_never()) {
            return answer(env, taken);
        }
        napi::bindgen_prelude::spawn(async move {
            let taken = work.await;
            settler.call((id, taken), ThreadsafeFunctionCallMode::NonBlocking);
        });
        null(env)
    }
}

impl Takes for Limits {
    /// A take of every limit with the arguments `argv` (see [`limits_function`]).
    fn take(
        &self,
        env: sys::napi_env,
        argv: &[sys::napi_value; 4],
    ) -> Result<sys::napi_value, String> {
        let flags = read_u32(env, argv[1], "flags")?;
        let mut key_buf = [0; SHORT];
        let key = if flags & KEY != 0 { Some(read_str(env, argv[0], &mut key_buf)?) } else { None };
        let Limits { settler, named, out, .. } = self;
        let len = 2 + 3 * named.len();
        // SAFETY: the array's `len` numbers at least (checked when the function was made), held
        // alive by `out_ref`; only this thread's JavaScript reads them, and not during the call.
        let out = unsafe { std::slice::from_raw_parts_mut(*out, len) };
        // The memory store: answered here, the key where it was read, the numbers written
        // where JavaScript reads them.
        if let Some(taken) = named.take_now(key.as_deref()) {
            return match taken {
                Ok(taken) => {
                    numbers(&taken, out);
                    answer(env, Taken::A(0.0))
                }
                Err(error) => answer(env, Taken::B(reply(error))),
            };
        }
        let Some(settler) = settler.get().cloned() else {
            return Err("tollgate: settleWith was not called".to_owned());
        };
        let id = read_u32(env, argv[2], "id")?;
        let (named, key) = (Arc::clone(named), key.map(Cow::into_owned));
        let mut work = Box::pin(async move { limits_taken(named.take(key.as_deref()).await, len) });
        // A leased limit's take from its lease needs no I/O.
        if let Some(taken) = within_runtime_if_available(|| (&mut work).now_or_never()) {
            if let Taken::C(numbers) = &taken {
                out[..len].copy_from_slice(numbers);
                return answer(env, Taken::A(0.0));
            }
            return answer(env, taken);
        }
        napi::bindgen_prelude::spawn(async move {
            let taken = work.await;
            settler.call((id, taken), ThreadsafeFunctionCallMode::NonBlocking);
        });
        null(env)
    }

    fn release(&self, env: sys::napi_env) {
        // SAFETY: the reference made with the function, deleted only here.
        unsafe { sys::napi_delete_reference(env, self.out_ref) };
    }
}

/// A transaction's outcome as what crosses: its `len` numbers (see [`limits_function`]), or
/// an error's answer.
fn limits_taken(taken: Result<tollgate::TransactionTaken, Answer>, len: usize) -> Taken {
    let taken = match taken {
        Ok(taken) => taken,
        Err(answer) => return Taken::B(reply(answer)),
    };
    let mut out = vec![0.0; len];
    numbers(&taken, &mut out);
    Taken::C(out)
}

/// A transaction's numbers (see [`limits_function`]) into `out` (of `2 + 3 * limits`), the
/// time they were written last.
fn numbers(taken: &tollgate::TransactionTaken, out: &mut [f64]) {
    let t = &taken.decision;
    out[0] = Engine::decision_number(tollgate::Decision { ok: t.ok, retry_after: t.retry_after });
    for (i, (decision, status)) in t.results.iter().zip(&taken.statuses).enumerate() {
        out[1 + 3 * i] = Engine::decision_number(*decision);
        out[2 + 3 * i] = status.remaining;
        out[3 + 3 * i] = status.reset_after;
    }
    if let Some(at) = out.last_mut() {
        *at = tollgate::SystemClock.now();
    }
}

/// JavaScript's null.
fn null(env: sys::napi_env) -> Result<sys::napi_value, String> {
    let mut null = ptr::null_mut();
    // SAFETY: a value of this call's env.
    unsafe { sys::napi_get_null(env, &mut null) };
    Ok(null)
}

/// A take's outcome as what crosses: a decision's number, or an error's answer.
fn number(taken: Result<tollgate::Decision, Answer>) -> Taken {
    match taken {
        Ok(decision) => Taken::A(Engine::decision_number(decision)),
        Err(answer) => Taken::B(reply(answer)),
    }
}

/// `taken` as a JavaScript value.
fn answer(env: sys::napi_env, taken: Taken) -> Result<sys::napi_value, String> {
    let mut value = ptr::null_mut();
    // SAFETY: values of this call's env; the string is read for its length, no further.
    let status = unsafe {
        match &taken {
            Taken::A(number) => sys::napi_create_double(env, *number, &mut value),
            Taken::B(text) => sys::napi_create_string_utf8(
                env,
                text.as_ptr().cast(),
                text.len() as isize,
                &mut value,
            ),
            Taken::C(_) => return Err("tollgate: numbers are not answered now".to_owned()),
        }
    };
    if status != sys::Status::napi_ok {
        return Err("tollgate: the answer could not be made".to_owned());
    }
    Ok(value)
}

/// Throws a `TypeError` of `message`; what the function returns then.
fn throw(env: sys::napi_env, message: &str) -> sys::napi_value {
    let message = CString::new(message.replace('\0', " ")).unwrap_or_default();
    // SAFETY: `message` is a NUL-terminated string alive across the call.
    unsafe { sys::napi_throw_type_error(env, ptr::null(), message.as_ptr()) };
    ptr::null_mut()
}

fn read_u32(env: sys::napi_env, value: sys::napi_value, what: &str) -> Result<u32, String> {
    let mut out = 0;
    // SAFETY: `value` is an argument of this call.
    match unsafe { sys::napi_get_value_uint32(env, value, &mut out) } {
        sys::Status::napi_ok => Ok(out),
        _ => Err(format!("tollgate: {what} must be a number")),
    }
}

fn read_f64(env: sys::napi_env, value: sys::napi_value, what: &str) -> Result<f64, String> {
    let mut out = 0.0;
    // SAFETY: `value` is an argument of this call.
    match unsafe { sys::napi_get_value_double(env, value, &mut out) } {
        sys::Status::napi_ok => Ok(out),
        _ => Err(format!("tollgate: {what} must be a number")),
    }
}

/// The `Float64Array` `value`'s numbers, at least `len` of them, to write into; for as long
/// as the caller holds the array.
fn read_f64s<'v>(
    env: sys::napi_env,
    value: sys::napi_value,
    len: usize,
) -> Result<&'v mut [f64], String> {
    let (mut kind, mut length, mut data) = (0, 0, ptr::null_mut());
    // SAFETY: `value` is an argument of this call; the array buffer and offset are not asked.
    let status = unsafe {
        sys::napi_get_typedarray_info(
            env,
            value,
            &mut kind,
            &mut length,
            &mut data,
            ptr::null_mut(),
            ptr::null_mut(),
        )
    };
    if status != sys::Status::napi_ok || kind != sys::TypedarrayType::float64_array || length < len
    {
        return Err(format!("tollgate: out must be a Float64Array of {len} numbers at least"));
    }
    // SAFETY: `data` points to the array's `length` numbers (past its offset), alive during
    // this call, which is the only code running on this thread's JavaScript.
    Ok(unsafe { std::slice::from_raw_parts_mut(data.cast::<f64>(), length) })
}

/// The bytes of a string argument [`read_str`] reads into the stack; a longer one is read
/// into the heap.
const SHORT: usize = 128;

/// The string `value`, read into `buf` with one Node-API call where it fits (asking for the
/// length first and then the bytes would be two).
fn read_str<'b>(
    env: sys::napi_env,
    value: sys::napi_value,
    buf: &'b mut [u8; SHORT],
) -> Result<Cow<'b, str>, String> {
    let mut written = 0;
    // SAFETY: `buf` is writable for `SHORT` bytes, and Node writes at most `SHORT - 1` of a
    // string's UTF-8 and a NUL into it; `value` is an argument of this call.
    let status = unsafe {
        sys::napi_get_value_string_utf8(env, value, buf.as_mut_ptr().cast(), SHORT, &mut written)
    };
    if status != sys::Status::napi_ok {
        return Err("tollgate: key must be a string".to_owned());
    }
    // Node writes whole characters only (of at most 4 bytes), so a string that did not fit
    // left fewer than 4 bytes free: below that it is all there.
    if written + 4 < SHORT {
        return whole(env, value, &buf[..written]).map(Cow::Borrowed);
    }
    let mut len = 0;
    // SAFETY: with no buffer, Node writes the length in bytes only.
    unsafe { sys::napi_get_value_string_utf8(env, value, ptr::null_mut(), 0, &mut len) };
    let mut long = vec![0u8; len + 1];
    // SAFETY: `long` is writable for `len + 1` bytes: the string's and a NUL.
    unsafe {
        sys::napi_get_value_string_utf8(env, value, long.as_mut_ptr().cast(), len + 1, &mut written)
    };
    long.truncate(written);
    whole(env, value, &long)?;
    String::from_utf8(long).map(Cow::Owned).map_err(|e| format!("tollgate: {e}"))
}

/// The UTF-8 `bytes` Node wrote of the string `value`, refused if the string has a lone
/// surrogate: Node writes one as U+FFFD, so that keys differing only there would be one key.
/// The JSON path refuses such a key (tollgate-client's checkKey); refused here, the call goes
/// that path, which says why. Only a string with a U+FFFD in it is read again (as UTF-16)
/// to tell a lone surrogate from a U+FFFD of its own.
fn whole(env: sys::napi_env, value: sys::napi_value, bytes: &[u8]) -> Result<&str, String> {
    let text = std::str::from_utf8(bytes).map_err(|e| format!("tollgate: {e}"))?;
    if !text.contains('\u{FFFD}') {
        return Ok(text);
    }
    let mut len = 0;
    // SAFETY: with no buffer, Node writes the length in UTF-16 code units only.
    unsafe { sys::napi_get_value_string_utf16(env, value, ptr::null_mut(), 0, &mut len) };
    let mut units = vec![0u16; len + 1];
    let mut written = 0;
    // SAFETY: `units` is writable for `len + 1` code units: the string's and a NUL.
    unsafe {
        sys::napi_get_value_string_utf16(env, value, units.as_mut_ptr(), len + 1, &mut written)
    };
    if char::decode_utf16(units[..written].iter().copied()).any(|c| c.is_err()) {
        return Err("tollgate: key has a lone surrogate".to_owned());
    }
    Ok(text)
}

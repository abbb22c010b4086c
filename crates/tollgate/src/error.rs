//! The one error type of the library.

use tollgate_algebra::{InvalidRequest, fmt_number};

/// Why a call did not produce a decision.
///
/// A refusal is not an error: [`crate::Decision`] carries `ok: false`. The exception is a
/// request made with [`crate::Request::throws`], whose refusal is [`Error::RateLimited`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The request can never succeed as written (bad count, name or key); nothing was consumed.
    #[error("{0}")]
    Invalid(#[from] InvalidRequest),
    /// The name is neither defined on the limiter nor given an inline config.
    #[error(
        "Rate limit {name} not defined. Define it with RateLimiter::builder().define(..), \
         declare it in a type that implements Limits, or pass an inline config."
    )]
    NotDefined {
        /// The name that was asked for.
        name: String,
    },
    /// Refused, for a request made with `throws`: retry after `retry_after` ms.
    /// The message rounds the wait up to whole milliseconds; the field keeps it exact.
    #[error("Rate limit {name} exceeded; retry after {} ms.", fmt_number(retry_after.ceil()))]
    RateLimited {
        /// The limit that refused (in a transaction, the one with the longest wait).
        name: String,
        /// Milliseconds until a retry can succeed.
        retry_after: f64,
    },
    /// The store failed; nothing was admitted (fail closed).
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// A store could not load or save states.
///
/// Nothing was admitted. Usually nothing was taken either; the exception is a request that
/// reached the store and whose answer never came back (a reply that timed out, a connection
/// lost mid-request): it may have run there, and [`StoreError::may_have_taken`] says so, as
/// does the message. A client that retries such a request may pay twice.
#[derive(Debug, thiserror::Error)]
#[error("rate limit store: {message}")]
pub struct StoreError {
    message: String,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
    may_have_taken: bool,
    unavailable: bool,
}

impl StoreError {
    /// A store error with a message a user can act on; nothing was taken.
    pub fn new(message: impl Into<String>) -> Self {
        StoreError {
            message: message.into(),
            source: None,
            may_have_taken: false,
            unavailable: false,
        }
    }

    /// A store error caused by `source`; nothing was taken.
    pub fn with_source(
        message: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        StoreError {
            message: message.into(),
            source: Some(source.into()),
            may_have_taken: false,
            unavailable: false,
        }
    }

    /// The same error for a request that reached the store and may have run there (its
    /// answer never came back): the message says that tokens may have been taken.
    #[must_use]
    pub fn sent(mut self) -> Self {
        if !self.may_have_taken {
            self.may_have_taken = true;
            self.message.push_str(" (the request was sent, so it may have taken its tokens)");
        }
        self
    }

    /// Whether the request may have been applied by the store although no answer came back.
    /// `false`: the store never saw it, or refused it whole, and nothing was taken.
    pub fn may_have_taken(&self) -> bool {
        self.may_have_taken
    }

    /// The same error, marked as the store being unavailable: it could not be reached, did
    /// not answer in time, or lost the connection (as opposed to refusing this request, say
    /// because a memory store is full). A `CircuitBreaker` (`tollgate::store`, with
    /// the `redis`, `postgres` or `sqlite` feature) counts only these.
    #[must_use]
    pub fn unavailable(mut self) -> Self {
        self.unavailable = true;
        self
    }

    /// The same message and marks, without the source: for each of the requests that one
    /// failed round trip carried (a [`StoreError`] is not `Clone`).
    #[cfg_attr(not(any(feature = "redis", feature = "postgres")), allow(dead_code))]
    pub(crate) fn copy(&self) -> StoreError {
        StoreError {
            message: self.message.clone(),
            source: None,
            may_have_taken: self.may_have_taken,
            unavailable: self.unavailable,
        }
    }

    /// Whether the store was unavailable (see [`StoreError::unavailable`]).
    pub fn is_unavailable(&self) -> bool {
        self.unavailable
    }

    /// The message, without the source.
    pub fn message(&self) -> &str {
        &self.message
    }
}

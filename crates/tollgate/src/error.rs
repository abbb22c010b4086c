//! The one error type of the library.

use tollgate_core::{InvalidRequest, fmt_number};

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
#[derive(Debug, thiserror::Error)]
#[error("rate limit store: {message}")]
pub struct StoreError {
    message: String,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl StoreError {
    /// A store error with a message a user can act on.
    pub fn new(message: impl Into<String>) -> Self {
        StoreError { message: message.into(), source: None }
    }

    /// A store error caused by `source`.
    pub fn with_source(
        message: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        StoreError { message: message.into(), source: Some(source.into()) }
    }

    /// The message, without the source.
    pub fn message(&self) -> &str {
        &self.message
    }
}

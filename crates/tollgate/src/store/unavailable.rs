//! A store that always fails, for testing what an app does when the limiter cannot decide.

use tollgate_algebra::{OneTake, Outcome, Plan, Slot, State, Taken};

use super::seam::{Store, immediate_async_store};
use crate::error::StoreError;

/// A store that always fails, like one whose server is down: for testing how an app (or a
/// middleware) behaves when the limiter cannot decide. Every call is a [`StoreError`] with
/// the given message.
///
/// # Examples
///
/// ```
/// use tollgate::store::Unavailable;
/// use tollgate::{Config, Error, RateLimiter, MINUTE};
///
/// let limiter = RateLimiter::new(Unavailable::new("connection refused"));
/// let err = limiter.limit(("send", Config::token_bucket(1.0, MINUTE)), "alice").unwrap_err();
/// assert!(matches!(err, Error::Store(_)));
/// ```
#[derive(Debug, Clone)]
pub struct Unavailable(String);

impl Unavailable {
    /// A store whose every call fails with `message`.
    pub fn new(message: impl Into<String>) -> Self {
        Unavailable(message.into())
    }
}

impl Store for Unavailable {
    fn execute(&self, _: &Plan<'_>) -> Result<Outcome, StoreError> {
        Err(StoreError::new(self.0.clone()))
    }
    fn execute_one(&self, _: &OneTake<'_>) -> Result<Taken, StoreError> {
        Err(StoreError::new(self.0.clone()))
    }
    fn read(&self, _: &[Slot<'_>]) -> Result<(f64, Vec<Option<State>>), StoreError> {
        Err(StoreError::new(self.0.clone()))
    }
    fn delete(&self, _: &str, _: Option<&str>, _: u16) -> Result<(), StoreError> {
        Err(StoreError::new(self.0.clone()))
    }
    fn slots(
        &self,
        _: &str,
        _: Option<&str>,
        _: &tollgate_algebra::slots::Concurrency,
        _: &tollgate_algebra::slots::SlotOp,
    ) -> Result<tollgate_algebra::slots::SlotAnswer, StoreError> {
        Err(StoreError::new(self.0.clone()))
    }
    fn slots_with(
        &self,
        _: &str,
        _: Option<&str>,
        _: &tollgate_algebra::slots::Concurrency,
        _: &tollgate_algebra::slots::SlotOp,
        _: &Plan<'_>,
    ) -> Result<(tollgate_algebra::slots::SlotAnswer, Outcome), StoreError> {
        Err(StoreError::new(self.0.clone()))
    }
}

immediate_async_store! {
    impl for Unavailable;
}

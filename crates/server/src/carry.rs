//! What a reload does to the states of the limits whose config it changes
//! ([`tollgate::core::Carry`]): each stored key is carried over to the new config
//! ([`tollgate::RateLimiter::carry_async`]), so that a reload keeps every state and never
//! lets a client past the new limit.
//!
//! - A change of kind or shards ([`Carry::Convert`]) is carried before the new config
//!   serves, so that no request reads a stored state under a layout it was not made for;
//!   once the requests that started under the old config have finished, the keys they made
//!   meanwhile are carried too.
//! - Another rate, period or capacity ([`Carry::Refill`]) on a store that drops full states
//!   (memory, SQLite, Redis) is carried once the new config serves and those requests have
//!   finished: each state is rewritten under the new config, which moves the moment the
//!   store drops it to when it is full under that config.
//!
//! Carrying only takes tokens, so requests go on meanwhile.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use tollgate::core::Carry;
use tollgate::{Config, RateLimiter, StoreError};

use crate::store::{DynStore, Stored};

/// A limit whose config a reload changes, and what that asks.
#[derive(Clone, Debug)]
pub struct Change {
    /// The limit.
    pub name: String,
    /// Its config before the reload.
    pub old: Config,
    /// Its config after.
    pub new: Config,
    /// What the change asks of its states.
    pub carry: Carry,
}

/// The changes between the limits defined by `old` and `new` that ask something of the
/// states stored on `stored` (a name that comes or goes keeps its states as they are).
pub fn changes(
    old: &RateLimiter<DynStore>,
    new: &[(String, Config)],
    stored: &Stored,
) -> Vec<Change> {
    new.iter()
        .filter_map(|(name, config)| {
            let before = old.defined_config(name)?;
            let carry = Carry::of(&before, config);
            let needed = match carry {
                Carry::Nothing => false,
                Carry::Refill => stored.drops_full_states(),
                Carry::Convert => true,
            };
            needed.then(|| Change { name: name.clone(), old: before, new: *config, carry })
        })
        .collect()
}

/// How many keys are carried at a time (on Redis and PostgreSQL, round trips on their way
/// together; on the memory store, a step between yields of the runtime's thread).
const AT_ONCE: usize = 256;

/// What a carry did.
#[derive(Debug, Default)]
pub struct Carried {
    /// The keys it carried, for a change of kind or shards (to be skipped by a later pass).
    pub keys: HashSet<Option<String>>,
    /// How many keys it carried.
    pub carried: usize,
    /// The states it rewrote.
    pub states: usize,
    /// The keys it could not carry, and the first error.
    pub failed: (usize, Option<StoreError>),
}

/// Carries every stored key of `change` over to its new config, except those in `skip`,
/// through `limiter` (any limiter on the store: only its store and seed are used).
///
/// # Errors
///
/// The store cannot list the keys (each key that fails is counted in [`Carried::failed`]).
pub async fn carry(
    limiter: &RateLimiter<DynStore>,
    stored: &Stored,
    change: &Change,
    skip: Option<&HashSet<Option<String>>>,
) -> Result<Carried, StoreError> {
    let listed = stored.keys_of(&change.name).await?;
    let mut keys: Vec<Option<String>> = listed.into_iter().map(|(key, _)| key).collect();
    keys.sort_unstable();
    keys.dedup();
    keys.retain(|key| skip.is_none_or(|skip| !skip.contains(key)));
    let started = Instant::now();
    let mut logged = started;
    let mut carried = Carried::default();
    for (i, chunk) in keys.chunks(AT_ONCE).enumerate() {
        let each = chunk
            .iter()
            .map(|key| limiter.carry_async(&change.name, key.as_deref(), &change.old, &change.new));
        for (key, result) in chunk.iter().zip(futures_util::future::join_all(each).await) {
            match result {
                Ok(states) => {
                    carried.carried += 1;
                    carried.states += states;
                    // Only a conversion's first pass is followed by one that skips them.
                    if change.carry == Carry::Convert {
                        carried.keys.insert(key.clone());
                    }
                }
                Err(e) => {
                    carried.failed.0 += 1;
                    if carried.failed.1.is_none() {
                        carried.failed.1 = Some(StoreError::new(e.to_string()));
                    }
                }
            }
        }
        if logged.elapsed() > Duration::from_secs(5) {
            logged = Instant::now();
            tracing::info!(
                "{}: carried {} of {} keys to the new config",
                crate::names::limits_table(&change.name),
                ((i + 1) * AT_ONCE).min(keys.len()),
                keys.len()
            );
        }
        tokio::task::yield_now().await;
    }
    Ok(carried)
}

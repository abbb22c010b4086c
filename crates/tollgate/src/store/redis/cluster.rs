//! The Redis store on a Redis Cluster: where a key's state lives (its hash slot), and a
//! sharded take whose two shards live apart, run as atomic one-shard steps, the first given
//! back when the second refuses.

use tollgate_algebra::{Clock, Outcome, Plan, Split};

use super::keys::hash_tag;
use super::wire::{kind_code, num, pack_state};
use super::{Inner, Ran, Writes};
use crate::error::StoreError;

impl<C: Clock> Inner<C> {
    /// A request whose states are in several hash slots of a cluster: a sharded take runs in
    /// steps (see [`RedisStore`]); anything else is refused with an error.
    pub(super) async fn execute_split(
        &self,
        plan: &Plan<'_>,
        keys: &[String],
    ) -> Result<Outcome, StoreError> {
        let n = plan.slots().len();
        // Only one take over two shards splits: refuse anything else before any round trip.
        if n != 2 || plan.takes().nth(1).is_some() {
            return Err(cross_slot(plan, keys));
        }
        let (now, states) = self.read_keys(keys).await?;
        let Some(split) = plan.split(now, &states) else {
            return Err(cross_slot(plan, keys));
        };
        match &split {
            Split::Done(outcome) => Ok(outcome.clone()),
            Split::One { slot, plan } => {
                let ran = self.run(plan, std::slice::from_ref(&keys[*slot])).await?;
                Ok(split.outcome(n, &[ran.outcome]))
            }
            Split::Both { slots: [a, b], plans: [pa, pb] } => {
                let first = self.run(pa, std::slice::from_ref(&keys[*a])).await?;
                if !first.outcome.ok {
                    return Ok(split.outcome(n, &[first.outcome]));
                }
                let second = self.run(pb, std::slice::from_ref(&keys[*b])).await;
                if let Ok(second) = &second
                    && second.outcome.ok
                {
                    return Ok(split.outcome(n, &[first.outcome, second.outcome.clone()]));
                }
                self.give_back(pa, &keys[*a], &first).await?;
                Ok(split.outcome(n, &[first.outcome, second?.outcome]))
            }
        }
    }

    /// Gives back what `ran` took from the one slot of `plan` (see [`GIVE_BACK`]).
    async fn give_back(&self, plan: &Plan<'_>, key: &str, ran: &Ran) -> Result<(), StoreError> {
        let slot = &plan.slots()[0];
        let amount = plan.takes().next().map_or(0.0, |t| t.count);
        let written = ran.states[0].map(pack_state).unwrap_or_default();
        let c = &slot.config;
        let mut invocation = self.give_back.prepare_invoke();
        invocation
            .key(key)
            .arg(self.now_arg())
            .arg(written)
            .arg(ran.loaded[0].as_slice())
            .arg(kind_code(c.kind()))
            .arg(num(c.rate()))
            .arg(num(c.period()))
            .arg(num(c.capacity()))
            .arg(num(amount));
        self.on_connection(Writes::Yes, |mut conn| async move {
            invocation.invoke_async::<i64>(&mut conn).await
        })
        .await
        .map(drop)
    }
}

/// Redis Cluster's hash slot of a key: CRC16 (XMODEM) of the key, or of the part between its
/// first `{` and the next `}` if that part is not empty, modulo 16384.
pub(super) fn hash_slot(key: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in hash_tag(key).unwrap_or(key) {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x1021 } else { crc << 1 };
        }
    }
    crc % 16384
}

/// The error for a transaction whose states are in several hash slots.
fn cross_slot(plan: &Plan<'_>, keys: &[String]) -> StoreError {
    let mut slots: Vec<u16> = keys.iter().map(|k| hash_slot(k.as_bytes())).collect();
    slots.sort_unstable();
    slots.dedup();
    let names: Vec<&str> = plan.slots().iter().map(|s| s.name).collect();
    StoreError::new(format!(
        "redis cluster: this request's states ({}) are in {} hash slots, and a request is \
         atomic on a cluster only within one; give its limits' keys a common hash tag (such \
         as {{user42}}) or the store a prefix with one (such as {{tollgate}}:)",
        names.join(", "),
        slots.len()
    ))
}

/// The give-back of a take across two cluster nodes, on the cluster of
/// `TOLLGATE_REDIS_CLUSTER_URL` (skipped without it, unless `TOLLGATE_REQUIRE_BACKENDS=1`).
#[cfg(test)]
mod tests {
    use tollgate_algebra::{Config, MINUTE, ManualClock, Take};

    use super::*;
    use crate::store::redis::RedisStore;
    use crate::store::seam::AsyncStore;

    fn cluster_url() -> Option<String> {
        crate::store::testing::backend_url("TOLLGATE_REDIS_CLUSTER_URL")
    }

    #[tokio::test]
    async fn restores_exactly_or_adds_back() {
        let Some(url) = cluster_url() else { return };
        const T0: f64 = 1_700_000_000_000.0;
        let clock = ManualClock::new(T0);
        let prefix = format!("tollgate-give-back:{}:", std::process::id());
        let store = RedisStore::builder().prefix(prefix).open_with_clock(&url, clock).unwrap();
        let config = Config::token_bucket(10.0, MINUTE);
        let plan = |count: f64| {
            let mut plan = Plan::new(true);
            let take = Take { name: "t", key: Some("k"), config, count, reserve: false };
            plan.push(&take, 0, 0).unwrap();
            plan
        };
        let key = store.inner.key("t", Some("k"), 0);
        let keys = std::slice::from_ref(&key);
        let value = async || store.inner.read_keys(keys).await.unwrap().1[0].map(|s| s.value);

        // Nothing touched the state since the take: the state before it comes back.
        let four = plan(4.0);
        let ran = store.inner.run(&four, keys).await.unwrap();
        assert_eq!(value().await, Some(6.0));
        store.inner.give_back(&four, &key, &ran).await.unwrap();
        assert_eq!(value().await, None, "there was no state before the take");
        store.inner.run(&plan(1.0), keys).await.unwrap();
        let ran = store.inner.run(&four, keys).await.unwrap();
        store.inner.give_back(&four, &key, &ran).await.unwrap();
        assert_eq!(value().await, Some(9.0), "the state before the take, exactly");

        // Another take came between: the amount is added back, up to capacity.
        let ran = store.inner.run(&four, keys).await.unwrap();
        store.inner.run(&plan(2.0), keys).await.unwrap();
        assert_eq!(value().await, Some(3.0));
        store.inner.give_back(&four, &key, &ran).await.unwrap();
        assert_eq!(value().await, Some(7.0));
        store.delete_async("t", Some("k"), 1).await.unwrap();
    }
}

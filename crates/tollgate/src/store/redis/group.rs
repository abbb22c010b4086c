//! One-takes that wait for a round trip go together: the store's sender task takes those
//! waiting (up to a group's most) as one run of the grouped script, with a few trips on their
//! way at once, and answers each.

use std::sync::Arc;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use redis::Value;
use tokio::sync::mpsc;
use tollgate_algebra::Clock;

use super::wire::garbage;
use super::{Inner, RedisStore};
use crate::error::StoreError;
use crate::store::ticket::{Ticket, ticket};

/// A one-take waiting to be sent with others: its key, its [`one_args`](super::wire::one_args), its caller.
pub(super) struct Grouped {
    pub(super) key: String,
    pub(super) args: Vec<u8>,
    pub(super) ticket: Ticket<Value>,
}

impl<C: Clock> RedisStore<C> {
    /// Sends a one-take: grouped with others by the store's sender task, or alone at once
    /// (no grouping, or a cluster).
    pub(super) async fn send_one(&self, key: String, args: Vec<u8>) -> Result<Value, StoreError> {
        #[cfg(feature = "redis-cluster")]
        let alone = self.group == 1 || self.inner.is_cluster();
        #[cfg(not(feature = "redis-cluster"))]
        let alone = self.group == 1;
        if alone {
            let mut replies = self.inner.send_ones(&[(&key, &args)]).await;
            return replies.pop().unwrap_or_else(|| Err(garbage("no answer")));
        }
        let (ticket, claim) = ticket();
        let sent = {
            let mut grouper = self.grouper.lock();
            let queue = match &*grouper {
                Some(queue) if !queue.is_closed() => queue,
                _ => {
                    let (queue, jobs) = mpsc::unbounded_channel();
                    let (inner, most, trips) = (Arc::clone(&self.inner), self.group, self.trips);
                    tokio::spawn(send_groups(inner, jobs, most, trips));
                    grouper.insert(queue)
                }
            };
            queue.send(Grouped { key, args, ticket })
        };
        if sent.is_err() {
            return Err(StoreError::new("redis: the store's sender task has stopped").unavailable());
        }
        // A request that waits longer than the timeout for its round trip is withdrawn, never
        // sent; one on its way is bounded by the reply timeout.
        claim.answer(Some(self.timeout), "redis").await
    }
}

/// The store's sender task: takes the one-takes that wait (up to `most`) as one round trip,
/// with at most `trips` on their way at once; answers each. Ends when the store is dropped,
/// after the trips on their way.
pub(super) async fn send_groups<C: Clock>(
    inner: Arc<Inner<C>>,
    mut jobs: mpsc::UnboundedReceiver<Grouped>,
    most: usize,
    trips: usize,
) {
    let mut on_their_way = FuturesUnordered::new();
    loop {
        let next = if on_their_way.len() < trips {
            futures_util::future::Either::Left(jobs.recv())
        } else {
            futures_util::future::Either::Right(std::future::pending())
        };
        tokio::select! {
            biased;
            Some(()) = on_their_way.next(), if !on_their_way.is_empty() => {}
            job = next => {
                let Some(first) = job else { break };
                let batch: Vec<Grouped> = std::iter::once(first)
                    .chain(std::iter::from_fn(|| jobs.try_recv().ok()))
                    .take(most)
                    .filter(|job| job.ticket.take())
                    .collect();
                if !batch.is_empty() {
                    on_their_way.push(trip(&inner, batch));
                }
            }
        }
    }
    while on_their_way.next().await.is_some() {}
}

/// One grouped round trip: sends `batch`, answers each of it.
async fn trip<C: Clock>(inner: &Inner<C>, batch: Vec<Grouped>) {
    let requests: Vec<(&str, &[u8])> =
        batch.iter().map(|g| (g.key.as_str(), g.args.as_slice())).collect();
    let replies = inner.send_ones(&requests).await;
    for (grouped, reply) in batch.into_iter().zip(replies) {
        grouped.ticket.answer(reply);
    }
}

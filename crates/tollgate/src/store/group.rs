//! Group commit for a networked store: requests that would wait for a connection are sent
//! together, in one round trip, by the next request whose turn it is to send.
//!
//! A request that finds fewer than `most_sending` requests on their way to the server is
//! sent at once (with any that wait). One that finds them all busy waits in line; when a
//! round trip ends, its sender hands the turn to the first in line, which sends itself and
//! up to `most_per_trip - 1` others. So a single caller pays nothing (a lock), and many
//! concurrent callers share round trips instead of queueing for connections. What a group
//! means on the server is the sender's business (for Redis: one script that runs each
//! request in turn, atomically).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::StoreError;

/// What a store's one-take function or script answers for a take: the time it used,
/// whether it wrote, and the state it loaded (from which `tollgate-core` decides).
pub(crate) type OneAnswer = (f64, bool, Option<tollgate_core::State>);

/// Requests of type `Q`, each answered with an `A`.
pub(crate) struct Group<Q, A> {
    line: Mutex<Line<Q, A>>,
    most_sending: usize,
    most_per_trip: usize,
}

struct Line<Q, A> {
    /// Requests waiting to be sent, first come first.
    waiting: VecDeque<Arc<Ticket<Q, A>>>,
    /// Requests whose thread is sending (or has been handed the turn to).
    sending: usize,
}

/// A waiting request and where its answer goes.
struct Ticket<Q, A> {
    request: Q,
    turn: Mutex<Turn<A>>,
    changed: Condvar,
}

enum Turn<A> {
    Waiting,
    /// This request's thread sends next: itself and those behind it.
    Send,
    Done(Result<A, StoreError>),
}

impl<Q, A> Ticket<Q, A> {
    fn set(&self, turn: Turn<A>) {
        *self.turn.lock() = turn;
        self.changed.notify_one();
    }
}

impl<Q, A> Group<Q, A> {
    /// At most `most_sending` round trips at a time (at least one), each carrying at most
    /// `most_per_trip` requests (at least one).
    pub(crate) fn new(most_sending: usize, most_per_trip: usize) -> Self {
        Group {
            line: Mutex::new(Line { waiting: VecDeque::new(), sending: 0 }),
            most_sending: most_sending.max(1),
            most_per_trip: most_per_trip.max(1),
        }
    }

    /// Answers `request`: sends it now, with any others that wait, through `send`, or waits
    /// for a sender to carry it. `send` gets the requests of one round trip and answers each
    /// in order. A request still waiting in line after `wait` leaves it (it was never sent)
    /// and fails; one already sent whose answer has not come by then fails too.
    pub(crate) fn run<F>(&self, request: Q, wait: Duration, send: F) -> Result<A, StoreError>
    where
        F: Fn(&[&Q]) -> Vec<Result<A, StoreError>>,
    {
        let mut line = self.line.lock();
        if line.sending < self.most_sending {
            line.sending += 1;
            drop(line);
            return self.send(&request, &send);
        }
        let ticket =
            Arc::new(Ticket { request, turn: Mutex::new(Turn::Waiting), changed: Condvar::new() });
        line.waiting.push_back(Arc::clone(&ticket));
        drop(line);
        let deadline = Instant::now() + wait;

        let mut turn = ticket.turn.lock();
        loop {
            match std::mem::replace(&mut *turn, Turn::Waiting) {
                Turn::Done(answer) => return answer,
                Turn::Send => {
                    drop(turn);
                    return self.send(&ticket.request, &send);
                }
                Turn::Waiting => {}
            }
            if ticket.changed.wait_until(&mut turn, deadline).timed_out() {
                break;
            }
        }
        // Timed out: leave the line if still in it. Locks in the senders' order: line, turn.
        drop(turn);
        let mut line = self.line.lock();
        let mut turn = ticket.turn.lock();
        match std::mem::replace(&mut *turn, Turn::Waiting) {
            Turn::Done(answer) => answer,
            Turn::Send => {
                // Handed the turn just now: those behind count on it.
                drop(turn);
                drop(line);
                self.send(&ticket.request, &send)
            }
            Turn::Waiting => {
                let sent = match line.waiting.iter().position(|t| Arc::ptr_eq(t, &ticket)) {
                    Some(i) => {
                        line.waiting.remove(i);
                        false
                    }
                    None => true,
                };
                Err(StoreError::new(if sent {
                    "timed out waiting for the answer of a grouped round trip"
                } else {
                    "timed out waiting for a connection (nothing was sent)"
                }))
            }
        }
    }

    /// Sends `own` and up to `most_per_trip - 1` waiting requests in one round trip, answers
    /// the others, and hands the turn on (also if `send` panics).
    fn send<F>(&self, own: &Q, send: &F) -> Result<A, StoreError>
    where
        F: Fn(&[&Q]) -> Vec<Result<A, StoreError>>,
    {
        let _hand_on = HandOn(self);
        let others: Vec<Arc<Ticket<Q, A>>> = {
            let mut line = self.line.lock();
            let n = line.waiting.len().min(self.most_per_trip - 1);
            line.waiting.drain(..n).collect()
        };
        let mut requests = Vec::with_capacity(1 + others.len());
        requests.push(own);
        requests.extend(others.iter().map(|t| &t.request));
        let mut answers = send(&requests).into_iter();
        let mut next = || answers.next().unwrap_or_else(|| Err(StoreError::new("no answer")));
        let own = next();
        for ticket in &others {
            ticket.set(Turn::Done(next()));
        }
        own
    }
}

/// The answers of a round trip of `n` requests that failed as a whole: `error` for the
/// first, the same message for the others (a [`StoreError`] is not `Clone`).
pub(crate) fn fail_all<A>(n: usize, error: StoreError) -> Vec<Result<A, StoreError>> {
    let message = error.message().to_owned();
    let mut all = Vec::with_capacity(n.max(1));
    all.push(Err(error));
    all.extend((1..n).map(|_| Err(StoreError::new(message.clone()))));
    all
}

/// Ends a sender's turn: the first waiting request sends next, or there is one sender less.
struct HandOn<'a, Q, A>(&'a Group<Q, A>);

impl<Q, A> Drop for HandOn<'_, Q, A> {
    fn drop(&mut self) {
        let mut line = self.0.line.lock();
        match line.waiting.pop_front() {
            Some(next) => next.set(Turn::Send),
            None => line.sending -= 1,
        }
    }
}

/// A check that a store's grouped round trip answers as one request after the other.
#[cfg(test)]
pub(crate) mod testing {
    use tollgate_core::{Clock, Config, MINUTE, ManualClock, OneTake, SECOND, Take};

    use crate::MemoryStore;
    use crate::store::Store;

    /// The clock's start.
    pub(crate) const T0: f64 = 1_700_000_000_000.0;

    /// `take` as a one-take that writes.
    pub(crate) fn writing<'a>(take: &Take<'a>) -> OneTake<'a> {
        OneTake::new(take, 0, true).unwrap()
    }

    pub(crate) use crate::store::backend_url;

    /// Groups of 1 to 40 one-takes over four limits and three keys (repeats in a group
    /// included), with counts, reservations, maxReserved and checks, each group run by
    /// `send` in one round trip (answering, per take, the time it used, whether it wrote and
    /// the state it loaded): every answer as the memory store's, one take after the other,
    /// and every state in `store` as the memory store's after each group. Deletes its states.
    pub(crate) fn grouped_takes_answer_as_memory(
        clock: &ManualClock,
        store: &impl Store,
        send: impl Fn(&[OneTake<'_>]) -> Vec<super::OneAnswer>,
    ) {
        let memory = MemoryStore::with_clock(clock.clone());
        let limits = [
            ("tb", Config::token_bucket(10.0, MINUTE)),
            ("burst", Config::token_bucket(2.0, SECOND).with_capacity(5.0).with_max_reserved(4.0)),
            ("fw", Config::fixed_window(10.0, MINUTE).with_start(T0 - 7.0 * SECOND)),
            ("fw_burst", Config::fixed_window(3.0, SECOND).with_capacity(6.0)),
        ];
        let keys = [Some("a"), Some(""), None];
        // A small LCG: the same cases every run.
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = |n: u64| {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (seed >> 33) % n
        };
        let slot = |name, key, config| {
            let take = Take { name, key, config, count: 1.0, reserve: false };
            OneTake::new(&take, 0, false).unwrap().slot
        };
        let (mut admitted, mut refused) = (0, 0);
        for _ in 0..60 {
            clock.advance([0.0, 150.0, 1_000.0, 7_000.0][next(4) as usize]);
            let group: Vec<(Take<'_>, bool)> = (0..1 + next(40))
                .map(|_| {
                    let (name, config) = limits[next(4) as usize];
                    let take = Take {
                        name,
                        key: keys[next(3) as usize],
                        config,
                        count: [1.0, 2.0, 3.0, 0.5][next(4) as usize],
                        reserve: next(3) == 0,
                    };
                    (take, next(5) != 0)
                })
                .collect();
            let ones: Vec<OneTake<'_>> =
                group.iter().map(|(t, writes)| OneTake::new(t, 0, *writes).unwrap()).collect();
            let answers = send(&ones);
            assert_eq!(answers.len(), ones.len());
            for (one, (now, wrote, loaded)) in ones.iter().zip(answers) {
                assert_eq!(now, clock.now());
                let (taken, new) = one.decide(now, loaded);
                assert_eq!(wrote, new.is_some());
                let expected = memory.execute_one(one).unwrap();
                assert_eq!(taken.decision, expected.decision, "{:?}", one.slot.name);
                assert_eq!(taken.status, expected.status, "{:?}", one.slot.name);
                if taken.decision.ok {
                    admitted += 1;
                } else {
                    refused += 1;
                }
            }
            for (name, config) in limits {
                for key in keys {
                    let slot = [slot(name, key, config)];
                    assert_eq!(store.read(&slot).unwrap().1, memory.read(&slot).unwrap().1);
                }
            }
        }
        assert!(admitted > 100 && refused > 100, "both: {admitted} admitted, {refused} refused");
        for (name, _) in limits {
            for key in keys {
                store.delete(name, key, 1).unwrap();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    fn later(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    #[test]
    fn alone_a_request_is_sent_at_once_by_itself() {
        let group = Group::new(1, 8);
        let trips = AtomicUsize::new(0);
        for i in 0..3_u32 {
            let answer = group.run(i, later(1_000), |requests| {
                trips.fetch_add(1, Ordering::Relaxed);
                assert_eq!(requests, [&i]);
                vec![Ok(i * 10)]
            });
            assert_eq!(answer.unwrap(), i * 10);
        }
        assert_eq!(trips.load(Ordering::Relaxed), 3);
        assert_eq!(group.line.lock().sending, 0);
    }

    #[test]
    fn concurrent_requests_share_round_trips_and_each_gets_its_own_answer() {
        let group = Group::new(2, 5);
        let (trips, sent, most) = (AtomicUsize::new(0), AtomicUsize::new(0), AtomicUsize::new(0));
        std::thread::scope(|s| {
            for t in 0..16_u64 {
                let (group, trips, sent, most) = (&group, &trips, &sent, &most);
                s.spawn(move || {
                    for i in 0..100 {
                        let request = t * 1_000 + i;
                        let answer = group.run(request, later(10_000), |requests| {
                            trips.fetch_add(1, Ordering::Relaxed);
                            sent.fetch_add(requests.len(), Ordering::Relaxed);
                            most.fetch_max(requests.len(), Ordering::Relaxed);
                            std::thread::sleep(Duration::from_micros(200));
                            requests.iter().map(|r| Ok(**r * 2)).collect()
                        });
                        assert_eq!(answer.unwrap(), request * 2);
                    }
                });
            }
        });
        assert_eq!(sent.load(Ordering::Relaxed), 1_600, "each request sent exactly once");
        assert!(most.load(Ordering::Relaxed) <= 5, "at most most_per_trip a trip");
        assert!(trips.load(Ordering::Relaxed) < 1_600, "round trips were shared");
        let line = group.line.lock();
        assert_eq!((line.sending, line.waiting.len()), (0, 0));
    }

    #[test]
    fn a_request_that_times_out_in_line_is_never_sent() {
        let group = Group::new(1, 8);
        let (release, sent) = (Mutex::new(()), Mutex::new(Vec::new()));
        let hold = release.lock();
        std::thread::scope(|s| {
            let first = s.spawn(|| {
                group.run(1, later(10_000), |requests| {
                    sent.lock().extend(requests.iter().map(|r| **r));
                    drop(release.lock());
                    requests.iter().map(|r| Ok(**r)).collect()
                })
            });
            while group.line.lock().sending == 0 {
                std::thread::yield_now();
            }
            let late = group.run(2, later(20), |_| unreachable!("sent by the first"));
            assert!(late.unwrap_err().message().contains("nothing was sent"));
            drop(hold);
            assert_eq!(first.join().unwrap().unwrap(), 1);
        });
        assert_eq!(*sent.lock(), [1]);
        let line = group.line.lock();
        assert_eq!((line.sending, line.waiting.len()), (0, 0));
    }

    #[test]
    fn a_sender_that_panics_hands_the_turn_on() {
        let group = Group::new(1, 8);
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            group.run(1_u32, later(1_000), |_| -> Vec<Result<u32, StoreError>> { panic!("bug") })
        }));
        assert!(panicked.is_err());
        assert_eq!(group.line.lock().sending, 0);
        assert_eq!(group.run(2, later(1_000), |r| vec![Ok(*r[0])]).unwrap(), 2);
    }

    #[test]
    fn a_short_answer_fails_the_requests_it_leaves_out() {
        let group: Group<u32, u32> = Group::new(1, 8);
        let answer = group.run(1, later(1_000), |_| Vec::new());
        assert_eq!(answer.unwrap_err().message(), "no answer");
    }
}

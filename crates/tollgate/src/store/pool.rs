//! The few connections a networked store keeps, made on demand and again after an error.

use parking_lot::Mutex;

use crate::StoreError;

/// A fixed number of connection slots. A request takes a free slot if there is one (else it
/// waits for its thread's turn), connects it if it is empty, and empties it if the request
/// fails, so the next request connects afresh: the store recovers by itself when its server
/// comes back.
pub(crate) struct Pool<T> {
    slots: Box<[Mutex<Option<T>>]>,
}

impl<T> Pool<T> {
    /// A pool of `size` empty slots (at least one).
    pub(crate) fn new(size: usize) -> Self {
        Pool { slots: (0..size.max(1)).map(|_| Mutex::new(None)).collect() }
    }

    /// Runs `request` on a connection, made with `connect` if its slot has none. A failed
    /// request drops the connection and becomes a [`StoreError`] through `error`.
    pub(crate) fn run<R, E>(
        &self,
        connect: impl FnOnce() -> Result<T, StoreError>,
        request: impl FnOnce(&mut T) -> Result<R, E>,
        error: impl FnOnce(E) -> StoreError,
    ) -> Result<R, StoreError> {
        thread_local!(static NEXT: std::cell::Cell<usize> = const { std::cell::Cell::new(0) });
        let start = NEXT.with(|n| {
            let i = n.get();
            n.set(i.wrapping_add(1));
            i
        });
        let n = self.slots.len();
        let mut slot = (0..n)
            .find_map(|i| self.slots[(start + i) % n].try_lock())
            .unwrap_or_else(|| self.slots[start % n].lock());
        if slot.is_none() {
            *slot = Some(connect()?);
        }
        request(slot.as_mut().expect("connected above")).map_err(|e| {
            *slot = None;
            error(e)
        })
    }
}

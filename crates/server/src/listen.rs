//! Accepting connections, for both listeners (the HTTP API and the rate limit service): each
//! has its own cap on open connections (`maxConnections`), closes a connection that says
//! nothing for `headerTimeout`, sums up accept errors in the log, and stops gracefully.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};

use crate::config::HttpLimits;
use crate::error_log::ErrorLog;

/// Resolves once the server is stopping: a connection then finishes what it is doing and
/// closes.
pub struct Stopping(watch::Receiver<bool>);

impl Stopping {
    /// Waits until the server stops (at once if it has).
    pub async fn wait(&mut self) {
        let _ = self.0.wait_for(|stop| *stop).await;
    }
}

/// Accepts connections on `listener` until `stop` resolves, each served by `serve` in a task
/// of its own: at most `limits.max_connections` at a time (one more is closed as soon as it
/// is accepted, before it costs anything, told `full` first if that is not empty: the Redis
/// protocol's `-ERR max number of clients reached`). Accept errors (out of file descriptors, say) go to
/// `errors`, summed up, and the loop waits a little rather than spin. Once `stop` resolves
/// the listener is closed, every connection is told (the [`Stopping`] given to `serve`), and
/// they get `limits.shutdown_deadline` to close; any left then is cut when the runtime ends.
///
/// # Errors
///
/// None yet: the loop outlives any one failed accept.
pub async fn serve_connections<F, Fut>(
    listener: TcpListener,
    what: &'static str,
    limits: HttpLimits,
    full: &'static [u8],
    errors: Arc<ErrorLog>,
    stop: impl Future<Output = ()>,
    serve: F,
) -> anyhow::Result<()>
where
    F: Fn(TcpStream, Stopping) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let told = Arc::new(Semaphore::new(TOLD_AT_ONCE));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut stop = std::pin::pin!(stop);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut stop => break,
        };
        let tcp = match accepted {
            Ok((tcp, _)) => tcp,
            Err(e) => {
                let message = e.to_string();
                errors.note(&message, || {
                    tracing::warn!("{what}: cannot accept a connection: {message}");
                });
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            // Over the limit: closed at once (once told, if it is to be).
            if !full.is_empty() {
                tell_and_close(tcp, full, &told);
            }
            continue;
        };
        // Answers are small and each is one write: send it at once, not after an ACK.
        let _ = tcp.set_nodelay(true);
        let connection = serve(tcp, Stopping(stop_rx.clone()));
        tokio::spawn(async move {
            connection.await;
            drop(slot);
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    tracing::info!("{what}: shutting down: finishing requests in flight");
    let all = u32::try_from(limits.max_connections).unwrap_or(u32::MAX);
    let closed = tokio::time::timeout(limits.shutdown_deadline, slots.acquire_many(all)).await;
    if closed.is_err() {
        let left = limits.max_connections - slots.available_permits();
        tracing::warn!(
            "{what}: {left} connections still open after {:?}: cut",
            limits.shutdown_deadline
        );
    }
    Ok(())
}

/// Connections over the limit that may be closing at once after being told so, each for at
/// most [`TOLD_WITHIN`]: beyond these, one is closed untold (they hold file descriptors past
/// `maxConnections`, within [`SPARE_FILES`]).
const TOLD_AT_ONCE: usize = 16;
/// See [`TOLD_AT_ONCE`].
const TOLD_WITHIN: Duration = Duration::from_secs(1);

/// Writes `message` to a connection over the limit (its socket's buffer is empty: the write
/// takes it whole or not at all), then closes it gracefully: a close with the client's first
/// command unread would be a reset, which may destroy the message before the client reads
/// it, so what the client sends is read and dropped until it closes too, or [`TOLD_WITHIN`].
fn tell_and_close(tcp: TcpStream, message: &'static [u8], told: &Arc<Semaphore>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    if tcp.try_write(message).is_err() {
        return;
    }
    let Ok(telling) = Arc::clone(told).try_acquire_owned() else { return };
    tokio::spawn(async move {
        let mut tcp = tcp;
        let _ = tcp.shutdown().await;
        let mut dropped = [0u8; 512];
        let _ = tokio::time::timeout(TOLD_WITHIN, async {
            while let Ok(1..) = tcp.read(&mut dropped).await {}
        })
        .await;
        drop(telling);
    });
}

/// File descriptors the process keeps besides its connections: the store's, the log's, the
/// listeners', the runtime's.
const SPARE_FILES: u64 = 64;

/// Raises the soft limit on open files to the hard one, and fits the connection caps of the
/// `listeners` listeners (each `max_connections`) into what it allows: if they do not fit, the
/// cap is lowered, with a warning, so that the process never runs out of file descriptors
/// (which would stop every listener from accepting, the HTTP API's too). Returns the cap.
pub fn fit_open_files(max_connections: usize, listeners: u64) -> usize {
    let files = raise_open_files();
    let Some(files) = files else { return max_connections };
    let fits = usize::try_from(files.saturating_sub(SPARE_FILES) / listeners.max(1))
        .unwrap_or(usize::MAX)
        .max(1);
    if max_connections > fits {
        tracing::warn!(
            "maxConnections is {max_connections}, but this process may open {files} files \
             (ulimit -n) for {listeners} listener(s): each is capped at {fits} connections. \
             Raise the limit (ulimit -n, LimitNOFILE=) to allow more."
        );
        return fits;
    }
    max_connections
}

/// The soft limit on open files after raising it to the hard one, if it can be read.
#[cfg(unix)]
fn raise_open_files() -> Option<u64> {
    use rlimit::Resource;
    let (soft, hard) = Resource::NOFILE.get().ok()?;
    if soft < hard {
        match rlimit::increase_nofile_limit(hard) {
            Ok(raised) => return Some(raised),
            Err(e) => tracing::warn!("cannot raise the open files limit from {soft}: {e}"),
        }
    }
    Some(soft)
}

#[cfg(not(unix))]
fn raise_open_files() -> Option<u64> {
    None
}

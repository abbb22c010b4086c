//! How the Redis store reaches Redis: one Redis at its address or as the primary its
//! Sentinels name, or a Redis Cluster; a few multiplexed connections, each made on first use
//! and made again after it failed; a write acknowledged by replicas (`WAIT`) when asked.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use redis::aio::MultiplexedConnection;
#[cfg(feature = "redis-cluster")]
use redis::cluster_async::ClusterConnection;
use redis::{Client, Value};
use tollgate_algebra::Clock;

use super::wire::redis_error;
use super::{Inner, Writes};
use crate::error::StoreError;

/// The client of a cluster URL: the nodes to start from.
#[cfg(feature = "redis-cluster")]
pub(super) fn cluster(
    urls: Vec<String>,
    timeout: Duration,
    #[cfg(feature = "redis-tls")] certificates: Option<redis::TlsCertificates>,
) -> redis::RedisResult<Server> {
    let builder = redis::cluster::ClusterClient::builder(urls)
        .connection_timeout(timeout)
        .response_timeout(timeout)
        .tcp_settings(redis::io::tcp::TcpSettings::default().set_nodelay(true))
        // Few retries: a request that may have run is not run many times over (a repeat can
        // only take twice, never admit more), and a dead node fails the request in time.
        .retries(2);
    #[cfg(feature = "redis-tls")]
    let builder = match certificates {
        Some(certificates) => builder.certs(certificates),
        None => builder,
    };
    Ok(Server::Cluster { client: builder.build()?, connection: Connection::default() })
}

#[cfg(not(feature = "redis-cluster"))]
pub(super) fn cluster(
    _: Vec<String>,
    _: Duration,
    #[cfg(feature = "redis-tls")] _: Option<redis::TlsCertificates>,
) -> redis::RedisResult<Server> {
    Err(redis::RedisError::from((
        redis::ErrorKind::InvalidClientConfig,
        "Redis Cluster needs tollgate's `redis-cluster` feature",
    )))
}

/// How the one Redis is reached: at its address, or as the primary the Sentinels name.
pub(super) enum Source {
    Fixed(Client),
    /// Asked again at each new connection, so that after a failover the next connection
    /// goes to the new primary.
    Sentinel(tokio::sync::Mutex<redis::sentinel::SentinelClient>),
}

impl Source {
    /// A new connection to the Redis (the primary, for Sentinel), within `timeout` in all.
    async fn connect(
        &self,
        config: &redis::AsyncConnectionConfig,
        timeout: Duration,
    ) -> redis::RedisResult<MultiplexedConnection> {
        match self {
            // redis-rs bounds the whole of it (the TCP connect and the handshake) by the
            // config's connection timeout, `timeout`.
            Source::Fixed(client) => {
                client.get_multiplexed_async_connection_with_config(config).await
            }
            Source::Sentinel(sentinel) => {
                let found = async {
                    let primary = sentinel.lock().await.async_get_client().await?;
                    primary.get_multiplexed_async_connection_with_config(config).await
                };
                tokio::time::timeout(timeout, found).await.unwrap_or_else(|_| {
                    Err(redis::RedisError::from(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("no primary found through the Sentinels within {timeout:?}"),
                    )))
                })
            }
        }
    }
}

/// Where the states are: one Redis, or a Redis Cluster.
pub(super) enum Server {
    One {
        source: Source,
        config: redis::AsyncConnectionConfig,
        connections: Box<[Connection<MultiplexedConnection>]>,
        /// The connection the next request goes out on, round robin.
        next: AtomicUsize,
    },
    #[cfg(feature = "redis-cluster")]
    Cluster { client: redis::cluster::ClusterClient, connection: Connection<ClusterConnection> },
}

/// One multiplexed connection, made on first use and made again after it failed.
pub(super) struct Connection<T> {
    /// The connection and its generation (how many were made before it).
    current: Mutex<(Option<T>, u64)>,
    /// Held while connecting, so that many requests that find no connection make one.
    connecting: tokio::sync::Mutex<()>,
}

impl<T> Default for Connection<T> {
    fn default() -> Self {
        Connection { current: Mutex::new((None, 0)), connecting: tokio::sync::Mutex::new(()) }
    }
}

impl<T: Clone> Connection<T> {
    /// The connection (a cheap handle to it) and its generation, connecting with `connect`
    /// if there is none. A request waits for another's attempt to connect only within
    /// `timeout` (the store's, counted from here), then fails, so that each request is
    /// answered within about twice the timeout even when every attempt takes all of it:
    /// waiting their turn, requests behind a store that never answered waited for each
    /// attempt before theirs, one after the other (a server started while its network was
    /// cut off answered nothing for 15 s). One whose turn comes in time makes an attempt of
    /// its own, so a slow connect that succeeds on a second try still serves it.
    async fn get<F>(
        &self,
        connect: impl FnOnce() -> F,
        timeout: Duration,
    ) -> Result<(T, u64), StoreError>
    where
        F: Future<Output = redis::RedisResult<T>>,
    {
        if let (Some(conn), generation) = &*self.current.lock() {
            return Ok((conn.clone(), *generation));
        }
        let Ok(_connecting) = tokio::time::timeout(timeout, self.connecting.lock()).await else {
            return Err(StoreError::new(format!(
                "redis: cannot connect: another request's attempt to connect has not ended \
                 within the store's timeout ({timeout:?})"
            ))
            .unavailable());
        };
        if let (Some(conn), generation) = &*self.current.lock() {
            return Ok((conn.clone(), *generation));
        }
        let conn = connect().await.map_err(|e| redis_error("cannot connect", e).unavailable())?;
        let mut current = self.current.lock();
        current.0 = Some(conn.clone());
        current.1 += 1;
        Ok((conn, current.1))
    }

    /// Drops the connection of `generation` after it failed (not a newer one), so that the
    /// next request connects afresh.
    fn failed(&self, generation: u64) {
        let mut current = self.current.lock();
        if current.1 == generation {
            current.0 = None;
        }
    }
}

/// Runs `request` on the connection of `slot`, made with `connect` if there is none (see
/// [`RedisStore::on_connection`]).
pub(super) async fn run_on<K: Clone, T, G, F>(
    slot: &Connection<K>,
    connect: impl FnOnce() -> G,
    request: impl FnOnce(K) -> F,
    writes: Writes,
    timeout: Duration,
) -> Result<T, StoreError>
where
    G: Future<Output = redis::RedisResult<K>>,
    F: Future<Output = redis::RedisResult<T>>,
{
    let (conn, generation) = slot.get(connect, timeout).await?;
    request(conn).await.map_err(|e| {
        let broken = e.is_io_error()
            || e.is_timeout()
            || e.is_connection_dropped()
            || e.is_unrecoverable_error();
        // A primary that has become a replica (after a failover) refuses writes, and has
        // done none: connect afresh, to the primary the Sentinels name now.
        let demoted = e.code() == Some("READONLY");
        if broken || demoted {
            slot.failed(generation);
        }
        let error = redis_error("request failed", e);
        match (broken, writes) {
            (true, Writes::Yes) => error.sent().unavailable(),
            (true, Writes::No) => error.unavailable(),
            (false, _) if demoted => error.unavailable(),
            (false, _) => error,
        }
    })
}

/// A handle to a connection of either kind, for commands that run on both.
#[derive(Clone)]
pub(super) enum AnyConnection {
    One(MultiplexedConnection),
    #[cfg(feature = "redis-cluster")]
    Cluster(ClusterConnection),
}

impl redis::aio::ConnectionLike for AnyConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, Value> {
        match self {
            AnyConnection::One(conn) => conn.req_packed_command(cmd),
            #[cfg(feature = "redis-cluster")]
            AnyConnection::Cluster(conn) => conn.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<Value>> {
        match self {
            AnyConnection::One(conn) => conn.req_packed_commands(cmd, offset, count),
            #[cfg(feature = "redis-cluster")]
            AnyConnection::Cluster(conn) => conn.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            AnyConnection::One(conn) => conn.get_db(),
            #[cfg(feature = "redis-cluster")]
            AnyConnection::Cluster(conn) => conn.get_db(),
        }
    }
}

impl<C: Clock> Inner<C> {
    /// Runs `request` on a connection (a cheap handle to a multiplexed one). A failure of
    /// the connection (not an error answered by Redis) drops it, so the next request
    /// connects afresh; if `writes` and the request may have reached Redis, the error says
    /// that it may have run.
    pub(super) async fn on_connection<T, F>(
        &self,
        writes: Writes,
        request: impl FnOnce(AnyConnection) -> F,
    ) -> Result<T, StoreError>
    where
        F: Future<Output = redis::RedisResult<T>>,
    {
        match &self.server {
            Server::One { source, config, connections, next } => {
                let i = next.fetch_add(1, Ordering::Relaxed) % connections.len();
                let connect = || source.connect(config, self.timeout);
                if self.replicas == 0 || writes == Writes::No {
                    return run_on(
                        &connections[i],
                        connect,
                        |c| request(AnyConnection::One(c)),
                        writes,
                        self.timeout,
                    )
                    .await;
                }
                let started = std::time::Instant::now();
                let (answer, conn) = run_on(
                    &connections[i],
                    connect,
                    |c| {
                        let kept = c.clone();
                        async move { Ok((request(AnyConnection::One(c)).await?, kept)) }
                    },
                    writes,
                    self.timeout,
                )
                .await?;
                self.acknowledged(conn, started).await?;
                Ok(answer)
            }
            #[cfg(feature = "redis-cluster")]
            Server::Cluster { client, connection } => {
                let connect = || client.get_async_connection();
                let request = |c| request(AnyConnection::Cluster(c));
                run_on(connection, connect, request, writes, self.timeout).await
            }
        }
    }

    /// Waits (`WAIT`) until `replicas` replicas have every write sent on `conn` so far, for
    /// what is left of the store's timeout since `started`. Fewer in that time: an error that
    /// says the write may have run (it did, on the primary), so the request is refused, and
    /// an answer given is on `replicas` replicas besides the primary.
    async fn acknowledged(
        &self,
        mut conn: MultiplexedConnection,
        started: std::time::Instant,
    ) -> Result<(), StoreError> {
        // Four fifths of what is left, so that the reply comes before the connection's own
        // timeout; at least 1 ms, since `WAIT n 0` would wait for ever.
        let left = self.timeout.saturating_sub(started.elapsed()) * 4 / 5;
        let left = left.max(Duration::from_millis(1));
        let millis = u64::try_from(left.as_millis()).unwrap_or(u64::MAX);
        let mut wait = redis::cmd("WAIT");
        wait.arg(self.replicas).arg(millis);
        let short = |n: String| {
            StoreError::new(format!(
                "redis: {n} of the {} replicas asked for (replicas={}) acknowledged the write \
                 within {left:?}; refused, since a failover could lose it",
                self.replicas, self.replicas
            ))
            .sent()
            .unavailable()
        };
        match wait.query_async::<i64>(&mut conn).await {
            Ok(n) if n >= i64::from(self.replicas) => Ok(()),
            Ok(n) => Err(short(n.to_string())),
            // Redis ends a `WAIT` on its timer, up to 1/hz (100 ms by default) late: the
            // connection's own timeout may come first.
            Err(e) if e.is_timeout() => Err(short("fewer".into())),
            Err(e) => Err(redis_error("WAIT (replicas=) failed", e).sent().unavailable()),
        }
    }
}

//! The behaviours every store must show (the exported suite, `tollgate::testing`), on each of
//! tollgate's stores: every store through the async API, and those that keep a sync API
//! (memory, SQLite) through that too. Backends join with one line each.

use tokio::runtime::Runtime;
use tollgate::ManualClock;

mod common;

macro_rules! conformance {
    // A store with both APIs.
    ($backend:ident, $make:expr, $available:expr, sync and async) => {
        mod $backend {
            mod sync_api {
                tollgate::conformance_tests!(sync_api, $make, $available);
            }
            mod async_api {
                tollgate::conformance_tests!(async_api, $make, $available);
            }
        }
    };
    // A store with the async API only.
    ($backend:ident, $make:expr, $available:expr) => {
        mod $backend {
            mod async_api {
                tollgate::conformance_tests!(async_api, $make, $available);
            }
        }
    };
}

conformance!(memory, |_: &tokio::runtime::Runtime, clock| tollgate::MemoryStore::with_clock(clock), true, sync and async);
conformance!(
    memory_two_segments,
    |_: &tokio::runtime::Runtime, clock| tollgate::MemoryStore::builder().segments(2).build_with_clock(clock),
    true,
    sync and async
);

// The memory store picked at run time: the async calls take its sync path as a `&dyn Store`
// (`AsyncStore::immediate`), as the server's do.
conformance!(
    memory_behind_dyn,
    |_: &tokio::runtime::Runtime, clock| -> std::sync::Arc<dyn tollgate::AsyncStore> {
        std::sync::Arc::new(tollgate::MemoryStore::with_clock(clock))
    },
    true
);

#[cfg(feature = "sqlite")]
conformance!(
    sqlite_in_memory,
    |_: &tokio::runtime::Runtime, clock| {
        tollgate::store::SqliteStore::builder().open_in_memory_with_clock(clock).unwrap()
    },
    true,
    sync and async
);

#[cfg(feature = "sqlite")]
conformance!(sqlite_file, crate::on_disk, true, sync and async);

/// A SQLite store on a file in a directory that goes away with it.
#[cfg(feature = "sqlite")]
fn on_disk(
    _: &Runtime,
    clock: ManualClock,
) -> common::Owned<tollgate::store::SqliteStore<ManualClock>, tempfile::TempDir> {
    let dir = tempfile::tempdir().unwrap();
    let store = tollgate::store::SqliteStore::builder()
        .open_with_clock(dir.path().join("t.db"), clock)
        .unwrap();
    common::Owned { store, resource: dir }
}

#[cfg(feature = "redis")]
conformance!(redis, crate::on_redis::open, crate::on_redis::url().is_some());

/// The suite's limits that have no shards (a leased limit has none), each leased by the
/// `*_leased` stores below with a floor of the whole capacity: every take of them goes the
/// lease path's way (a direct take through the lease script or function, refilled under the
/// cap of the leases out, a reset through the lease step), as near its bound, where a
/// leased limit must answer exactly as one that is not.
#[cfg(any(feature = "redis", feature = "postgres"))]
const LEASED: [&str; 7] = ["tb", "fw", "burst", "mr", "win", "small", "race"];

#[cfg(any(feature = "redis", feature = "postgres"))]
fn near_the_bound() -> tollgate::store::LeaseOptions {
    tollgate::store::LeaseOptions::new().floor(1.0)
}

#[cfg(feature = "redis")]
conformance!(redis_leased, crate::on_redis::open_leased, crate::on_redis::url().is_some());

#[cfg(feature = "redis")]
conformance!(redis_acl_user, crate::on_redis::open_as_user, crate::on_redis::url().is_some());

#[cfg(feature = "redis")]
mod on_redis {
    use std::sync::atomic::{AtomicU64, Ordering};

    use tokio::runtime::Runtime;
    use tollgate::ManualClock;
    use tollgate::store::RedisStore;

    pub(crate) fn url() -> Option<String> {
        super::common::backend_url("TOLLGATE_REDIS_URL", "redis://127.0.0.1:6379")
    }

    #[cfg(feature = "redis-cluster")]
    pub(crate) fn cluster_url() -> Option<String> {
        super::common::backend_url(
            "TOLLGATE_REDIS_CLUSTER_URL",
            "redis+cluster://127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002 (scripts/redis-cluster start DIR prints one)",
        )
    }

    /// A store with a key prefix of its own, so tests never see each other's states.
    /// A store's builder on a key prefix of its own.
    fn builder() -> tollgate::store::RedisStoreBuilder {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let prefix = format!(
            "tollgate-test:{}:{}:",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        RedisStore::builder().prefix(prefix)
    }

    fn open_on(url: &str, clock: ManualClock) -> RedisStore<ManualClock> {
        builder().open_with_clock(url, clock).unwrap()
    }

    /// Through Sentinels or over TLS, with a timeout of 5 s: a first connection there asks
    /// the Sentinels, then shakes hands, and under CI's load (hundreds of tests at once, each
    /// store connecting afresh) took over the default 1 s now and then. The suite is about
    /// what the store answers, not how fast.
    fn open_slow(url: &str, clock: ManualClock) -> RedisStore<ManualClock> {
        builder().timeout(std::time::Duration::from_secs(5)).open_with_clock(url, clock).unwrap()
    }

    pub(crate) fn open(_: &Runtime, clock: ManualClock) -> RedisStore<ManualClock> {
        open_on(&url().expect("checked"), clock)
    }

    /// With the suite's unsharded limits leased (see [`crate::LEASED`]).
    pub(crate) fn open_leased(_: &Runtime, clock: ManualClock) -> RedisStore<ManualClock> {
        let leasing =
            crate::LEASED.iter().fold(builder(), |b, n| b.lease(*n, crate::near_the_bound()));
        leasing.open_with_clock(&url().expect("checked"), clock).unwrap()
    }

    /// The commands a tollgate user needs, as the guide's `ACL SETUSER` gives them (shell
    /// quotes included: the guide's Redis chapter is checked to hold this very text).
    const ACL_COMMANDS: &str = "+evalsha '+script|load' +time +get +mget +set +del +pexpire +zadd +zrem +zscore +zcard +zrange +zrangebyscore +zremrangebyscore +hget +hmget +hset +hdel";

    /// What a cluster's user needs besides: the command redis-rs finds the nodes with.
    #[cfg(feature = "redis-cluster")]
    const ACL_CLUSTER_COMMANDS: &str = "'+cluster|slots'";

    /// What a user behind Sentinel needs besides: `ROLE` (the store checks that the node
    /// the Sentinels name is the primary) and `WAIT` (for `replicas=N`).
    const ACL_SENTINEL_COMMANDS: &str = "+role +wait";

    const ACL_USER: (&str, &str) = ("tollgate-test-acl", "tollgate-test-acl-password");

    /// Makes (again) the ACL user of these tests on the Redis at `admin` (a `redis://` URL
    /// whose user may): `commands` alone, on the tests' keys alone (`~tollgate-test:*`).
    fn set_up_user(admin: &str, commands: &str) {
        let guide = include_str!("../../../docs/src/stores/redis.md");
        assert!(guide.contains(commands), "the guide's ACL does not hold {commands:?}");
        let (user, password) = ACL_USER;
        let mut conn = redis::Client::open(admin).unwrap().get_connection().unwrap();
        let mut setuser = redis::cmd("ACL");
        setuser.arg(&["SETUSER", user, "reset", "on", &format!(">{password}")][..]);
        setuser.arg(&["~tollgate-test:*", "resetchannels", "-@all"][..]);
        setuser.arg(commands.split(' ').map(|c| c.trim_matches('\'')).collect::<Vec<_>>());
        let () = setuser.query(&mut conn).expect("ACL SETUSER");
    }

    /// `url` (`redis://HOST:PORT` or `redis+cluster://HOST:PORT,...`) with the tests' ACL
    /// user's credentials in place of any it has.
    fn as_user(url: &str) -> String {
        let (scheme, rest) = url.split_once("://").expect("a URL");
        let rest = rest.rsplit_once('@').map_or(rest, |(_, hosts)| hosts);
        let (user, password) = ACL_USER;
        format!("{scheme}://{user}:{password}@{rest}")
    }

    /// A store that connects as a Redis ACL user allowed the guide's commands alone.
    pub(crate) fn open_as_user(_: &Runtime, clock: ManualClock) -> RedisStore<ManualClock> {
        static URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        let url = URL.get_or_init(|| {
            let admin = url().expect("checked");
            set_up_user(&admin, ACL_COMMANDS);
            as_user(&admin)
        });
        open_on(url, clock)
    }

    /// The same on Redis Cluster: the user made on every node, with the guide's commands
    /// for a cluster.
    #[cfg(feature = "redis-cluster")]
    pub(crate) fn open_cluster_as_user(_: &Runtime, clock: ManualClock) -> RedisStore<ManualClock> {
        static URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        let url = URL.get_or_init(|| {
            let admin = cluster_url().expect("checked");
            let nodes = admin.strip_prefix("redis+cluster://").expect("a redis+cluster:// URL");
            let nodes = nodes.rsplit_once('@').map_or(nodes, |(_, nodes)| nodes);
            let commands = format!("{ACL_COMMANDS} {ACL_CLUSTER_COMMANDS}");
            for node in nodes.split('/').next().unwrap_or_default().split(',') {
                set_up_user(&format!("redis://{}", node.trim()), &commands);
            }
            as_user(&admin)
        });
        open_on(url, clock)
    }

    /// One Redis over TLS, asking for a client certificate: `scripts/redis-tls start`.
    #[cfg(feature = "redis-tls")]
    pub(crate) fn tls_url() -> Option<String> {
        super::common::backend_url(
            "TOLLGATE_REDIS_TLS_URL",
            "rediss://127.0.0.1:6380?ca=ca.crt&cert=client.crt&key=client.key (scripts/redis-tls start DIR prints one)",
        )
    }

    /// A primary, replicas and Sentinels: `scripts/redis-sentinel start`.
    pub(crate) fn sentinel_url() -> Option<String> {
        super::common::backend_url(
            "TOLLGATE_REDIS_SENTINEL_URL",
            "redis+sentinel://127.0.0.1:26379/tollgate (scripts/redis-sentinel start DIR prints one)",
        )
    }

    /// The same over TLS: `scripts/redis-sentinel start DIR CERTS`.
    #[cfg(feature = "redis-tls")]
    pub(crate) fn sentinel_tls_url() -> Option<String> {
        super::common::backend_url(
            "TOLLGATE_REDIS_SENTINEL_TLS_URL",
            "rediss+sentinel://127.0.0.1:26379/tollgate?ca=ca.crt (scripts/redis-sentinel start DIR CERTS prints one)",
        )
    }

    /// A cluster over TLS: `scripts/redis-cluster start DIR CERTS`.
    #[cfg(all(feature = "redis-cluster", feature = "redis-tls"))]
    pub(crate) fn cluster_tls_url() -> Option<String> {
        super::common::backend_url(
            "TOLLGATE_REDIS_CLUSTER_TLS_URL",
            "rediss+cluster://127.0.0.1:7000,127.0.0.1:7001?ca=ca.crt (scripts/redis-cluster start DIR CERTS prints one)",
        )
    }

    #[cfg(feature = "redis-tls")]
    pub(crate) fn open_tls(_: &Runtime, clock: ManualClock) -> RedisStore<ManualClock> {
        open_slow(&tls_url().expect("checked"), clock)
    }

    pub(crate) fn open_sentinel(_: &Runtime, clock: ManualClock) -> RedisStore<ManualClock> {
        open_slow(&sentinel_url().expect("checked"), clock)
    }

    #[cfg(feature = "redis-tls")]
    pub(crate) fn open_sentinel_tls(_: &Runtime, clock: ManualClock) -> RedisStore<ManualClock> {
        open_slow(&sentinel_tls_url().expect("checked"), clock)
    }

    #[cfg(all(feature = "redis-cluster", feature = "redis-tls"))]
    pub(crate) fn open_cluster_tls(_: &Runtime, clock: ManualClock) -> RedisStore<ManualClock> {
        open_slow(&cluster_tls_url().expect("checked"), clock)
    }

    /// Behind Sentinel, with `replicas=1`: the user made on the primary and every replica
    /// (ACLs are not replicated, and any replica may be promoted), with the guide's
    /// commands for Sentinel.
    pub(crate) fn open_sentinel_as_user(
        _: &Runtime,
        clock: ManualClock,
    ) -> RedisStore<ManualClock> {
        static URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        let url = URL.get_or_init(|| {
            let admin = sentinel_url().expect("checked");
            let rest = admin.strip_prefix("redis+sentinel://").expect("a redis+sentinel:// URL");
            let (sentinels, master) = rest.split_once('/').expect("/MASTER");
            let sentinel = sentinels.rsplit_once('@').map_or(sentinels, |(_, s)| s);
            let sentinel = format!("redis://{}", sentinel.split(',').next().unwrap());
            let mut conn = redis::Client::open(sentinel).unwrap().get_connection().unwrap();
            let primary: Vec<String> = redis::cmd("SENTINEL")
                .arg(&["get-master-addr-by-name", master][..])
                .query(&mut conn)
                .unwrap();
            let replicas: Vec<Vec<String>> =
                redis::cmd("SENTINEL").arg(&["replicas", master][..]).query(&mut conn).unwrap();
            let field = |fields: &[String], name: &str| {
                let at = fields.iter().position(|f| f == name).expect(name);
                fields[at + 1].clone()
            };
            let mut nodes = vec![format!("{}:{}", primary[0], primary[1])];
            nodes.extend(
                replicas.iter().map(|r| format!("{}:{}", field(r, "ip"), field(r, "port"))),
            );
            let commands = format!("{ACL_COMMANDS} {ACL_SENTINEL_COMMANDS}");
            for node in nodes {
                set_up_user(&format!("redis://{node}"), &commands);
            }
            format!("{}?replicas=1", as_user(&admin))
        });
        open_slow(url, clock)
    }

    /// On Redis Cluster, each state placed by its own key: the shards of a limit spread
    /// over the nodes.
    #[cfg(feature = "redis-cluster")]
    pub(crate) fn open_cluster(_: &Runtime, clock: ManualClock) -> RedisStore<ManualClock> {
        open_on(&cluster_url().expect("checked"), clock)
    }
}

#[cfg(feature = "redis-cluster")]
conformance!(
    redis_cluster,
    crate::on_redis::open_cluster,
    crate::on_redis::cluster_url().is_some()
);

#[cfg(feature = "redis-cluster")]
conformance!(
    redis_cluster_acl_user,
    crate::on_redis::open_cluster_as_user,
    crate::on_redis::cluster_url().is_some()
);

#[cfg(feature = "redis-tls")]
conformance!(redis_tls, crate::on_redis::open_tls, crate::on_redis::tls_url().is_some());

#[cfg(feature = "redis")]
conformance!(
    redis_sentinel,
    crate::on_redis::open_sentinel,
    crate::on_redis::sentinel_url().is_some()
);

#[cfg(feature = "redis")]
conformance!(
    redis_sentinel_acl_user_replicas_1,
    crate::on_redis::open_sentinel_as_user,
    crate::on_redis::sentinel_url().is_some()
);

#[cfg(feature = "redis-tls")]
conformance!(
    redis_sentinel_tls,
    crate::on_redis::open_sentinel_tls,
    crate::on_redis::sentinel_tls_url().is_some()
);

#[cfg(all(feature = "redis-cluster", feature = "redis-tls"))]
conformance!(
    redis_cluster_tls,
    crate::on_redis::open_cluster_tls,
    crate::on_redis::cluster_tls_url().is_some()
);

#[cfg(feature = "postgres")]
conformance!(postgres, crate::on_postgres::open, crate::on_postgres::url().is_some());

#[cfg(feature = "postgres")]
conformance!(postgres_leased, crate::on_postgres::open_leased, crate::on_postgres::url().is_some());

#[cfg(feature = "postgres")]
mod on_postgres {
    use tokio::runtime::Runtime;
    use tollgate::ManualClock;
    use tollgate::store::PgStore;

    use super::common::{DropTable, Owned, backend_url};

    pub(crate) fn url() -> Option<String> {
        backend_url("TOLLGATE_POSTGRES_URL", "postgres://postgres@127.0.0.1/test")
    }

    /// A store on a table of its own, dropped with it.
    pub(crate) fn open(
        runtime: &Runtime,
        clock: ManualClock,
    ) -> Owned<PgStore<ManualClock>, DropTable> {
        open_leasing(runtime, clock, &[])
    }

    /// With the suite's unsharded limits leased (see [`crate::LEASED`]).
    pub(crate) fn open_leased(
        runtime: &Runtime,
        clock: ManualClock,
    ) -> Owned<PgStore<ManualClock>, DropTable> {
        open_leasing(runtime, clock, &crate::LEASED)
    }

    /// A store on a table of its own, dropped with it, leasing the limits `leased`.
    fn open_leasing(
        runtime: &Runtime,
        clock: ManualClock,
        leased: &[&str],
    ) -> Owned<PgStore<ManualClock>, DropTable> {
        let table = DropTable::new(&url().expect("checked"), "tollgate_test");
        let builder = leased.iter().fold(PgStore::builder().table(&table.table), |b, name| {
            b.lease(*name, crate::near_the_bound())
        });
        let store = builder.open_with_clock(&table.url, clock);
        Owned { store: runtime.block_on(store).unwrap(), resource: table }
    }
}

//! Opening a store from its URL.

use std::sync::Arc;

use anyhow::{Context, bail};
use tollgate::MemoryStore;
use tollgate::store::{PgStore, RedisStore, SqliteStore};

use crate::engine::DynStore;

/// A store opened from a URL, with what the server needs to know about it.
pub struct Opened {
    /// The store.
    pub store: DynStore,
    /// Whether its calls block on I/O (run them off the async threads).
    pub blocking: bool,
    /// The SQLite store, to sweep full states now and then.
    pub sqlite: Option<Arc<SqliteStore>>,
}

/// Opens `memory`, `sqlite://PATH` (`sqlite://tollgate.db` is relative to the working
/// directory, `sqlite:///var/lib/tollgate.db` absolute), `redis://HOST:PORT/DB`,
/// `redis+cluster://HOST:PORT,HOST:PORT` or `postgres://USER@HOST/DB`.
///
/// # Errors
///
/// An unknown scheme, a bad URL, or a file that cannot be opened.
pub fn open(url: &str) -> anyhow::Result<Opened> {
    if url == "memory" || url == "memory://" {
        return Ok(Opened { store: Arc::new(MemoryStore::new()), blocking: false, sqlite: None });
    }
    if let Some(path) = url.strip_prefix("sqlite://") {
        if path.is_empty() {
            bail!("store {url:?}: give a file, as in sqlite://tollgate.db");
        }
        let sqlite = Arc::new(SqliteStore::open(path).with_context(|| format!("store {url:?}"))?);
        return Ok(Opened {
            store: Arc::clone(&sqlite) as DynStore,
            blocking: true,
            sqlite: Some(sqlite),
        });
    }
    if url.starts_with("redis://")
        || url.starts_with("rediss://")
        || url.starts_with("redis+cluster://")
    {
        let redis = RedisStore::open(url).with_context(|| format!("store {url:?}"))?;
        return Ok(Opened { store: Arc::new(redis), blocking: true, sqlite: None });
    }
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let pg = PgStore::open(url).with_context(|| format!("store {url:?}"))?;
        return Ok(Opened { store: Arc::new(pg), blocking: true, sqlite: None });
    }
    bail!(
        "store {url:?}: unknown store; use memory, sqlite://PATH, redis://HOST:PORT, \
         redis+cluster://HOST:PORT,HOST:PORT or postgres://USER@HOST/DB"
    )
}

//! The keys of a name's states on Redis, found with `SCAN` (on a cluster, on each primary):
//! what [`RateLimiter::carry_async`](crate::RateLimiter::carry_async) walks after a limit's
//! config changed; and the hash tag that places a key on a cluster.

use redis::Value;
use tollgate_algebra::Clock;

use super::{AnyConnection, Inner, RedisStore, Writes};
use crate::error::StoreError;

/// How many keys a `SCAN` step looks at: small steps keep Redis answering others between them.
const STEP: u32 = 1_000;

impl<C: Clock> RedisStore<C> {
    /// The key and shard of every state stored for `name`, found by `SCAN` (on Redis Cluster,
    /// on each primary): O(every key of the database), a step of 1,000 keys at a time, each a
    /// round trip, so Redis answers other requests between them. A user limited by an ACL
    /// needs `+scan` for it (and `+cluster|slots` on a cluster).
    ///
    /// # Errors
    ///
    /// The store's: Redis cannot be reached, or refuses `SCAN`.
    pub async fn keys_of(&self, name: &str) -> Result<Vec<(Option<String>, u16)>, StoreError> {
        let head = self.inner.key_head(name);
        let pattern = format!("{}*", glob_escaped(&head));
        let scanned = self
            .inner
            .on_connection(Writes::No, |conn| async move {
                let mut found = Vec::new();
                match conn {
                    AnyConnection::One(mut conn) => {
                        scan(&mut conn, &pattern, None, &mut found).await?;
                    }
                    #[cfg(feature = "redis-cluster")]
                    AnyConnection::Cluster(mut conn) => {
                        for (host, port) in primaries(&mut conn).await? {
                            let node = Some((host, port));
                            scan(&mut conn, &pattern, node, &mut found).await?;
                        }
                    }
                }
                Ok(found)
            })
            .await?;
        let mut keys: Vec<(Option<String>, u16)> =
            scanned.iter().filter_map(|k| parse(k.strip_prefix(head.as_bytes())?)).collect();
        // SCAN may return a key twice (when the table is resized meanwhile).
        keys.sort_unstable();
        keys.dedup();
        Ok(keys)
    }
}

impl<C> Inner<C> {
    /// The start every key of `name`'s states shares (see [`Inner::key`]).
    fn key_head(&self, name: &str) -> String {
        format!("{}{}:{name}:", self.prefix, name.len())
    }
}

/// `SCAN`s the keys matching `pattern` into `found`: on the connection's node, or with a
/// cluster's connection on the node `node` (host, port).
async fn scan(
    conn: &mut (impl redis::aio::ConnectionLike + RouteTo + Send),
    pattern: &str,
    node: Option<(String, u16)>,
    found: &mut Vec<Vec<u8>>,
) -> redis::RedisResult<()> {
    let mut cursor = 0u64;
    loop {
        let mut cmd = redis::cmd("SCAN");
        cmd.arg(cursor).arg("MATCH").arg(pattern).arg("COUNT").arg(STEP);
        let (next, keys): (u64, Vec<Vec<u8>>) = match &node {
            None => cmd.query_async(conn).await?,
            Some((host, port)) => redis::from_redis_value(conn.route_to(cmd, host, *port).await?)?,
        };
        found.extend(keys);
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

/// A connection that can send a command to a given node of a cluster.
trait RouteTo {
    fn route_to(
        &mut self,
        cmd: redis::Cmd,
        host: &str,
        port: u16,
    ) -> impl std::future::Future<Output = redis::RedisResult<Value>> + Send;
}

impl RouteTo for redis::aio::MultiplexedConnection {
    async fn route_to(&mut self, cmd: redis::Cmd, _: &str, _: u16) -> redis::RedisResult<Value> {
        cmd.query_async(self).await
    }
}

#[cfg(feature = "redis-cluster")]
impl RouteTo for redis::cluster_async::ClusterConnection {
    async fn route_to(
        &mut self,
        cmd: redis::Cmd,
        host: &str,
        port: u16,
    ) -> redis::RedisResult<Value> {
        use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
        let node = SingleNodeRoutingInfo::ByAddress { host: host.to_owned(), port };
        self.route_command(cmd, RoutingInfo::SingleNode(node)).await
    }
}

/// The cluster's primaries (host, port), from `CLUSTER SLOTS`.
#[cfg(feature = "redis-cluster")]
async fn primaries(
    conn: &mut redis::cluster_async::ClusterConnection,
) -> redis::RedisResult<Vec<(String, u16)>> {
    // Each range: [start, end, [host, port, id, ...], replicas...].
    let ranges: Vec<Vec<Value>> = redis::cmd("CLUSTER").arg("SLOTS").query_async(conn).await?;
    let mut nodes: Vec<(String, u16)> = Vec::new();
    for range in ranges {
        let Some(Value::Array(primary)) = range.get(2) else { continue };
        let (Some(host), Some(port)) = (primary.first(), primary.get(1)) else { continue };
        let node = (
            redis::from_redis_value::<String>(host.clone())?,
            redis::from_redis_value(port.clone())?,
        );
        if !nodes.contains(&node) {
            nodes.push(node);
        }
    }
    Ok(nodes)
}

/// The part of `key` Redis Cluster places it by, if it has one: what lies between its first
/// `{` and the next `}`, when that is not empty (else the whole key places it).
pub(super) fn hash_tag(key: &[u8]) -> Option<&[u8]> {
    let open = key.iter().position(|&c| c == b'{')?;
    let rest = &key[open + 1..];
    let close = rest.iter().position(|&c| c == b'}')?;
    (close > 0).then(|| &rest[..close])
}

/// `text` with the characters `SCAN`'s patterns treat specially escaped.
fn glob_escaped(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 4);
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The key and shard of a state's key after its name's head: `n:<shard>` (no key) or
/// `k<len>:<key>:<shard>`.
fn parse(rest: &[u8]) -> Option<(Option<String>, u16)> {
    let text = std::str::from_utf8(rest).ok()?;
    let (key, shard) = if let Some(shard) = text.strip_prefix("n:") {
        (None, shard)
    } else {
        let text = text.strip_prefix('k')?;
        let (len, rest) = text.split_once(':')?;
        let len: usize = len.parse().ok()?;
        let key = rest.get(..len)?;
        (Some(key.to_owned()), rest.get(len..)?.strip_prefix(':')?)
    };
    Some((key, shard.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_read_back_from_their_text() {
        assert_eq!(parse(b"n:0"), Some((None, 0)));
        assert_eq!(parse(b"k0::3"), Some((Some(String::new()), 3)));
        assert_eq!(parse(b"k3:a:b:12"), Some((Some("a:b".to_owned()), 12)));
        assert_eq!(parse(b"k9:short:1"), None);
        assert_eq!(parse(b"x:1"), None);
        assert_eq!(glob_escaped("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
    }
}

//! The URLs of the Redis store: one Redis, a Redis Cluster, or a primary found through
//! Sentinels, each in plain text or over TLS, and tollgate's own parameters after `?`.

use redis::{Client, ConnectionAddr, IntoConnectionInfo, RedisError};

use crate::store::url::credentials_and_hosts;

/// Where the states are, as a URL says.
pub(super) enum Place {
    /// `redis://` or `rediss://`: one Redis.
    One(Client),
    /// `redis+cluster://` or `rediss+cluster://`: the nodes to start from, as `redis://` (or
    /// `rediss://`) URLs with the same credentials.
    Cluster(Vec<String>),
    /// `redis+sentinel://` or `rediss+sentinel://`: the primary of `master`, found through
    /// the Sentinels.
    Sentinel(redis::sentinel::SentinelClient),
}

/// A store URL taken apart.
pub(super) struct Url {
    pub(super) place: Place,
    /// `replicas=N`: every write waits for N replicas' acknowledgement (`WAIT`).
    pub(super) replicas: u32,
    /// The certificates of `ca=`, `cert=` and `key=`, for a TLS URL.
    #[cfg(feature = "redis-tls")]
    pub(super) certificates: Option<redis::TlsCertificates>,
}

/// tollgate's own parameters (redis-rs ignores what it does not know, so a typo would pass
/// in silence: every other parameter is refused).
const PARAMETERS: &str = "ca, cert, key, replicas, sentinel_user, sentinel_password";

fn invalid(detail: String) -> RedisError {
    RedisError::from((redis::ErrorKind::InvalidClientConfig, "invalid URL", detail))
}

/// Takes `url` apart (see [`RedisStoreBuilder::open`](super::RedisStoreBuilder::open)).
pub(super) fn parse(url: &str) -> redis::RedisResult<Url> {
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| invalid("not a URL: it has no scheme (redis://, …)".into()))?;
    let (tls, kind) = match scheme {
        "redis" => (false, "one"),
        "rediss" => (true, "one"),
        "redis+cluster" => (false, "cluster"),
        "rediss+cluster" => (true, "cluster"),
        "redis+sentinel" => (false, "sentinel"),
        "rediss+sentinel" => (true, "sentinel"),
        _ => {
            return Err(invalid(format!(
                "unknown scheme {scheme:?}: use redis://, rediss://, redis+cluster://, \
                 rediss+cluster://, redis+sentinel:// or rediss+sentinel://"
            )));
        }
    };
    #[cfg(not(feature = "redis-tls"))]
    if tls {
        return Err(invalid(format!("{scheme}:// (TLS) needs tollgate's `redis-tls` feature")));
    }
    let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
    let mut params = Params::default();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let value = decode(value)?;
        match name {
            "ca" => params.ca = Some(value),
            "cert" => params.cert = Some(value),
            "key" => params.key = Some(value),
            "replicas" => {
                params.replicas = value.parse().map_err(|_| {
                    invalid(format!("replicas={value:?}: give a number of replicas, as replicas=1"))
                })?;
            }
            "sentinel_user" => params.sentinel_user = Some(value),
            "sentinel_password" => params.sentinel_password = Some(value),
            _ => {
                return Err(invalid(format!(
                    "unknown parameter {name:?}; tollgate's are {PARAMETERS}"
                )));
            }
        }
    }
    if !tls && (params.ca.is_some() || params.cert.is_some() || params.key.is_some()) {
        return Err(invalid(format!(
            "ca=, cert= and key= are for TLS: use {scheme}s:// (or rediss+…://)",
            scheme = scheme.split('+').next().unwrap_or(scheme)
        )));
    }
    if params.cert.is_some() != params.key.is_some() {
        return Err(invalid("a client certificate needs both cert= and key=".into()));
    }
    if kind != "sentinel" && (params.sentinel_user.is_some() || params.sentinel_password.is_some())
    {
        return Err(invalid("sentinel_user= and sentinel_password= are for Sentinel URLs".into()));
    }
    if kind == "cluster" && params.replicas > 0 {
        return Err(invalid(
            "replicas= is for one Redis or a Sentinel-watched primary, not a cluster".into(),
        ));
    }
    #[cfg(feature = "redis-tls")]
    let certificates = if tls { Some(params.certificates()?) } else { None };
    let plain = if tls { "rediss" } else { "redis" };
    let place = match kind {
        "one" => {
            let info = format!("{plain}://{rest}").into_connection_info()?;
            // Each request is one small write: send it at once, not after an ACK.
            let info =
                info.set_tcp_settings(redis::io::tcp::TcpSettings::default().set_nodelay(true));
            #[cfg(feature = "redis-tls")]
            if let Some(certificates) = &certificates {
                Place::One(Client::build_with_tls(info, certificates.clone())?)
            } else {
                Place::One(Client::open(info)?)
            }
            #[cfg(not(feature = "redis-tls"))]
            Place::One(Client::open(info)?)
        }
        "cluster" => Place::Cluster(cluster_nodes(plain, rest)?),
        _ => Place::Sentinel(sentinel(
            tls,
            rest,
            &params,
            #[cfg(feature = "redis-tls")]
            certificates.as_ref(),
        )?),
    };
    Ok(Url {
        place,
        replicas: params.replicas,
        #[cfg(feature = "redis-tls")]
        certificates,
    })
}

#[derive(Default)]
struct Params {
    ca: Option<String>,
    cert: Option<String>,
    key: Option<String>,
    replicas: u32,
    sentinel_user: Option<String>,
    sentinel_password: Option<String>,
}

#[cfg(feature = "redis-tls")]
impl Params {
    /// The CA (else the system's roots) and the client certificate, read now so that a
    /// missing or unreadable file is an error at open, not at the first request.
    fn certificates(&self) -> redis::RedisResult<redis::TlsCertificates> {
        let read = |what: &str, path: &str| {
            std::fs::read(path).map_err(|e| invalid(format!("{what}={path}: {e}")))
        };
        let root_cert = self.ca.as_deref().map(|ca| read("ca", ca)).transpose()?;
        let client_tls = match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => Some(redis::ClientTlsConfig {
                client_cert: read("cert", cert)?,
                client_key: read("key", key)?,
            }),
            _ => None,
        };
        // One crypto provider for the process, should the app have none or several.
        let _ = rustls::crypto::ring::default_provider().install_default();
        Ok(redis::TlsCertificates { client_tls, root_cert })
    }
}

/// `%XX` escapes decoded (a path or password may hold `&`, `=` or `@`).
fn decode(value: &str) -> redis::RedisResult<String> {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = value
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| invalid(format!("{value:?}: a % not followed by two hex digits")))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| invalid(format!("{value:?}: not UTF-8")))
}

fn hosts(list: &str) -> Vec<&str> {
    list.split(',').map(str::trim).filter(|h| !h.is_empty()).collect()
}

/// The nodes of a cluster URL, each a URL of `scheme` with the same credentials.
fn cluster_nodes(scheme: &str, rest: &str) -> redis::RedisResult<Vec<String>> {
    let (auth, list) = credentials_and_hosts(rest);
    let auth = auth.map(|a| format!("{a}@")).unwrap_or_default();
    let urls: Vec<String> =
        hosts(list).into_iter().map(|h| format!("{scheme}://{auth}{h}")).collect();
    if urls.is_empty() {
        return Err(invalid("no cluster nodes given".into()));
    }
    Ok(urls)
}

/// `[USER:PASSWORD@]HOST:PORT[,HOST:PORT…]/MASTER[/DB]`: a client that finds the primary of
/// MASTER through the Sentinels at HOST:PORT, and connects to it with USER:PASSWORD and DB.
fn sentinel(
    tls: bool,
    rest: &str,
    params: &Params,
    #[cfg(feature = "redis-tls")] certificates: Option<&redis::TlsCertificates>,
) -> redis::RedisResult<redis::sentinel::SentinelClient> {
    use redis::sentinel::{SentinelClientBuilder, SentinelServerType};
    let (auth, list) = credentials_and_hosts(rest);
    let path = rest[rest.find('/').unwrap_or(rest.len())..].trim_matches('/');
    let mut path = path.split('/');
    let master = path.next().filter(|m| !m.is_empty()).ok_or_else(|| {
        invalid("no primary's name: give it after the Sentinels, as /mymaster".into())
    })?;
    let db = match path.next() {
        None | Some("") => 0,
        Some(db) => db.parse().map_err(|_| invalid(format!("{db:?} is not a database number")))?,
    };
    if path.next().is_some() {
        return Err(invalid("after the primary's name, only a database number".into()));
    }
    let mut addrs = Vec::new();
    for host in hosts(list) {
        let (name, port) = host
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h.trim_matches(['[', ']']), p.parse().ok()?)))
            .ok_or_else(|| invalid(format!("{host:?}: give each Sentinel as HOST:PORT")))?;
        addrs.push(if tls {
            ConnectionAddr::TcpTls {
                host: name.to_string(),
                port,
                insecure: false,
                tls_params: None,
            }
        } else {
            ConnectionAddr::Tcp(name.to_string(), port)
        });
    }
    if addrs.is_empty() {
        return Err(invalid("no Sentinels given".into()));
    }
    let tcp = || redis::io::tcp::TcpSettings::default().set_nodelay(true);
    let mut builder = SentinelClientBuilder::new(addrs, master, SentinelServerType::Master)?
        .set_client_to_redis_db(db)
        .set_client_to_redis_tcp_settings(tcp())
        .set_client_to_sentinel_tcp_settings(tcp());
    if let Some(auth) = auth {
        let (user, password) = auth.split_once(':').unwrap_or(("", auth));
        if !user.is_empty() {
            builder = builder.set_client_to_redis_username(decode(user)?);
        }
        builder = builder.set_client_to_redis_password(decode(password)?);
    }
    if let Some(user) = &params.sentinel_user {
        builder = builder.set_client_to_sentinel_username(user);
    }
    if let Some(password) = &params.sentinel_password {
        builder = builder.set_client_to_sentinel_password(password);
    }
    if tls {
        builder = builder
            .set_client_to_redis_tls_mode(redis::TlsMode::Secure)
            .set_client_to_sentinel_tls_mode(redis::TlsMode::Secure);
        #[cfg(feature = "redis-tls")]
        if let Some(certificates) = certificates {
            builder = builder
                .set_client_to_redis_certificates(certificates.clone())
                .set_client_to_sentinel_certificates(certificates.clone());
        }
    }
    builder.build()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(url: &str) -> String {
        match parse(url) {
            Ok(_) => panic!("{url} was taken"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn urls_of_each_place() {
        assert!(matches!(parse("redis://127.0.0.1:6379/2").unwrap().place, Place::One(_)));
        let url = parse("redis+cluster://u:p@127.0.0.1:1,127.0.0.1:2").unwrap();
        match url.place {
            Place::Cluster(nodes) => {
                assert_eq!(nodes, ["redis://u:p@127.0.0.1:1", "redis://u:p@127.0.0.1:2"]);
            }
            _ => panic!("not a cluster"),
        }
        let url =
            parse("redis+sentinel://:pw@127.0.0.1:1,127.0.0.1:2/mymaster/3?replicas=1").unwrap();
        assert!(matches!(url.place, Place::Sentinel(_)));
        assert_eq!(url.replicas, 1);
    }

    #[test]
    fn what_is_not_understood_is_refused() {
        assert!(error("redis://127.0.0.1?replica=1").contains("unknown parameter \"replica\""));
        assert!(error("redis://127.0.0.1?replicas=one").contains("give a number of replicas"));
        assert!(error("redis://127.0.0.1?ca=/x.pem").contains("are for TLS"));
        assert!(error("redis+cluster://127.0.0.1:1?replicas=1").contains("not a cluster"));
        assert!(error("redis+sentinel://127.0.0.1:1").contains("no primary's name"));
        assert!(error("redis+sentinel://127.0.0.1:1/m/x").contains("not a database number"));
        assert!(error("redis+sentinel://127.0.0.1/m").contains("HOST:PORT"));
        assert!(error("redis://127.0.0.1?sentinel_user=a").contains("for Sentinel URLs"));
        assert!(error("memcached://127.0.0.1").contains("unknown scheme"));
        assert!(error("redis+cluster://").contains("no cluster nodes"));
    }

    #[cfg(feature = "redis-tls")]
    #[test]
    fn certificate_files_are_read_at_open() {
        let e = error("rediss://127.0.0.1:1?ca=/no/such/ca.pem");
        assert!(e.contains("ca=/no/such/ca.pem") && e.contains("No such file"), "{e}");
        assert!(error("rediss://127.0.0.1:1?cert=/a.pem").contains("both cert= and key="));
    }

    #[test]
    fn escapes_are_decoded() {
        assert_eq!(decode("a%26b%3Dc%40d").unwrap(), "a&b=c@d");
        assert!(decode("a%2").is_err());
    }
}

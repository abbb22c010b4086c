//! Where a request's rate limit key comes from.

use std::borrow::Cow;
use std::fmt;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use http::request::Parts;

type KeyFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;

/// Where the key of a limit comes from, for each request.
///
/// A key that cannot be found (no peer address, a missing header, no user in the
/// extensions) is handled as [`MissingKey`] says: by default the request is refused with
/// `400 {"error": ...}` and nothing is taken.
#[derive(Clone)]
pub struct Key(Source);

#[derive(Clone)]
enum Source {
    Global,
    Peer(Peer),
    Header(http::HeaderName),
    Fn(Arc<KeyFn>),
}

/// A key of the client's IP address.
#[derive(Clone)]
struct Peer {
    /// The proxies whose forwarding headers are believed.
    trusted: Option<Arc<TrustedProxies>>,
    /// How many leading bits of an IPv6 address make the key (128: all of it).
    ipv6_subnet: u8,
}

/// The IPv6 subnet a client is keyed by unless told otherwise: a /56, the least a provider
/// gives one customer (RIPE-690 advises /48 or /56; one host alone holds a /64 at least),
/// so that one host cannot take a limit per address by cycling through its own addresses.
/// express-rate-limit's default too.
pub const DEFAULT_IPV6_SUBNET: u8 = 56;

impl Key {
    /// No key: one global value shared by every request.
    pub fn global() -> Self {
        Key(Source::Global)
    }

    /// The peer's IP address, from the connection: an IPv4 address as it is, an IPv6 address
    /// by its /56 ([`DEFAULT_IPV6_SUBNET`]; see [`Key::ipv6_subnet`]), an IPv4-mapped IPv6
    /// address (`::ffff:192.0.2.1`, what a server listening on `[::]` sees of an IPv4
    /// client) as the IPv4 address. The key's text: `192.0.2.1`, `2001:db8:abcd:1200::/56`
    /// (the network's first address in RFC 5952's form, then the prefix length), or with
    /// `.ipv6_subnet(128)` the whole address (`2001:db8:abcd:1234::1`): the Node and Python
    /// middleware write the same.
    ///
    /// It is read from the request's extensions: axum's `ConnectInfo<SocketAddr>` (with the
    /// `axum` feature; serve with `into_make_service_with_connect_info::<SocketAddr>()`), or a
    /// `SocketAddr` or `IpAddr` inserted by your own server code. `Forwarded` and
    /// `X-Forwarded-For` are ignored: any client can send them. Behind a proxy, use
    /// [`Key::peer_ip_behind`].
    pub fn peer_ip() -> Self {
        Key(Source::Peer(Peer { trusted: None, ipv6_subnet: DEFAULT_IPV6_SUBNET }))
    }

    /// The client's IP address behind trusted proxies.
    ///
    /// When the peer is one of `proxies`, the client is the right-most address of the
    /// `Forwarded` (`for=`) or else `X-Forwarded-For` header that is not itself a trusted
    /// proxy; each proxy appends the address it received from, so addresses to the right of
    /// the first untrusted one were written by proxies you trust, and those to its left by
    /// the client, who may lie. When the peer is not a trusted proxy, the headers are
    /// ignored and the peer is the client.
    ///
    /// # Examples
    ///
    /// ```
    /// use tollgate::tower::{Key, TrustedProxies};
    ///
    /// let key = Key::peer_ip_behind(TrustedProxies::parse(["10.0.0.0/8", "::1/128"]).unwrap());
    /// # let _ = key;
    /// ```
    pub fn peer_ip_behind(proxies: TrustedProxies) -> Self {
        Key(Source::Peer(Peer {
            trusted: Some(Arc::new(proxies)),
            ipv6_subnet: DEFAULT_IPV6_SUBNET,
        }))
    }

    /// Keys an IPv6 client by its first `bits` bits (1 to 128; default 56), for
    /// [`Key::peer_ip`] and [`Key::peer_ip_behind`]: `64` for one subnet each, `128` for
    /// each address alone (which lets one host take a limit per address it owns, and it owns
    /// billions). IPv4 clients are keyed by their whole address whatever it is.
    ///
    /// # Examples
    ///
    /// ```
    /// use tollgate::tower::Key;
    ///
    /// let per_subnet = Key::peer_ip().ipv6_subnet(64);
    /// # let _ = per_subnet;
    /// ```
    ///
    /// # Panics
    ///
    /// If `bits` is not in 1..=128, or the key is not the client's IP address (a header's,
    /// a function's): both mistakes of the code that builds the layer, found when it starts.
    #[must_use]
    pub fn ipv6_subnet(self, bits: u8) -> Self {
        assert!(
            (1..=128).contains(&bits),
            "Key::ipv6_subnet({bits}): give 1 to 128 bits (56 by default, 128 for whole addresses)"
        );
        match self.0 {
            Source::Peer(peer) => Key(Source::Peer(Peer { ipv6_subnet: bits, ..peer })),
            _ => panic!(
                "Key::ipv6_subnet applies to Key::peer_ip() and Key::peer_ip_behind(..) only; \
                 this key is {self:?}"
            ),
        }
    }

    /// The value of a request header (an API key, a session id).
    ///
    /// # Panics
    ///
    /// If `name` is not a valid header name.
    pub fn header(name: &str) -> Self {
        Key(Source::Header(
            http::HeaderName::from_bytes(name.as_bytes()).expect("a valid header name"),
        ))
    }

    /// A value that earlier middleware put in the request's extensions, such as the
    /// authenticated user: `Key::extension(|user: &User| user.id.to_string())`.
    pub fn extension<T: Send + Sync + 'static>(
        key: impl Fn(&T) -> String + Send + Sync + 'static,
    ) -> Self {
        Key::from_fn(move |parts| parts.extensions.get::<T>().map(&key))
    }

    /// Any function of the request's head; `None` means the key is missing.
    pub fn from_fn(key: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static) -> Self {
        Key(Source::Fn(Arc::new(key)))
    }

    /// The key of this request: `Ok(None)` for a global limit, `Err` when it is missing.
    /// A header's value is borrowed, not copied.
    pub(crate) fn of<'p>(&self, parts: &'p Parts) -> Result<Option<Cow<'p, str>>, Missing> {
        match &self.0 {
            Source::Global => Ok(None),
            Source::Peer(Peer { trusted, ipv6_subnet }) => {
                let peer = peer_addr(parts)
                    .ok_or(Missing("no peer address in the request's extensions"))?
                    .to_canonical();
                let client = match trusted {
                    Some(trusted) if trusted.contains(peer) => trusted.client(parts, peer),
                    _ => peer,
                };
                Ok(Some(Cow::Owned(ip_key(client, *ipv6_subnet))))
            }
            Source::Header(name) => {
                let value = parts.headers.get(name).ok_or(Missing("the key header is missing"))?;
                let value =
                    value.to_str().map_err(|_| Missing("the key header is not visible ASCII"))?;
                Ok(Some(Cow::Borrowed(value)))
            }
            Source::Fn(key) => {
                key(parts).map(|k| Some(Cow::Owned(k))).ok_or(Missing("no key for this request"))
            }
        }
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Source::Global => f.write_str("Key::global()"),
            Source::Peer(Peer { trusted: None, ipv6_subnet }) => {
                write!(f, "Key::peer_ip().ipv6_subnet({ipv6_subnet})")
            }
            Source::Peer(Peer { trusted: Some(t), ipv6_subnet }) => {
                write!(f, "Key::peer_ip_behind({t:?}).ipv6_subnet({ipv6_subnet})")
            }
            Source::Header(h) => write!(f, "Key::header({h:?})"),
            Source::Fn(_) => f.write_str("Key::from_fn(..)"),
        }
    }
}

/// Why a key could not be found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Missing(pub(crate) &'static str);

/// What to do with a request whose key cannot be found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MissingKey {
    /// Refuse it with `400 {"error": ...}`; nothing is taken (the default).
    #[default]
    Reject,
    /// Count it against one shared value for all such requests (the key is absent).
    Shared,
    /// Let it through without taking anything from this limit.
    Skip,
}

/// The key of the client `ip` (see [`Key::peer_ip`]): an IPv4 address whole (an IPv4-mapped
/// IPv6 address as its IPv4 address), an IPv6 address by its first `ipv6_subnet` bits.
fn ip_key(ip: IpAddr, ipv6_subnet: u8) -> String {
    match ip.to_canonical() {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) if ipv6_subnet >= 128 => v6.to_string(),
        IpAddr::V6(v6) => {
            let mask = u128::MAX << (128 - u32::from(ipv6_subnet));
            format!("{}/{ipv6_subnet}", Ipv6Addr::from(u128::from(v6) & mask))
        }
    }
}

fn peer_addr(parts: &Parts) -> Option<IpAddr> {
    #[cfg(feature = "axum")]
    if let Some(info) = parts.extensions.get::<axum::extract::ConnectInfo<SocketAddr>>() {
        return Some(info.0.ip());
    }
    if let Some(addr) = parts.extensions.get::<SocketAddr>() {
        return Some(addr.ip());
    }
    parts.extensions.get::<IpAddr>().copied()
}

/// Networks whose addresses are proxies you run, for [`Key::peer_ip_behind`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrustedProxies(Vec<(IpAddr, u8)>);

impl TrustedProxies {
    /// Parses networks in CIDR form (`"10.0.0.0/8"`, `"::1/128"`) or single addresses.
    ///
    /// # Errors
    ///
    /// The first entry that is not an address or a network, as written.
    pub fn parse<'a>(networks: impl IntoIterator<Item = &'a str>) -> Result<Self, String> {
        networks
            .into_iter()
            .map(|net| {
                let bad = || format!("not an IP network: {net:?}");
                let (addr, len) = match net.split_once('/') {
                    Some((addr, len)) => (addr, Some(len.parse::<u8>().map_err(|_| bad())?)),
                    None => (net, None),
                };
                let addr: IpAddr = addr.trim().parse().map_err(|_| bad())?;
                let max = if addr.is_ipv4() { 32 } else { 128 };
                let len = len.unwrap_or(max);
                if len > max {
                    return Err(bad());
                }
                Ok((addr, len))
            })
            .collect::<Result<_, _>>()
            .map(TrustedProxies)
    }

    /// Whether `ip` is in one of the networks.
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.0.iter().any(|&(net, len)| in_network(ip, net, len))
    }

    /// The right-most forwarded address that is not a trusted proxy, or the last trusted one.
    fn client(&self, parts: &Parts, peer: IpAddr) -> IpAddr {
        let mut hops = forwarded_for(parts);
        let mut client = peer;
        while let Some(hop) = hops.pop() {
            client = hop;
            if !self.contains(hop) {
                break;
            }
        }
        client
    }
}

fn in_network(ip: IpAddr, net: IpAddr, len: u8) -> bool {
    match (ip, net) {
        (IpAddr::V4(ip), IpAddr::V4(net)) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
            u32::from(ip) & mask == u32::from(net) & mask
        }
        (IpAddr::V6(ip), IpAddr::V6(net)) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0);
            u128::from(ip) & mask == u128::from(net) & mask
        }
        _ => false,
    }
}

/// The addresses of `Forwarded: for=` if present, else of `X-Forwarded-For`, in order
/// (client first). Entries that are not IP addresses (`unknown`, obfuscated names) end the
/// list there: nothing to their left can be placed.
fn forwarded_for(parts: &Parts) -> Vec<IpAddr> {
    let forwarded: Vec<&str> = parts
        .headers
        .get_all(http::header::FORWARDED)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect();
    let entries: Vec<String> = if forwarded.is_empty() {
        parts
            .headers
            .get_all("x-forwarded-for")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(|s| s.trim().to_owned())
            .collect()
    } else {
        forwarded
            .iter()
            .flat_map(|v| v.split(','))
            .filter_map(|element| {
                element.split(';').find_map(|pair| {
                    let (k, v) = pair.trim().split_once('=')?;
                    k.eq_ignore_ascii_case("for").then(|| v.trim().trim_matches('"').to_owned())
                })
            })
            .collect()
    };
    let mut addrs = Vec::with_capacity(entries.len());
    for entry in entries.iter().rev() {
        match parse_node(entry) {
            Some(ip) => addrs.push(ip),
            None => break,
        }
    }
    addrs.reverse();
    addrs
}

/// An address as a proxy writes it: `1.2.3.4`, `1.2.3.4:5678`, `[2001:db8::1]:80`, `2001:db8::1`.
fn parse_node(node: &str) -> Option<IpAddr> {
    if let Ok(ip) = node.parse() {
        return Some(ip);
    }
    if let Ok(addr) = node.parse::<SocketAddr>() {
        return Some(addr.ip());
    }
    node.strip_prefix('[').and_then(|n| n.split(']').next()).and_then(|n| n.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(headers: &[(&str, &str)], peer: &str) -> Parts {
        let mut b = http::Request::builder();
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        let (mut parts, ()) = b.body(()).unwrap().into_parts();
        parts.extensions.insert(peer.parse::<SocketAddr>().unwrap());
        parts
    }

    #[test]
    fn networks_contain_their_addresses() {
        let t = TrustedProxies::parse(["10.0.0.0/8", "192.168.1.7", "fd00::/8"]).unwrap();
        assert!(t.contains("10.200.3.4".parse().unwrap()));
        assert!(!t.contains("11.0.0.1".parse().unwrap()));
        assert!(t.contains("192.168.1.7".parse().unwrap()));
        assert!(!t.contains("192.168.1.8".parse().unwrap()));
        assert!(t.contains("fd12::1".parse().unwrap()));
        assert!(TrustedProxies::parse(["0.0.0.0/0"]).unwrap().contains("8.8.8.8".parse().unwrap()));
        assert_eq!(
            TrustedProxies::parse(["10.0.0.0/33"]).unwrap_err(),
            "not an IP network: \"10.0.0.0/33\""
        );
        assert!(TrustedProxies::parse(["proxy.local"]).is_err());
    }

    #[test]
    fn peer_ip_ignores_forwarding_headers_unless_trusted() {
        let p = parts(&[("x-forwarded-for", "6.6.6.6")], "203.0.113.9:4000");
        assert_eq!(Key::peer_ip().of(&p).unwrap().as_deref(), Some("203.0.113.9"));
        let behind = Key::peer_ip_behind(TrustedProxies::parse(["10.0.0.0/8"]).unwrap());
        // The peer is not a trusted proxy: the header is the client's word, ignored.
        assert_eq!(behind.of(&p).unwrap().as_deref(), Some("203.0.113.9"));
    }

    #[test]
    fn trusted_proxies_yield_the_rightmost_untrusted_address() {
        let behind = Key::peer_ip_behind(TrustedProxies::parse(["10.0.0.0/8"]).unwrap());
        // The client forged 6.6.6.6; our proxy 10.0.0.2 received from 198.51.100.4.
        let p = parts(&[("x-forwarded-for", "6.6.6.6, 198.51.100.4, 10.0.0.2")], "10.0.0.1:80");
        assert_eq!(behind.of(&p).unwrap().as_deref(), Some("198.51.100.4"));
        let p = parts(
            &[("forwarded", "for=6.6.6.6, for=\"[2001:db8::7]:443\";proto=https")],
            "10.0.0.1:80",
        );
        assert_eq!(behind.of(&p).unwrap().as_deref(), Some("2001:db8::/56"));
        // Forwarded wins over X-Forwarded-For.
        let p = parts(
            &[("forwarded", "for=198.51.100.9"), ("x-forwarded-for", "198.51.100.4")],
            "10.0.0.1:80",
        );
        assert_eq!(behind.of(&p).unwrap().as_deref(), Some("198.51.100.9"));
        // Only trusted hops: the left-most of them.
        let p = parts(&[("x-forwarded-for", "10.0.0.3")], "10.0.0.1:80");
        assert_eq!(behind.of(&p).unwrap().as_deref(), Some("10.0.0.3"));
        // An unparseable hop stops the walk: the peer's own side is used.
        let p = parts(&[("x-forwarded-for", "198.51.100.4, unknown")], "10.0.0.1:80");
        assert_eq!(behind.of(&p).unwrap().as_deref(), Some("10.0.0.1"));
    }

    /// One host owns a /64 at least: 20 addresses of one /64 are one key, by default a /56;
    /// IPv4-mapped addresses are their IPv4 address (issue 57, item 4).
    #[test]
    fn ipv6_clients_are_keyed_by_their_subnet() {
        let key = |k: &Key, peer: &str| k.of(&parts(&[], peer)).unwrap().unwrap().into_owned();
        let ip = Key::peer_ip();
        let keys: std::collections::HashSet<String> =
            (1..=20).map(|i| key(&ip, &format!("[2001:db8:abcd:12ff::{i:x}]:4000"))).collect();
        assert_eq!(keys.into_iter().collect::<Vec<_>>(), ["2001:db8:abcd:1200::/56"]);
        assert_ne!(key(&ip, "[2001:db8:abcd:1300::1]:1"), key(&ip, "[2001:db8:abcd:1200::1]:1"));
        assert_eq!(key(&ip, "[::ffff:192.0.2.1]:80"), "192.0.2.1");
        assert_eq!(key(&ip, "192.0.2.1:80"), "192.0.2.1");
        let per_64 = Key::peer_ip().ipv6_subnet(64);
        assert_eq!(key(&per_64, "[2001:db8:abcd:12ff::7]:1"), "2001:db8:abcd:12ff::/64");
        let whole = Key::peer_ip().ipv6_subnet(128);
        assert_eq!(key(&whole, "[2001:DB8:0:0:1:0:0:1]:1"), "2001:db8::1:0:0:1");
        assert_eq!(key(&Key::peer_ip().ipv6_subnet(1), "[8001::1]:1"), "8000::/1");
        // Behind a proxy on `[::]`, which sees the IPv4 proxy as a mapped address.
        let behind = Key::peer_ip_behind(TrustedProxies::parse(["10.0.0.0/8"]).unwrap());
        let p = parts(&[("x-forwarded-for", "2001:db8:1:2:3::9")], "[::ffff:10.0.0.1]:80");
        assert_eq!(behind.of(&p).unwrap().as_deref(), Some("2001:db8:1::/56"));
    }

    #[test]
    #[should_panic(expected = "give 1 to 128 bits")]
    fn an_ipv6_subnet_out_of_range_is_refused() {
        let _ = Key::peer_ip().ipv6_subnet(0);
    }

    #[test]
    #[should_panic(expected = "applies to Key::peer_ip()")]
    fn an_ipv6_subnet_is_for_ip_keys_only() {
        let _ = Key::header("x-api-key").ipv6_subnet(64);
    }

    #[test]
    fn missing_keys_say_why() {
        let (parts, ()) = http::Request::new(()).into_parts();
        assert_eq!(
            Key::peer_ip().of(&parts),
            Err(Missing("no peer address in the request's extensions"))
        );
        assert_eq!(Key::header("x-api-key").of(&parts), Err(Missing("the key header is missing")));
        assert_eq!(Key::global().of(&parts), Ok(None));
        let (parts, ()) =
            http::Request::builder().header("x-api-key", "k1").body(()).unwrap().into_parts();
        assert!(matches!(Key::header("x-api-key").of(&parts), Ok(Some(Cow::Borrowed("k1")))));
    }
}

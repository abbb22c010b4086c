//! What web pages may ask of the server. Any page a user opens can send requests to a
//! server their browser reaches, loopback included: a `text/plain` POST needs no CORS
//! preflight, so without a check a page of another site could take and reset limits. And
//! through DNS rebinding (a name of the attacker's that now resolves to 127.0.0.1) a page can
//! read the answers too, its requests carrying the attacker's name in `Host`.
//!
//! So: a request whose `Origin` is neither the server's own (the `Host` it was sent to) nor
//! one of `[server] corsOrigins` is refused with 403, and an allowed cross-origin request
//! gets the CORS header fields (a preflight is answered here). A server without tokens also
//! answers only `Host` values that name it: loopback (`localhost`, 127.0.0.0/8, `[::1]`),
//! the address it listens on (any IP address when that is 0.0.0.0 or `[::]`), or one of
//! `[server] allowedHosts`. Clients that are not browsers (curl, the CLI, the clients of
//! other languages) send no `Origin`, and a `Host` of the address they connect to: they
//! are served as before.

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, header};
use axum::response::IntoResponse;

use crate::answer::{Answer, close_if_unread};

/// The checks, made once from the settings.
#[derive(Clone, Debug, Default)]
pub struct BrowserRules {
    /// Origins allowed cross-origin (lower case, as browsers send them).
    cors_origins: Vec<String>,
    /// `corsOrigins = ["*"]`: every origin.
    any_origin: bool,
    /// Without tokens: the names and addresses `Host` may give (none: any).
    hosts: Option<Hosts>,
}

#[derive(Clone, Debug)]
struct Hosts {
    /// The address the server listens on.
    listen: IpAddr,
    /// The `Host` of a client that connects to that address: `127.0.0.1:8787` (most clients'
    /// requests, allowed without parsing anything).
    listen_host: String,
    /// `allowedHosts`, lower case.
    names: Vec<String>,
}

impl BrowserRules {
    /// The rules of a server listening on `listen`, with or without `tokens`, allowing
    /// `cors_origins` (`*`: any) and, without tokens, the host names `allowed_hosts`.
    pub fn new(
        tokens: bool,
        listen: SocketAddr,
        cors_origins: &[String],
        allowed_hosts: &[String],
    ) -> Self {
        let hosts = (!tokens).then(|| Hosts {
            listen: listen.ip(),
            listen_host: listen.to_string(),
            names: allowed_hosts.iter().map(|h| h.to_ascii_lowercase()).collect(),
        });
        BrowserRules {
            cors_origins: cors_origins.iter().map(|o| o.to_ascii_lowercase()).collect(),
            any_origin: cors_origins.iter().any(|o| o == "*"),
            hosts,
        }
    }

    /// Why a request with these headers is refused, if it is; and whether it is a
    /// cross-origin request to answer with CORS fields.
    fn judge(&self, headers: &HeaderMap) -> Result<Option<HeaderValue>, String> {
        let host = headers.get(header::HOST);
        if let (Some(hosts), Some(host)) = (&self.hosts, host)
            && host.as_bytes() != hosts.listen_host.as_bytes()
            && !hosts.allow(host.to_str().unwrap_or(""))
        {
            let host = String::from_utf8_lossy(host.as_bytes());
            return Err(format!(
                "Host {host} does not name this server: a server without tokens answers only \
                 loopback names, its listen address, and [server] allowedHosts (this keeps web \
                 pages out through DNS rebinding)"
            ));
        }
        let Some(origin) = headers.get(header::ORIGIN) else { return Ok(None) };
        let text = origin.to_str().unwrap_or("").to_ascii_lowercase();
        let own = host.and_then(|h| h.to_str().ok()).is_some_and(|host| {
            ["http://", "https://"].iter().any(|scheme| {
                text.strip_prefix(scheme).is_some_and(|h| h.eq_ignore_ascii_case(host))
            })
        });
        if own {
            return Ok(None);
        }
        if self.any_origin || self.cors_origins.contains(&text) {
            return Ok(Some(origin.clone()));
        }
        Err(format!(
            "requests from web pages of {} are refused: add the origin to [server] corsOrigins \
             to allow it",
            origin.to_str().unwrap_or("another origin")
        ))
    }
}

impl Hosts {
    fn allow(&self, host: &str) -> bool {
        let name = host_name(host);
        if let Ok(ip) = name.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>() {
            return ip.is_loopback() || ip == self.listen || self.listen.is_unspecified();
        }
        let name = name.to_ascii_lowercase();
        name == "localhost" || name.ends_with(".localhost") || self.names.contains(&name)
    }
}

/// `Host` without its port: `127.0.0.1`, `[::1]`, `localhost`.
fn host_name(host: &str) -> &str {
    match host.rfind(':') {
        Some(colon)
            if !host[colon..].contains(']')
                && host[colon + 1..].bytes().all(|b| b.is_ascii_digit()) =>
        {
            &host[..colon]
        }
        _ => host,
    }
}

/// The checks as a layer over the whole router. (Around the router, not inside it with
/// `Router::layer`, which wraps and boxes every route once more: 2 to 4% of a request's
/// time, measured.)
#[derive(Clone)]
pub struct GuardLayer(pub SharedRules);

/// The rules served now: a reload of the config swaps them whole.
pub type SharedRules = std::sync::Arc<arc_swap::ArcSwap<BrowserRules>>;

impl BrowserRules {
    /// These rules, to be swapped by a reload.
    pub fn shared(self) -> SharedRules {
        std::sync::Arc::new(arc_swap::ArcSwap::from_pointee(self))
    }
}

impl<S> tower_layer::Layer<S> for GuardLayer {
    type Service = Guard<S>;

    fn layer(&self, inner: S) -> Guard<S> {
        Guard { inner, rules: std::sync::Arc::clone(&self.0) }
    }
}

/// The checks in front of a service.
#[derive(Clone)]
pub struct Guard<S> {
    inner: S,
    rules: SharedRules,
}

/// The CORS fields of an answer to an allowed origin.
fn cors(headers: &mut HeaderMap, origin: HeaderValue) {
    headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    headers.insert(
        header::ACCESS_CONTROL_EXPOSE_HEADERS,
        HeaderValue::from_static(
            "RateLimit, RateLimit-Policy, Retry-After, Tollgate-Config-Version",
        ),
    );
    headers.append(header::VARY, HeaderValue::from_static("Origin"));
}

impl<S, B> tower_service::Service<Request<B>> for Guard<S>
where
    S: tower_service::Service<Request<B>, Response = Response<Body>>,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = GuardFuture<S::Future, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        match self.rules.load().judge(request.headers()) {
            Ok(None) => GuardFuture::inner(self.inner.call(request), None),
            Err(message) => {
                let mut refusal = Answer::error(StatusCode::FORBIDDEN, message).into_response();
                close_if_unread(&mut refusal, request.headers());
                GuardFuture::answered(refusal)
            }
            Ok(Some(origin)) if request.method() == Method::OPTIONS => {
                // A preflight: what a page of this origin may send.
                let mut answer = StatusCode::NO_CONTENT.into_response();
                let headers = answer.headers_mut();
                cors(headers, origin);
                headers.insert(
                    header::ACCESS_CONTROL_ALLOW_METHODS,
                    HeaderValue::from_static("GET, POST"),
                );
                headers.insert(
                    header::ACCESS_CONTROL_ALLOW_HEADERS,
                    HeaderValue::from_static("authorization, content-type"),
                );
                headers.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
                GuardFuture::answered(answer)
            }
            Ok(Some(origin)) => GuardFuture::inner(self.inner.call(request), Some(origin)),
        }
    }
}

pin_project_lite::pin_project! {
    /// The inner service's answer (to most requests, untouched), or the guard's own.
    pub struct GuardFuture<F, E> {
        #[pin]
        inner: Option<F>,
        // The guard's own answer, until it is taken.
        answer: Option<Result<Response<Body>, E>>,
        // The origin to answer with CORS fields.
        cors: Option<HeaderValue>,
    }
}

impl<F, E> GuardFuture<F, E> {
    fn inner(inner: F, cors: Option<HeaderValue>) -> Self {
        GuardFuture { inner: Some(inner), answer: None, cors }
    }

    fn answered(answer: Response<Body>) -> Self {
        GuardFuture { inner: None, answer: Some(Ok(answer)), cors: None }
    }
}

impl<F, E> Future for GuardFuture<F, E>
where
    F: Future<Output = Result<Response<Body>, E>>,
{
    type Output = Result<Response<Body>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Some(answer) = this.answer.take() {
            return Poll::Ready(answer);
        }
        let Some(inner) = this.inner.as_pin_mut() else { panic!("polled after it was done") };
        let mut answer = std::task::ready!(inner.poll(cx));
        if let (Ok(answer), Some(origin)) = (&mut answer, this.cors.take()) {
            cors(answer.headers_mut(), origin);
        }
        Poll::Ready(answer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn judge(
        rules: &BrowserRules,
        host: Option<&str>,
        origin: Option<&str>,
    ) -> Result<bool, String> {
        let mut headers = HeaderMap::new();
        if let Some(host) = host {
            headers.insert(header::HOST, host.parse().unwrap());
        }
        if let Some(origin) = origin {
            headers.insert(header::ORIGIN, origin.parse().unwrap());
        }
        rules.judge(&headers).map(|cors| cors.is_some())
    }

    #[test]
    fn hosts_that_name_the_server() {
        let loopback = BrowserRules::new(
            false,
            "127.0.0.1:8787".parse().unwrap(),
            &[],
            &["tollgate.internal".into()],
        );
        for host in [
            "127.0.0.1:8787",
            "127.0.0.2:8787",
            "localhost:8787",
            "LOCALHOST",
            "app.localhost:8787",
            "[::1]:8787",
            "tollgate.internal:8787",
        ] {
            assert_eq!(judge(&loopback, Some(host), None), Ok(false), "{host}");
        }
        for host in ["rebind.attacker.example:8787", "10.0.0.5:8787", "localhost.evil:8787"] {
            assert!(judge(&loopback, Some(host), None).is_err(), "{host}");
        }
        // No Host (HTTP/1.0): not a browser.
        assert_eq!(judge(&loopback, None, None), Ok(false));
        // Listening on every address: any address, still no foreign name.
        let public = BrowserRules::new(false, "0.0.0.0:8787".parse().unwrap(), &[], &[]);
        assert_eq!(judge(&public, Some("10.0.0.5:8787"), None), Ok(false));
        assert!(judge(&public, Some("rebind.attacker.example"), None).is_err());
        // With tokens, any Host: a page has no token to send.
        let tokens = BrowserRules::new(true, "127.0.0.1:8787".parse().unwrap(), &[], &[]);
        assert_eq!(judge(&tokens, Some("rebind.attacker.example"), None), Ok(false));
    }

    #[test]
    fn origins_of_the_server_and_of_cors_origins() {
        let rules = BrowserRules::new(
            true,
            "127.0.0.1:8787".parse().unwrap(),
            &["https://App.example".into()],
            &[],
        );
        let host = Some("127.0.0.1:8787");
        assert_eq!(judge(&rules, host, Some("http://127.0.0.1:8787")), Ok(false));
        assert_eq!(judge(&rules, host, Some("https://app.example")), Ok(true));
        for origin in
            ["http://evil.example", "null", "http://127.0.0.1:9999", "https://app.example.evil"]
        {
            let refused = judge(&rules, host, Some(origin)).unwrap_err();
            assert!(refused.contains("corsOrigins"), "{origin}: {refused}");
        }
        let any = BrowserRules::new(true, "127.0.0.1:8787".parse().unwrap(), &["*".into()], &[]);
        assert_eq!(judge(&any, host, Some("http://evil.example")), Ok(true));
    }
}

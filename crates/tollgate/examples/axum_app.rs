//! An axum app with a per-user limit on one route, a global limit on another, and a limit
//! taken by a handler itself (with a count known only there), on the memory store or, given a
//! URL, on Redis or PostgreSQL.
//!
//! ```sh
//! cargo run -p tollgate --features axum,redis,postgres --example axum_app              # memory
//! STORE=redis://127.0.0.1:6379 cargo run -p tollgate --features axum,redis,postgres --example axum_app
//! curl -i -X POST -H 'authorization: Bearer alice' http://127.0.0.1:3000/messages   # 3 quick ones pass
//! curl -i http://127.0.0.1:3000/signup                                              # 5 a minute, for everyone
//! curl -i -X POST -H 'authorization: Bearer alice' -d 'some bytes' http://127.0.0.1:3000/upload
//! ```

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Extension;
use axum::Router;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use tollgate::store::{PgStore, RedisStore};
use tollgate::tower::{Key, LimitSpec, RateLimitLayer};
use tollgate::{AsyncStore, Config, Limits, MINUTE, MemoryStore, RateLimiter, Request as Take};

/// The limiter over the store picked at start.
type Limiter = Arc<RateLimiter<Arc<dyn AsyncStore>>>;

#[derive(Clone, Copy)]
enum Limit {
    /// Per user: 10 a minute, bursts of 3.
    SendMessage,
    /// For everyone together: 5 a minute.
    SignUp,
    /// Per user: 1 MB a minute of uploads.
    UploadBytes,
}

impl Limits for Limit {
    fn name(self) -> &'static str {
        match self {
            Limit::SendMessage => "sendMessage",
            Limit::SignUp => "signUp",
            Limit::UploadBytes => "uploadBytes",
        }
    }
    fn config(self) -> Config {
        match self {
            Limit::SendMessage => const { Config::token_bucket(10.0, MINUTE).with_capacity(3.0) },
            Limit::SignUp => const { Config::fixed_window(5.0, MINUTE) },
            Limit::UploadBytes => const { Config::token_bucket(1_000_000.0, MINUTE) },
        }
    }
}

/// The authenticated user, as an auth middleware would put it in the request's extensions.
#[derive(Clone)]
struct User(String);

/// A stand-in for real authentication: `Authorization: Bearer <user>`.
async fn authenticate(mut request: Request, next: Next) -> Response {
    let user = request
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|u| User(u.to_owned()));
    match user {
        Some(user) => {
            request.extensions_mut().insert(user);
            next.run(request).await
        }
        None => (StatusCode::UNAUTHORIZED, "send Authorization: Bearer <user>\n").into_response(),
    }
}

async fn send_message() -> &'static str {
    "sent\n"
}

async fn sign_up() -> &'static str {
    "welcome\n"
}

/// A limit taken in the handler, whose count (the body's size) only it knows: awaited, so
/// the runtime's thread goes on with other requests while Redis or PostgreSQL answers.
async fn upload(
    State(limiter): State<Limiter>,
    Extension(user): Extension<User>,
    body: String,
) -> Response {
    let take = Take::new().key(&user.0).count(body.len() as f64);
    match limiter.limit_async(Limit::UploadBytes, take).await {
        Ok(d) if d.ok => format!("stored {} bytes\n", body.len()).into_response(),
        Ok(d) => {
            let wait = d.retry_after.unwrap_or(0.0);
            (StatusCode::TOO_MANY_REQUESTS, format!("retry in {wait:.0} ms\n")).into_response()
        }
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, format!("{e}\n")).into_response(),
    }
}

/// The store of `STORE`: `memory` (the default), `redis://...` or `postgres://...`.
async fn store() -> Result<Arc<dyn AsyncStore>, tollgate::StoreError> {
    let url = std::env::var("STORE").unwrap_or_else(|_| "memory".into());
    Ok(if url.starts_with("redis") {
        Arc::new(RedisStore::open(&url)?)
    } else if url.starts_with("postgres") {
        Arc::new(PgStore::open(&url).await?)
    } else {
        Arc::new(MemoryStore::new())
    })
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let limiter: Limiter = Arc::new(RateLimiter::new(store().await?));
    let per_user = LimitSpec::limit(Limit::SendMessage).key(Key::extension(|u: &User| u.0.clone()));
    let app = Router::new()
        // Layers run outside-in: authenticate first, then limit by the user it found.
        .route(
            "/messages",
            post(send_message)
                .layer(RateLimitLayer::new(Arc::clone(&limiter), per_user))
                .layer(middleware::from_fn(authenticate)),
        )
        .route(
            "/signup",
            get(sign_up)
                .layer(RateLimitLayer::new(Arc::clone(&limiter), LimitSpec::limit(Limit::SignUp))),
        )
        .route("/upload", post(upload).layer(middleware::from_fn(authenticate)))
        .with_state(limiter);
    let port = std::env::var("PORT").unwrap_or_else(|_| "3000".into());
    let listener = tokio::net::TcpListener::bind(format!("127.0.0.1:{port}")).await?;
    let addr = listener.local_addr()?;
    println!("listening on http://{addr}");
    println!("  curl -i -X POST -H 'authorization: Bearer alice' http://{addr}/messages");
    println!("  curl -i http://{addr}/signup");
    println!(
        "  curl -i -X POST -H 'authorization: Bearer alice' -d 'some bytes' http://{addr}/upload"
    );
    axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await?;
    Ok(())
}

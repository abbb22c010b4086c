//! An axum app with a per-user limit on one route and a global limit on another.
//!
//! ```sh
//! cargo run -p tollgate --features axum --example axum_app
//! curl -i -X POST -H 'authorization: Bearer alice' http://127.0.0.1:3000/messages   # 3 quick ones pass
//! curl -i http://127.0.0.1:3000/signup                                              # 5 a minute, for everyone
//! ```

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use tollgate::tower::{Key, LimitSpec, RateLimitLayer};
use tollgate::{Config, Limits, MINUTE, MemoryStore, RateLimiter};

#[derive(Clone, Copy)]
enum Limit {
    /// Per user: 10 a minute, bursts of 3.
    SendMessage,
    /// For everyone together: 5 a minute.
    SignUp,
}

impl Limits for Limit {
    fn name(self) -> &'static str {
        match self {
            Limit::SendMessage => "sendMessage",
            Limit::SignUp => "signUp",
        }
    }
    fn config(self) -> Config {
        match self {
            Limit::SendMessage => const { Config::token_bucket(10.0, MINUTE).with_capacity(3.0) },
            Limit::SignUp => const { Config::fixed_window(5.0, MINUTE) },
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

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let limiter = Arc::new(RateLimiter::new(MemoryStore::new()));
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
            get(sign_up).layer(RateLimitLayer::new(limiter, LimitSpec::limit(Limit::SignUp))),
        );
    let port = std::env::var("PORT").unwrap_or_else(|_| "3000".into());
    let listener = tokio::net::TcpListener::bind(format!("127.0.0.1:{port}")).await?;
    let addr = listener.local_addr()?;
    println!("listening on http://{addr}");
    println!("  curl -i -X POST -H 'authorization: Bearer alice' http://{addr}/messages");
    println!("  curl -i http://{addr}/signup");
    axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await
}

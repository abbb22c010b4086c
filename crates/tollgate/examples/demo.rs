//! tollgate in action: per-user limits with bursts, reservations, a transaction of two
//! limits, and a refusal as an error. Runs in about two seconds.
//!
//! `cargo run -p tollgate --example demo`

use std::thread::sleep;
use std::time::Duration;

use tollgate::{Call, Config, Error, Limits, MINUTE, MemoryStore, RateLimiter, Request, SECOND};

/// The limits of a small chat app, declared once: a misspelled name does not compile.
#[derive(Clone, Copy)]
enum Limit {
    /// Two messages a second per user, bursts of up to four.
    SendMessage,
    /// 40,000 LLM tokens a minute for the whole app.
    LlmTokens,
    /// 100 sign-ups a minute for the whole app.
    SignUp,
}

impl Limits for Limit {
    fn name(self) -> &'static str {
        match self {
            Limit::SendMessage => "sendMessage",
            Limit::LlmTokens => "llmTokens",
            Limit::SignUp => "signUp",
        }
    }
    fn config(self) -> Config {
        match self {
            Limit::SendMessage => const { Config::token_bucket(2.0, SECOND).with_capacity(4.0) },
            Limit::LlmTokens => const { Config::token_bucket(40_000.0, MINUTE) },
            Limit::SignUp => const { Config::fixed_window(100.0, MINUTE) },
        }
    }
}

fn show(what: &str, decision: tollgate::Decision) {
    match (decision.ok, decision.retry_after) {
        (true, None) => println!("  {what}: ok"),
        (true, Some(wait)) => println!("  {what}: ok, reserved: do the work in {wait:.0} ms"),
        (false, Some(wait)) => println!("  {what}: refused, retry in {wait:.0} ms"),
        (false, None) => println!("  {what}: refused"),
    }
}

fn main() -> Result<(), Error> {
    let limiter = RateLimiter::new(MemoryStore::new());

    println!("alice sends six messages at once (2/s, bursts of 4):");
    for i in 1..=6 {
        show(&format!("message {i}"), limiter.limit(Limit::SendMessage, "alice")?);
    }
    println!("bob is limited on his own:");
    show("bob's message", limiter.limit(Limit::SendMessage, "bob")?);

    println!("half a second later one token has flowed back to alice:");
    sleep(Duration::from_millis(500));
    show("message 7", limiter.limit(Limit::SendMessage, "alice")?);
    show("message 8", limiter.limit(Limit::SendMessage, "alice")?);

    println!("a 30,000-token LLM call, then another that books tokens ahead:");
    let llm = |tokens: f64| Request::new().count(tokens).reserve();
    show("call 1", limiter.limit(Limit::LlmTokens, llm(30_000.0))?);
    show("call 2", limiter.limit(Limit::LlmTokens, llm(30_000.0))?);

    println!("a sign-up takes two limits at once, all or nothing:");
    let both = limiter.transaction(&[
        Call::new(Limit::SignUp, Request::new()),
        Call::new(Limit::SendMessage, "carol"),
    ])?;
    println!("  ok: {}, results: {:?}", both.ok, both.results);

    println!("with throws, a refusal is an error you can `?`:");
    for _ in 0..4 {
        limiter.limit(Limit::SendMessage, "dave")?;
    }
    match limiter.limit(Limit::SendMessage, Request::new().key("dave").throws()) {
        Err(err @ Error::RateLimited { .. }) => println!("  {err}"),
        other => println!("  unexpected: {other:?}"),
    }
    Ok(())
}

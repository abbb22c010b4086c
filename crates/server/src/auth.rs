//! The bearer check, one for every listener (the HTTP API, the rate limit service, and the
//! Redis protocol's when it comes): the server's tokens, what a request's credentials say of
//! its caller, and what a read token may call.

/// What a read token may call: what a web page needs to show a limit, and nothing that
/// takes, resets or lists more.
pub const READ_PATHS: [&str; 4] = ["/v1/value", "/v1/check", "/v1/time", "/v1/config"];

/// The server's bearer tokens: those that may do anything, and those that may only read
/// ([`READ_PATHS`]).
#[derive(Clone, Debug, Default)]
pub struct Tokens {
    /// `[server] tokens`: every operation.
    pub full: Vec<String>,
    /// `[server] readTokens`: [`READ_PATHS`] only.
    pub read: Vec<String>,
}

impl Tokens {
    /// Whether the server asks for a token at all (it does when it has any).
    pub fn required(&self) -> bool {
        !self.full.is_empty()
    }
}

/// What a request's `Authorization` values (each as text, if it is) say of its caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Credential {
    /// None was sent.
    Missing,
    /// More than one was sent.
    Several,
    /// Not a Bearer token (another scheme, or not text).
    NotBearer,
    /// A Bearer token that is none of the server's.
    Wrong,
    /// One of the server's read tokens.
    Read,
    /// One of the server's (full) tokens.
    Good,
}

/// What `values` (a request's `Authorization` values, or a gRPC call's `authorization`
/// metadata) say, against `tokens`: the one check of the HTTP API and the rate limit service.
pub fn credential<'v>(
    tokens: &Tokens,
    mut values: impl Iterator<Item = Option<&'v str>>,
) -> Credential {
    let (value, more) = (values.next(), values.next());
    match (value, more) {
        (None, _) => Credential::Missing,
        (Some(_), Some(_)) => Credential::Several,
        (Some(value), None) => match value.and_then(bearer) {
            None => Credential::NotBearer,
            Some(token) if known_token(&tokens.full, token) => Credential::Good,
            Some(token) if known_token(&tokens.read, token) => Credential::Read,
            Some(_) => Credential::Wrong,
        },
    }
}

/// The token of an `Authorization` value of the Bearer scheme, whose name is
/// case-insensitive (RFC 9110 §11.1): `bearer` works too.
pub fn bearer(authorization: &str) -> Option<&str> {
    authorization
        .split_once(' ')
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim_start())
}

/// Whether `presented` is one of `tokens`, compared in constant time.
pub fn known_token(tokens: &[String], presented: &str) -> bool {
    tokens.iter().any(|t| same(t.as_bytes(), presented.as_bytes()))
}

/// Compares without stopping at the first difference, so timing does not reveal a token.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

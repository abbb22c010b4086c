//! What a layer decided about a request, for the handler behind it and for a custom refusal.

use std::sync::Arc;

use crate::Config;

/// What a [`RateLimitLayer`](super::RateLimitLayer) decided about a request: in the
/// request's extensions for the handler with [`insert_info`](super::RateLimitLayer::insert_info),
/// and given to a custom refusal ([`on_refused`](super::RateLimitLayer::on_refused)).
///
/// A request has none when the layer did not decide it: [skipped](super::RateLimitLayer::skip),
/// passed because its key was missing ([`MissingKey::Skip`](super::MissingKey::Skip)), or
/// passed because the store failed and the limit or layer fails open (no numbers are known
/// then). In axum, take it as `Option<Extension<RateLimitInfo>>`, since a plain
/// `Extension<RateLimitInfo>` answers 500 when it is absent.
///
/// # Examples
///
/// ```
/// use axum::Extension;
/// use tollgate::tower::RateLimitInfo;
///
/// async fn handler(info: Option<Extension<RateLimitInfo>>) -> String {
///     match info {
///         Some(Extension(info)) => format!("{} left", info.limits[0].remaining),
///         None => "not limited".to_owned(),
///     }
/// }
/// # let _ = handler;
/// ```
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct RateLimitInfo {
    /// Whether the request was admitted (always true in a handler's extensions).
    pub ok: bool,
    /// When refused: milliseconds until a retry can succeed (the longest wait of the limits
    /// that refused, as in `Retry-After`, but exact).
    pub retry_after: Option<f64>,
    /// Each limit the request took from, in the layer's order (a limit whose key was missing
    /// and [skipped](super::MissingKey::Skip) is left out).
    pub limits: Vec<LimitInfo>,
    /// Which of `limits` refused, if refused.
    pub(super) refused: Option<usize>,
}

impl RateLimitInfo {
    /// The limit that refused the request (of several, the one with the longest wait).
    pub fn refused_by(&self) -> Option<&LimitInfo> {
        self.refused.and_then(|i| self.limits.get(i))
    }
}

/// One limit's numbers after a request, as the RateLimit header fields give them, unrounded.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct LimitInfo {
    /// The limit's name.
    pub name: Arc<str>,
    /// The limit's policy: its kind, rate, period and capacity.
    pub config: Config,
    /// The most tokens it holds: what `remaining` is again when it is full
    /// (`X-RateLimit-Limit`).
    pub limit: f64,
    /// Tokens left now (never negative).
    pub remaining: f64,
    /// Milliseconds until it is full again; 0 when it is full.
    pub reset_after: f64,
}

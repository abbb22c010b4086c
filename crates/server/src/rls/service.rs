//! `envoy.service.ratelimit.v3.RateLimitService` over gRPC (tonic), with the standard gRPC
//! health service beside it.

use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus as PbStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use tonic::{Request, Response, Status};

use super::{Descriptor, Rls, RlsAnswer, RlsError, RlsRequest, Unit};
use crate::http::ErrorLog;

/// The largest `ShouldRateLimit` request accepted, in bytes: the HTTP API's body limit.
/// Envoy's requests are a few hundred bytes; tonic's own default, 4 MiB, would let one call
/// carry some 250,000 descriptors, all taken in one transaction (on Redis, one script that
/// every other client waits for). A larger request is refused with `OUT_OF_RANGE` as soon as
/// its length prefix is read, and takes nothing.
pub const MAX_REQUEST: usize = crate::engine::MAX_BODY;

/// The gRPC service: [`Rls`], the bearer tokens it asks for (none: open), and the log of
/// failed calls it shares with the HTTP side.
pub struct Service {
    rls: Arc<Rls>,
    tokens: Vec<String>,
    errors: Arc<ErrorLog>,
}

impl Service {
    /// The service answering from `rls`; with `tokens`, a call must carry
    /// `authorization: Bearer <token>` metadata. Calls the store failed go to `errors`
    /// (summed up, not a line each).
    pub fn new(rls: Arc<Rls>, tokens: Vec<String>, errors: Arc<ErrorLog>) -> Self {
        Service { rls, tokens, errors }
    }
}

/// A request in the service's own terms.
///
/// # Errors
///
/// A descriptor `limit` with an unknown unit.
pub fn from_proto(request: RateLimitRequest) -> Result<RlsRequest, RlsError> {
    let mut descriptors = Vec::with_capacity(request.descriptors.len());
    for (i, d) in request.descriptors.into_iter().enumerate() {
        let limit = match d.limit {
            None => None,
            Some(o) => match Unit::from_limit_unit_number(o.unit) {
                Some(unit) => Some((o.requests_per_unit, unit)),
                None => {
                    return Err(RlsError::Invalid(format!(
                        "descriptors[{i}].limit.unit: {} is not a unit (1 second .. 6 year)",
                        o.unit
                    )));
                }
            },
        };
        descriptors.push(Descriptor {
            entries: d.entries.into_iter().map(|e| (e.key, e.value)).collect(),
            limit,
            hits_addend: d.hits_addend.map(|h| h.value),
        });
    }
    Ok(RlsRequest { domain: request.domain, descriptors, hits_addend: request.hits_addend })
}

/// The answer in the API's message.
pub fn to_proto(answer: RlsAnswer) -> RateLimitResponse {
    let code = |over: bool| if over { Code::OverLimit as i32 } else { Code::Ok as i32 };
    RateLimitResponse {
        overall_code: code(answer.over_limit),
        statuses: answer
            .statuses
            .into_iter()
            .map(|s| PbStatus {
                code: code(s.over_limit),
                current_limit: s.current_limit.map(|(name, requests_per_unit, unit)| RateLimit {
                    name,
                    requests_per_unit,
                    unit: unit.response_number(),
                }),
                limit_remaining: s.limit_remaining,
                duration_until_reset: s.duration_until_reset.map(duration),
                ..PbStatus::default()
            })
            .collect(),
        response_headers_to_add: answer
            .headers
            .into_iter()
            .map(|(key, value)| HeaderValue { key, value, ..HeaderValue::default() })
            .collect(),
        ..RateLimitResponse::default()
    }
}

/// Milliseconds as a protobuf duration, rounded up to whole milliseconds.
pub fn duration(ms: f64) -> PbDuration {
    let ms = ms.max(0.0).ceil();
    let seconds = (ms / 1_000.0).floor();
    PbDuration { seconds: seconds as i64, nanos: ((ms - seconds * 1_000.0) * 1_000_000.0) as i32 }
}

#[tonic::async_trait]
impl RateLimitService for Service {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        if !self.tokens.is_empty() {
            let token = request
                .metadata()
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .and_then(crate::http::bearer);
            if !token.is_some_and(|t| crate::http::known_token(&self.tokens, t)) {
                return Err(Status::unauthenticated("missing or wrong bearer token"));
            }
        }
        let request = from_proto(request.into_inner()).map_err(status)?;
        match self.rls.should_rate_limit(&request).await {
            Ok(answer) => Ok(Response::new(to_proto(answer))),
            Err(e) => {
                if let RlsError::Store(_) = &e {
                    self.errors.record(
                        "rls",
                        axum::http::StatusCode::SERVICE_UNAVAILABLE,
                        &e.to_string(),
                    );
                }
                Err(status(e))
            }
        }
    }
}

fn status(e: RlsError) -> Status {
    match e {
        RlsError::Invalid(message) => Status::invalid_argument(message),
        e @ RlsError::Store(_) => Status::unavailable(e.to_string()),
    }
}

/// Serves the rate limit service and gRPC health on `listener` until `stop` resolves; then
/// calls in flight get `deadline` to finish.
///
/// # Errors
///
/// The listener fails.
pub async fn serve(
    listener: tokio::net::TcpListener,
    service: Service,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
    deadline: Duration,
) -> anyhow::Result<()> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_serving::<RateLimitServiceServer<Service>>().await;
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let (stopped_tx, stopped_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tonic::transport::Server::builder()
        .add_service(health)
        .add_service(RateLimitServiceServer::new(service).max_decoding_message_size(MAX_REQUEST))
        .serve_with_incoming_shutdown(incoming, async move {
            stop.await;
            let _ = stopped_tx.send(());
        });
    tokio::pin!(server);
    tokio::select! {
        result = &mut server => return Ok(result?),
        _ = stopped_rx => {}
    }
    // Stopping: the calls in flight have the deadline.
    match tokio::time::timeout(deadline, server).await {
        Ok(result) => Ok(result?),
        Err(_) => Ok(()),
    }
}

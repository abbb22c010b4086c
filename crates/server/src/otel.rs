//! Tracing with OpenTelemetry: a span per rate-limit request (its operation, limit names,
//! outcome and time in the store), exported over OTLP/HTTP when the standard `OTEL_*`
//! variables name a collector, with the caller's `traceparent` as its parent.
//!
//! When no endpoint is set (or the server is built without the `otel` feature), nothing is
//! started: no span is made, no store call is timed, no connection is ever opened. What a
//! request pays then is one relaxed load of [`on`]. When one is, spans are started on the
//! OpenTelemetry tracer itself, sampler first: a request the sampler leaves out gets a span
//! that records nothing, and nothing is measured or formatted for it.

use std::cell::RefCell;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tollgate::core::{OneTake, Outcome, Plan, Slot, State, Taken};
use tollgate::store::{AsyncStore, BoxFuture, Store};

use crate::store::DynStore;

/// Whether spans are exported: set once at start, before any request.
static ON: AtomicBool = AtomicBool::new(false);

/// Whether requests are traced (an exporter was started).
#[inline]
pub fn on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// An attribute's value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// Text.
    Text(std::borrow::Cow<'static, str>),
    /// A whole number.
    Int(i64),
    /// A number.
    Float(f64),
    /// Yes or no.
    Bool(bool),
}

impl From<&'static str> for Value {
    fn from(text: &'static str) -> Self {
        Value::Text(text.into())
    }
}
impl From<String> for Value {
    fn from(text: String) -> Self {
        Value::Text(text.into())
    }
}
impl From<i64> for Value {
    fn from(n: i64) -> Self {
        Value::Int(n)
    }
}
impl From<bool> for Value {
    fn from(b: bool) -> Self {
        Value::Bool(b)
    }
}

/// A request's span: recording when the sampler took it, otherwise (and without the `otel`
/// feature) one that keeps nothing.
pub struct Span {
    #[cfg(feature = "otel")]
    inner: Option<opentelemetry_sdk::trace::Span>,
}

impl Span {
    /// Whether what is set on it is kept (the request was sampled).
    pub fn recording(&self) -> bool {
        #[cfg(feature = "otel")]
        {
            use opentelemetry::trace::Span as _;
            self.inner.as_ref().is_some_and(|span| span.is_recording())
        }
        #[cfg(not(feature = "otel"))]
        false
    }

    /// Sets the attribute `key` (call only when [`Span::recording`], where making the value
    /// costs).
    pub fn set(&mut self, key: &'static str, value: impl Into<Value>) {
        #[cfg(feature = "otel")]
        if let Some(span) = &mut self.inner {
            use opentelemetry::trace::Span as _;
            let value = match value.into() {
                Value::Text(text) => opentelemetry::Value::from(text),
                Value::Int(n) => opentelemetry::Value::I64(n),
                Value::Float(x) => opentelemetry::Value::F64(x),
                Value::Bool(b) => opentelemetry::Value::Bool(b),
            };
            span.set_attribute(opentelemetry::KeyValue::new(key, value));
        }
        #[cfg(not(feature = "otel"))]
        let _ = (key, value);
    }

    /// Marks the request as failed (a 5xx, the store down).
    pub fn failed(&mut self) {
        #[cfg(feature = "otel")]
        if let Some(span) = &mut self.inner {
            use opentelemetry::trace::Span as _;
            span.set_status(opentelemetry::trace::Status::error(""));
        }
    }
}

/// What the request being traced carries through its tasks: its span, and its time in the
/// store so far.
struct Request {
    span: Span,
    store: Duration,
}

tokio::task_local! {
    static REQUEST: RefCell<Option<Request>>;
}

/// A request's span (a server span named `name`: `POST /v1/limit`, or the gRPC method),
/// whose parent is the caller's span when `headers` carry a W3C `traceparent`; with
/// `tollgate.operation` set if it records.
pub fn span(name: &'static str, operation: &'static str, headers: &http::HeaderMap) -> Span {
    #[cfg(feature = "otel")]
    let mut span = Span { inner: exporting::start_span(name, headers) };
    #[cfg(not(feature = "otel"))]
    let mut span = {
        let _ = (name, headers);
        Span {}
    };
    if span.recording() {
        span.set("tollgate.operation", operation);
    }
    span
}

/// `work` under `span` (made by [`span`] when [`on`]): if it records, with its time in the
/// store in `tollgate.store_ms` and `finish` recording its outcome; the span ends when
/// `work` does. Boxed, so that a caller's future is no larger for the branch that traces:
/// the one that does not (the common one) awaits `work` as before, and costs as before (a
/// future holding both was measured at 0.94x on the memory store).
pub fn traced<'a, T: Send + 'a>(
    span: Span,
    work: impl Future<Output = T> + Send + 'a,
    finish: impl FnOnce(&mut Span, &T) + Send + 'a,
) -> std::pin::Pin<Box<dyn Future<Output = T> + Send + 'a>> {
    Box::pin(async move {
        if !span.recording() {
            // Left out by the sampler: nothing is measured or kept.
            return work.await;
        }
        let request = RefCell::new(Some(Request { span, store: Duration::ZERO }));
        let (out, request) = REQUEST
            .scope(request, async {
                let out = work.await;
                (out, REQUEST.with(|r| r.borrow_mut().take()))
            })
            .await;
        if let Some(Request { mut span, store }) = request {
            span.set("tollgate.store_ms", Value::Float(store.as_secs_f64() * 1_000.0));
            finish(&mut span, &out);
        }
        out
    })
}

/// Sets `field` on the span of the request being traced to `value()`; nothing (not even
/// `value`) when tracing is off or the request is not sampled.
pub fn note(field: &'static str, value: impl FnOnce() -> String) {
    if on() {
        let _ = REQUEST.try_with(|r| {
            if let Some(request) = r.borrow_mut().as_mut() {
                request.span.set(field, value());
            }
        });
    }
}

/// A store whose calls are timed into the traced request that makes them; the store of a
/// server that traces.
pub struct Timed(pub DynStore);

impl Timed {
    /// `store`, timed when tracing is on; as it is otherwise.
    pub fn wrap(store: DynStore) -> DynStore {
        if on() { Arc::new(Timed(store)) } else { store }
    }
}

/// `call`, its time added to the recording request that makes it; as it is outside one (a
/// sweep, a health check, a request not sampled), where there is nothing to add it to.
fn time<'a, T: 'a>(call: BoxFuture<'a, T>) -> BoxFuture<'a, T> {
    if !REQUEST.try_with(|r| r.borrow().is_some()).unwrap_or(false) {
        return call;
    }
    Box::pin(async move {
        let start = Instant::now();
        let out = call.await;
        let _ = REQUEST.try_with(|r| {
            if let Some(request) = r.borrow_mut().as_mut() {
                request.store += start.elapsed();
            }
        });
        out
    })
}

impl AsyncStore for Timed {
    /// The memory store answers in-process: nothing to wait for, nothing timed.
    fn immediate(&self) -> Option<&dyn Store> {
        self.0.immediate()
    }
    fn execute_async<'a>(&'a self, plan: &'a Plan<'_>) -> BoxFuture<'a, Outcome> {
        time(self.0.execute_async(plan))
    }
    fn execute_one_async<'a>(&'a self, take: &'a OneTake<'_>) -> BoxFuture<'a, Taken> {
        time(self.0.execute_one_async(take))
    }
    fn read_async<'a>(&'a self, slots: &'a [Slot<'_>]) -> BoxFuture<'a, (f64, Vec<Option<State>>)> {
        time(self.0.read_async(slots))
    }
    fn delete_async<'a>(
        &'a self,
        name: &'a str,
        key: Option<&'a str>,
        shards: u16,
    ) -> BoxFuture<'a, ()> {
        time(self.0.delete_async(name, key, shards))
    }
    fn slots_async<'a>(
        &'a self,
        name: &'a str,
        key: Option<&'a str>,
        limit: &'a tollgate::Concurrency,
        op: &'a tollgate::core::slots::SlotOp,
    ) -> BoxFuture<'a, tollgate::core::slots::SlotAnswer> {
        time(self.0.slots_async(name, key, limit, op))
    }
    fn slots_with_async<'a>(
        &'a self,
        name: &'a str,
        key: Option<&'a str>,
        limit: &'a tollgate::Concurrency,
        op: &'a tollgate::core::slots::SlotOp,
        plan: &'a tollgate::core::Plan<'_>,
    ) -> BoxFuture<'a, (tollgate::core::slots::SlotAnswer, tollgate::core::Outcome)> {
        time(self.0.slots_with_async(name, key, limit, op, plan))
    }
}

/// The exporter, when one was started: shut down (what it holds sent) when the server
/// stops.
#[cfg(feature = "otel")]
pub use exporting::Exporting;

/// Without the `otel` feature there is never an exporter.
#[cfg(not(feature = "otel"))]
pub enum Exporting {}

#[cfg(not(feature = "otel"))]
impl Exporting {
    /// Never called: there is no exporter.
    pub fn describe(&self) -> String {
        match *self {}
    }

    /// Never called: there is no exporter.
    pub fn shutdown(self) {
        match self {}
    }
}

/// Starts exporting spans if the environment asks for it: `OTEL_EXPORTER_OTLP_ENDPOINT` (or
/// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, and neither `OTEL_SDK_DISABLED=true` nor
/// `OTEL_TRACES_EXPORTER=none` turns it off. `None`: nothing is exported.
///
/// # Errors
///
/// A variable asks for what this build cannot do (another exporter or protocol, an
/// `https` endpoint), or the exporter cannot be built from them; the message names it.
#[cfg(feature = "otel")]
pub fn start() -> anyhow::Result<Option<Exporting>> {
    let started = exporting::start(&|name| std::env::var(name).ok())?;
    if let Some(exporting) = &started {
        exporting::serve(exporting);
    }
    ON.store(started.is_some(), Ordering::Relaxed);
    Ok(started)
}

/// Without the `otel` feature nothing is ever exported; an endpoint set anyway is said so
/// in the log.
#[cfg(not(feature = "otel"))]
pub fn start() -> anyhow::Result<Option<Exporting>> {
    if let Some(name) =
        [ENDPOINT, TRACES_ENDPOINT].into_iter().find(|v| std::env::var_os(v).is_some())
    {
        tracing::warn!(
            "{name} is set, but this tollgate is built without the otel feature: no spans are exported"
        );
    }
    Ok(None)
}

const ENDPOINT: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
const TRACES_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT";

#[cfg(feature = "otel")]
mod exporting {
    use std::sync::OnceLock;

    use anyhow::{Context as _, bail};
    use opentelemetry::propagation::TextMapPropagator as _;
    use opentelemetry::trace::{SpanKind, Tracer as _, TracerProvider as _};
    use opentelemetry_sdk::propagation::TraceContextPropagator;
    use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};

    use super::{ENDPOINT, TRACES_ENDPOINT};

    /// The tracer of the started exporter.
    static TRACER: OnceLock<SdkTracer> = OnceLock::new();

    /// A started exporter.
    pub struct Exporting {
        provider: SdkTracerProvider,
        /// Where spans go.
        endpoint: String,
        /// `http/protobuf` or `http/json`.
        protocol: String,
    }

    /// How long the last spans may take to be sent when the server stops.
    const LAST_EXPORT: std::time::Duration = std::time::Duration::from_secs(5);

    impl Exporting {
        /// Where spans go, and how: for the banner.
        pub fn describe(&self) -> String {
            format!("{} (OTLP/HTTP, {})", self.endpoint, self.protocol)
        }

        /// Sends what is still held (for at most 5 s) and stops; outside the runtime, as it
        /// blocks.
        pub fn shutdown(self) {
            if let Err(e) = self.provider.shutdown_with_timeout(LAST_EXPORT) {
                tracing::warn!("tracing: the last spans may not have been exported: {e}");
            }
        }
    }

    pub(super) fn start(var: &dyn Fn(&str) -> Option<String>) -> anyhow::Result<Option<Exporting>> {
        let var = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        if var("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
            return Ok(None);
        }
        match var("OTEL_TRACES_EXPORTER").as_deref().map(str::trim) {
            None | Some("otlp") => {}
            Some("none") => return Ok(None),
            Some(other) => bail!(
                "OTEL_TRACES_EXPORTER={other:?}: tollgate exports traces over OTLP only; \
                 use otlp (the default) or none"
            ),
        }
        let endpoint = match (var(TRACES_ENDPOINT), var(ENDPOINT)) {
            (Some(traces), _) => (TRACES_ENDPOINT, traces),
            (None, Some(base)) => (ENDPOINT, format!("{}/v1/traces", base.trim_end_matches('/'))),
            (None, None) => return Ok(None),
        };
        if endpoint.1.starts_with("https:") {
            bail!(
                "{}={:?}: this tollgate exports over plain HTTP only; send spans to a collector \
                 beside it (http://HOST:4318), which may forward them over TLS",
                endpoint.0,
                endpoint.1
            );
        }
        let protocol = ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"]
            .into_iter()
            .find_map(|name| var(name).map(|value| (name, value)));
        let protocol = match protocol {
            None => "http/protobuf".to_owned(),
            Some((_, value)) if value == "http/protobuf" || value == "http/json" => value,
            Some((name, value)) => bail!(
                "{name}={value:?}: tollgate exports over OTLP/HTTP: use http/protobuf (the \
                 default) or http/json, with the collector's HTTP port (4318)"
            ),
        };
        use opentelemetry_otlp::WithExportConfig as _;
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_endpoint(endpoint.1.clone())
            .with_protocol(if protocol == "http/json" {
                opentelemetry_otlp::Protocol::HttpJson
            } else {
                opentelemetry_otlp::Protocol::HttpBinary
            })
            .build()
            .with_context(|| {
                format!("tracing: cannot export to {}={:?}", endpoint.0, endpoint.1)
            })?;
        let named = var("OTEL_SERVICE_NAME").is_some()
            || var("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|a| {
                a.split(',').any(|kv| kv.trim_start().starts_with("service.name="))
            });
        let mut resource = opentelemetry_sdk::Resource::builder();
        if !named {
            resource = resource.with_service_name("tollgate");
        }
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource.build())
            .build();
        Ok(Some(Exporting { provider, endpoint: endpoint.1, protocol }))
    }

    /// Makes spans of the started exporter's provider from now on.
    pub(super) fn serve(exporting: &Exporting) {
        let _ = TRACER.set(exporting.provider.tracer("tollgate"));
    }

    /// A server span named `name`, child of the caller's if `headers` carry its trace
    /// context; sampled (or not) by the provider's sampler (`OTEL_TRACES_SAMPLER`).
    pub(super) fn start_span(
        name: &'static str,
        headers: &http::HeaderMap,
    ) -> Option<opentelemetry_sdk::trace::Span> {
        let tracer = TRACER.get()?;
        let parent = if headers.contains_key("traceparent") {
            TraceContextPropagator::new().extract(&opentelemetry_http::HeaderExtractor(headers))
        } else {
            opentelemetry::Context::new()
        };
        Some(
            tracer
                .span_builder(name)
                .with_kind(SpanKind::Server)
                .start_with_context(tracer, &parent),
        )
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        fn started(vars: &[(&str, &str)]) -> anyhow::Result<Option<Exporting>> {
            let vars: Vec<(String, String)> =
                vars.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
            start(&|name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
        }

        #[test]
        fn nothing_is_exported_without_an_endpoint_or_when_turned_off() {
            assert!(started(&[]).unwrap().is_none());
            assert!(started(&[("OTEL_SERVICE_NAME", "x")]).unwrap().is_none());
            let endpoint = (ENDPOINT, "http://127.0.0.1:4318");
            assert!(started(&[endpoint, ("OTEL_SDK_DISABLED", "true")]).unwrap().is_none());
            assert!(started(&[endpoint, ("OTEL_TRACES_EXPORTER", "none")]).unwrap().is_none());
        }

        #[test]
        fn what_this_build_cannot_do_is_refused_by_the_name_of_its_variable() {
            let endpoint = (ENDPOINT, "http://127.0.0.1:4318");
            let refused = |vars: &[(&str, &str)]| started(vars).err().expect("refused").to_string();
            let e = refused(&[endpoint, ("OTEL_TRACES_EXPORTER", "zipkin")]);
            assert!(e.starts_with("OTEL_TRACES_EXPORTER=\"zipkin\""), "{e}");
            let e = refused(&[endpoint, ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")]);
            assert!(e.starts_with("OTEL_EXPORTER_OTLP_PROTOCOL=\"grpc\""), "{e}");
            let e = refused(&[(TRACES_ENDPOINT, "https://collector:4318/v1/traces")]);
            assert!(e.starts_with("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=\"https:"), "{e}");
        }

        #[test]
        fn the_traces_path_is_added_to_the_base_endpoint_only() {
            let base = started(&[(ENDPOINT, "http://127.0.0.1:1/")]).unwrap().unwrap();
            assert_eq!(base.endpoint, "http://127.0.0.1:1/v1/traces");
            let traces = (TRACES_ENDPOINT, "http://127.0.0.1:1/spans");
            let full = started(&[traces, (ENDPOINT, "http://127.0.0.1:2")]).unwrap().unwrap();
            assert_eq!(full.endpoint, "http://127.0.0.1:1/spans");
            assert_eq!(full.protocol, "http/protobuf");
        }
    }
}

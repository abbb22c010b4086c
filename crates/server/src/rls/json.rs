//! envoyproxy/ratelimit's `POST /json`: a `RateLimitRequest` in proto3 JSON, answered with
//! the `RateLimitResponse` in proto3 JSON, 200 (OK) or 429 (over the limit).

use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::{Descriptor, RlsAnswer, RlsError, RlsRequest, Unit};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonRequest {
    #[serde(default)]
    domain: String,
    #[serde(default)]
    descriptors: Vec<JsonDescriptor>,
    #[serde(default, alias = "hits_addend", rename = "hitsAddend")]
    hits_addend: Option<Number>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonDescriptor {
    #[serde(default)]
    entries: Vec<JsonEntry>,
    #[serde(default)]
    limit: Option<JsonOverride>,
    #[serde(default, alias = "hits_addend", rename = "hitsAddend")]
    hits_addend: Option<Number>,
    /// Accepted and ignored, as envoyproxy/ratelimit does (and the gRPC side).
    #[serde(default, alias = "is_negative_hits", rename = "isNegativeHits")]
    #[expect(dead_code, reason = "read so that the field is known, not used")]
    is_negative_hits: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonEntry {
    #[serde(default)]
    key: String,
    #[serde(default)]
    value: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonOverride {
    #[serde(default, alias = "requests_per_unit", rename = "requestsPerUnit")]
    requests_per_unit: Option<Number>,
    #[serde(default)]
    unit: Option<Value>,
}

/// A proto3 JSON integer: a number, or a string of one (as 64-bit integers are written).
enum Number {
    Int(u64),
    Text(String),
}

/// By hand, so that anything else is refused in the API's words (not "untagged enum").
impl<'de> Deserialize<'de> for Number {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Either;
        impl serde::de::Visitor<'_> for Either {
            type Value = Number;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an integer >= 0, or a string of one")
            }
            fn visit_u64<E>(self, n: u64) -> Result<Number, E> {
                Ok(Number::Int(n))
            }
            fn visit_str<E>(self, text: &str) -> Result<Number, E> {
                Ok(Number::Text(text.to_owned()))
            }
        }
        deserializer.deserialize_any(Either)
    }
}

impl Number {
    fn get(&self, field: &str, max: u64) -> Result<u64, RlsError> {
        let n = match self {
            Number::Int(n) => Some(*n),
            Number::Text(text) => text.parse().ok(),
        };
        n.filter(|n| *n <= max)
            .ok_or_else(|| RlsError::Invalid(format!("{field}: must be an integer in 0..={max}")))
    }
}

/// Reads the body of `POST /json`.
///
/// # Errors
///
/// Malformed JSON, an unknown field, a number out of range, an unknown unit.
pub fn parse(body: &[u8]) -> Result<RlsRequest, RlsError> {
    let request: JsonRequest = serde_json::from_slice(body)
        .map_err(|e| RlsError::Invalid(format!("invalid RateLimitRequest: {e}")))?;
    let hits_addend = match &request.hits_addend {
        None => 0,
        Some(n) => n.get("hitsAddend", u64::from(u32::MAX))? as u32,
    };
    let mut descriptors = Vec::new();
    for (i, d) in request.descriptors.into_iter().enumerate() {
        let limit = match d.limit {
            None => None,
            Some(o) => {
                let rpu = match &o.requests_per_unit {
                    None => 0,
                    Some(n) => n.get(
                        &format!("descriptors[{i}].limit.requestsPerUnit"),
                        u64::from(u32::MAX),
                    )? as u32,
                };
                let unit = match &o.unit {
                    Some(Value::String(name)) => Unit::parse(name).filter(|u| *u != Unit::Week),
                    Some(Value::Number(n)) => n
                        .as_i64()
                        .and_then(|n| i32::try_from(n).ok())
                        .and_then(Unit::from_limit_unit_number),
                    _ => None,
                };
                let Some(unit) = unit else {
                    return Err(RlsError::Invalid(format!(
                        "descriptors[{i}].limit.unit: give SECOND, MINUTE, HOUR, DAY, MONTH or YEAR"
                    )));
                };
                Some((rpu, unit))
            }
        };
        let hits = match &d.hits_addend {
            None => None,
            Some(n) => Some(n.get(&format!("descriptors[{i}].hitsAddend"), u64::MAX)?),
        };
        descriptors.push(Descriptor {
            entries: d.entries.into_iter().map(|e| (e.key, e.value)).collect(),
            limit,
            hits_addend: hits,
        });
    }
    Ok(RlsRequest { domain: request.domain, descriptors, hits_addend })
}

/// The answer as proto3 JSON (fields with their default value left out, enums by name,
/// durations as `"58s"`).
pub fn render(answer: &RlsAnswer) -> Value {
    let code = |over: bool| if over { "OVER_LIMIT" } else { "OK" };
    let mut out = Map::new();
    out.insert("overallCode".into(), json!(code(answer.over_limit)));
    let statuses: Vec<Value> = answer
        .statuses
        .iter()
        .map(|s| {
            let mut status = Map::new();
            status.insert("code".into(), json!(code(s.over_limit)));
            if let Some((name, requests_per_unit, unit)) = &s.current_limit {
                let mut limit = Map::new();
                if !name.is_empty() {
                    limit.insert("name".into(), json!(name));
                }
                if *requests_per_unit != 0 {
                    limit.insert("requestsPerUnit".into(), json!(requests_per_unit));
                }
                limit.insert("unit".into(), json!(unit.name()));
                status.insert("currentLimit".into(), Value::Object(limit));
            }
            if s.limit_remaining != 0 {
                status.insert("limitRemaining".into(), json!(s.limit_remaining));
            }
            if let Some(ms) = s.duration_until_reset {
                let (seconds, nanos) = super::until_reset(ms);
                let text = if nanos == 0 {
                    format!("{seconds}s")
                } else {
                    format!("{seconds}.{:03}s", nanos / 1_000_000)
                };
                status.insert("durationUntilReset".into(), json!(text));
            }
            Value::Object(status)
        })
        .collect();
    if !statuses.is_empty() {
        out.insert("statuses".into(), Value::Array(statuses));
    }
    if !answer.headers.is_empty() {
        let headers: Vec<Value> =
            answer.headers.iter().map(|(k, v)| json!({ "key": k, "value": v })).collect();
        out.insert("responseHeadersToAdd".into(), Value::Array(headers));
    }
    Value::Object(out)
}

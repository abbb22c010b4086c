//! envoyproxy/ratelimit's configuration, read unchanged: one `domain` per YAML file, a tree
//! of `descriptors` (`key`, optional `value`, `rate_limit`, nested `descriptors`,
//! `shadow_mode`, `detailed_metric`, ...), loaded from a file or every file of a directory,
//! checked as envoyproxy/ratelimit checks it, and matched as it matches.
//!
//! tollgate's own fields may extend a `rate_limit`: `kind` (`"token bucket"` or `"fixed
//! window"`, the default), `capacity`, `max_reserved` and `shards`, with the meanings of a
//! tollgate config. Without them a limit is what envoyproxy/ratelimit makes of it: a fixed
//! window of `requests_per_unit` per `unit`, windows aligned to the Unix epoch.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use serde_json::{Map, Value};
use tollgate::{Config, RawConfig};

/// The keys envoyproxy/ratelimit accepts, at any level of a file (it checks one flat set).
const VALID_KEYS: [&str; 16] = [
    "domain",
    "key",
    "value",
    "descriptors",
    "rate_limit",
    "unit",
    "requests_per_unit",
    "unlimited",
    "shadow_mode",
    "quota_mode",
    "name",
    "replaces",
    "detailed_metric",
    "value_to_metric",
    "share_threshold",
    "metadata",
];

/// tollgate's own keys, inside a `rate_limit` (or an entry of `rate_limits`) only.
const TOLLGATE_KEYS: [&str; 6] =
    ["kind", "capacity", "max_reserved", "shards", "unit_multiplier", "time_zone"];

/// A time unit of the rate limit service's API (`RateLimitResponse.RateLimit.Unit`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    /// A second.
    Second,
    /// A minute.
    Minute,
    /// An hour.
    Hour,
    /// A day.
    Day,
    /// 7 days.
    Week,
    /// 30 days, as envoyproxy/ratelimit counts a month.
    Month,
    /// 365 days.
    Year,
}

impl Unit {
    /// The unit named `name`, in any case (`second`, `MINUTE`).
    pub fn parse(name: &str) -> Option<Unit> {
        Some(match name.to_ascii_uppercase().as_str() {
            "SECOND" => Unit::Second,
            "MINUTE" => Unit::Minute,
            "HOUR" => Unit::Hour,
            "DAY" => Unit::Day,
            "WEEK" => Unit::Week,
            "MONTH" => Unit::Month,
            "YEAR" => Unit::Year,
            _ => return None,
        })
    }

    /// The unit of the response's enum number (`RateLimitResponse.RateLimit.Unit`).
    pub fn from_response_number(number: i32) -> Option<Unit> {
        Some(match number {
            1 => Unit::Second,
            2 => Unit::Minute,
            3 => Unit::Hour,
            4 => Unit::Day,
            5 => Unit::Month,
            6 => Unit::Year,
            7 => Unit::Week,
            _ => return None,
        })
    }

    /// The unit of a descriptor's `limit` override (`envoy.type.v3.RateLimitUnit`, which
    /// has no week).
    pub fn from_limit_unit_number(number: i32) -> Option<Unit> {
        match number {
            1..=6 => Unit::from_response_number(number),
            _ => None,
        }
    }

    /// Its number in `RateLimitResponse.RateLimit.Unit`.
    pub fn response_number(self) -> i32 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 2,
            Unit::Hour => 3,
            Unit::Day => 4,
            Unit::Month => 5,
            Unit::Year => 6,
            Unit::Week => 7,
        }
    }

    /// Its name in proto3 JSON.
    pub fn name(self) -> &'static str {
        match self {
            Unit::Second => "SECOND",
            Unit::Minute => "MINUTE",
            Unit::Hour => "HOUR",
            Unit::Day => "DAY",
            Unit::Week => "WEEK",
            Unit::Month => "MONTH",
            Unit::Year => "YEAR",
        }
    }

    /// Its length in milliseconds.
    pub fn millis(self) -> f64 {
        let seconds: u32 = match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3_600,
            Unit::Day => 86_400,
            Unit::Week => 604_800,
            Unit::Month => 2_592_000,
            Unit::Year => 31_536_000,
        };
        f64::from(seconds) * 1_000.0
    }
}

/// What a matched descriptor is held to.
#[derive(Clone, Debug)]
pub enum Limit {
    /// `unlimited: true`: answered OK without touching the store.
    Unlimited,
    /// `requests_per_unit: 0`: every request over the limit (there is no config to take from).
    Blocked {
        /// The unit.
        unit: Unit,
    },
    /// A tollgate limit.
    Limited {
        /// `requests_per_unit`.
        requests_per_unit: u32,
        /// `unit`.
        unit: Unit,
        /// What tollgate takes from: a fixed window of `requests_per_unit` per `unit`, or a
        /// token bucket with tollgate's fields.
        config: Config,
    },
}

/// A `rate_limit` of the tree, with what its descriptor says about it.
#[derive(Clone, Debug)]
pub struct Rule {
    /// Where it is: the domain and the path of composite keys (`domain.key_value.key`), as
    /// envoyproxy/ratelimit names it in its statistics; the name of its states in the store
    /// is made from it.
    pub full_key: String,
    /// `rate_limit.name` (empty if none): the name in `current_limit`, and what `replaces`
    /// refers to.
    pub name: String,
    /// The limit.
    pub limit: Limit,
    /// `shadow_mode`: counted, never refuses.
    pub shadow: bool,
    /// `detailed_metric`: metrics per value, not per rule.
    pub detailed_metric: bool,
    /// `rate_limit.replaces[].name`.
    pub replaces: Vec<String>,
    /// `share_threshold`: every value that matches the wildcard shares one state.
    pub share_threshold: bool,
    /// The descriptor's other limits, with `rate_limits` (tollgate's): each taken with this
    /// one, all or nothing. Their `full_key` ends in `#2`, `#3`, ... (their states' names).
    pub also: Vec<Rule>,
}

/// One level of the tree: its descriptors, by composite key (`key` or `key_value`), and the
/// wildcard ones in the order of the file.
#[derive(Debug, Default)]
struct Level {
    nodes: Vec<Node>,
    by_key: HashMap<String, usize>,
    wildcards: Vec<(Vec<String>, usize)>,
}

#[derive(Debug)]
struct Node {
    rule: Option<Rule>,
    children: Level,
}

/// The configuration: every domain's tree.
#[derive(Debug, Default)]
pub struct RlsConfig {
    domains: HashMap<String, Level>,
}

impl RlsConfig {
    /// Loads a YAML file, or every file under a directory (recursively, in the order of
    /// their paths; names starting with `.` are skipped), one domain each.
    ///
    /// # Errors
    ///
    /// A file that cannot be read, or that envoyproxy/ratelimit would reject (or whose
    /// tollgate fields are not a valid config): the file, the path in it and why.
    pub fn load(path: &Path) -> anyhow::Result<RlsConfig> {
        Self::load_observed(path, &mut |_, _| {})
    }

    /// As [`RlsConfig::load`], showing `observe` each file read and its text (for the
    /// config's version).
    ///
    /// # Errors
    ///
    /// As for [`RlsConfig::load`].
    pub fn load_observed(
        path: &Path,
        observe: &mut dyn FnMut(&Path, &str),
    ) -> anyhow::Result<RlsConfig> {
        let mut files = Vec::new();
        let mut seen = Vec::new();
        collect_files(path, &mut files, &mut seen)
            .with_context(|| format!("cannot read the RLS config {}", path.display()))?;
        if files.is_empty() {
            bail!("the RLS config directory {} holds no file", path.display());
        }
        files.sort();
        let mut config = RlsConfig::default();
        for file in files {
            let text = std::fs::read_to_string(&file)
                .with_context(|| format!("cannot read {}", file.display()))?;
            observe(&file, &text);
            config.add(&file.display().to_string(), &text)?;
        }
        Ok(config)
    }

    /// Adds the domain of one file's `text`; `file` names it in errors.
    ///
    /// # Errors
    ///
    /// As for [`RlsConfig::load`].
    pub fn add(&mut self, file: &str, text: &str) -> anyhow::Result<()> {
        let root: Value = serde_saphyr::from_str(text)
            .map_err(|e| anyhow::anyhow!("{file}: error loading config file: {e}"))?;
        let root = match root {
            Value::Object(map) => map,
            Value::Null => Map::new(),
            _ => bail!("{file}: error loading config file: the top level must be a map"),
        };
        check_keys(file, "", &Value::Object(root.clone()))?;
        let domain = match root.get("domain") {
            Some(Value::String(d)) if !d.is_empty() => d.clone(),
            None | Some(Value::String(_) | Value::Null) => {
                bail!("{file}: config file cannot have empty domain")
            }
            Some(other) => bail!("{file}: domain: must be a string, not {other}"),
        };
        if self.domains.contains_key(&domain) {
            bail!("{file}: duplicate domain '{domain}' in config file");
        }
        let mut level = Level::default();
        if let Some(descriptors) = root.get("descriptors") {
            load_level(file, "descriptors", &domain, descriptors, &mut level)?;
        }
        self.domains.insert(domain, level);
        Ok(())
    }

    /// The rule for a request descriptor's `entries` in `domain`, as envoyproxy/ratelimit
    /// finds it: at each entry, the exact `key_value` first, then the first wildcard value
    /// that matches (in the file's order), then the key alone; a rule counts only where the
    /// entries end (a limit at depth N is for descriptors of exactly N entries). Also the
    /// matched path with the request's values, for `detailed_metric`.
    pub fn find<'c>(&'c self, domain: &str, entries: &[(&str, &str)]) -> Option<&'c Rule> {
        let mut level = self.domains.get(domain)?;
        for (i, (key, value)) in entries.iter().enumerate() {
            let composite = format!("{key}_{value}");
            let index = level
                .by_key
                .get(&composite)
                .copied()
                .or_else(|| {
                    level
                        .wildcards
                        .iter()
                        .find(|(parts, _)| wildcard_match(parts, &composite))
                        .map(|(_, index)| *index)
                })
                .or_else(|| level.by_key.get(*key).copied())?;
            let node = &level.nodes[index];
            if i + 1 == entries.len() {
                return node.rule.as_ref();
            }
            if node.children.nodes.is_empty() {
                return None;
            }
            level = &node.children;
        }
        None
    }

    /// The domains configured, in order.
    pub fn domain_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.domains.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }

    /// Whether `domain` has a configuration.
    pub fn has_domain(&self, domain: &str) -> bool {
        self.domains.contains_key(domain)
    }

    /// Every rule, for metrics: (domain, full key).
    pub fn rules(&self) -> Vec<(&str, &str)> {
        fn walk<'c>(domain: &'c str, level: &'c Level, out: &mut Vec<(&'c str, &'c str)>) {
            for node in &level.nodes {
                if let Some(rule) = &node.rule {
                    out.push((domain, &rule.full_key));
                    out.extend(rule.also.iter().map(|also| (domain, also.full_key.as_str())));
                }
                walk(domain, &node.children, out);
            }
        }
        let mut out = Vec::new();
        for (domain, level) in &self.domains {
            walk(domain, level, &mut out);
        }
        out.sort_unstable();
        out
    }
}

/// The files under `path` (itself, if it is not a directory), into `files`. `seen` holds the
/// directories read so far (their real paths): one reached again (a symlink back up the
/// tree, or two to one directory) is an error, as is an entry that is neither a file nor a
/// directory (a symlink to nothing): either would change the domains in silence.
fn collect_files(
    path: &Path,
    files: &mut Vec<PathBuf>,
    seen: &mut Vec<PathBuf>,
) -> anyhow::Result<()> {
    if !path.is_dir() {
        files.push(path.to_owned());
        return Ok(());
    }
    let real = std::fs::canonicalize(path)?;
    if let Some(first) = seen.iter().find(|s| **s == real) {
        bail!(
            "{} is {} again (a symlink loop, or two symlinks to one directory): refused",
            path.display(),
            first.display()
        );
    }
    seen.push(real);
    let mut entries: Vec<_> = std::fs::read_dir(path)?.collect::<Result<_, _>>()?;
    entries.sort_by_key(std::fs::DirEntry::file_name);
    for entry in entries {
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let path = entry.path();
        if path.is_dir() {
            collect_files(&path, files, seen)?;
        } else if path.is_file() {
            files.push(path);
        } else {
            let what = match std::fs::read_link(&path) {
                Ok(target) => format!("a symlink to {}, which does not exist", target.display()),
                Err(_) => "neither a file nor a directory".to_owned(),
            };
            bail!("{} is {what}: refused (remove it, or make it point at a file)", path.display());
        }
    }
    Ok(())
}

/// envoyproxy/ratelimit's first pass: every map key a string from the valid set (tollgate's
/// own inside `rate_limit`), every list element of `descriptors` and `replaces` a map, and
/// leaves strings, integers, booleans or nothing (`metadata` is free-form).
fn check_keys(file: &str, path: &str, value: &Value) -> anyhow::Result<()> {
    match value {
        Value::Object(map) => {
            let in_rate_limit = path.ends_with("rate_limit")
                || path.rsplit_once('.').is_some_and(|(_, last)| last.starts_with("rate_limits["));
            for (key, child) in map {
                let tollgate_key = in_rate_limit && TOLLGATE_KEYS.contains(&key.as_str());
                let descriptor_key = key == "rate_limits" && !in_rate_limit;
                if !VALID_KEYS.contains(&key.as_str()) && !tollgate_key && !descriptor_key {
                    bail!("{file}: {}: config error, unknown key '{key}'", at(path, key));
                }
                if key == "metadata" {
                    continue;
                }
                if tollgate_key {
                    // Numbers and strings, checked when the config is made.
                    continue;
                }
                check_keys(file, &at(path, key), child)?;
            }
            Ok(())
        }
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                if !item.is_object() {
                    bail!(
                        "{file}: {path}[{i}]: config error, yaml file contains list of type other \
                         than map: {item}"
                    );
                }
                check_keys(file, &format!("{path}[{i}]"), item)?;
            }
            Ok(())
        }
        Value::Number(n) if n.is_f64() => {
            bail!("{file}: {path}: error checking config: {n} is not an integer")
        }
        _ => Ok(()),
    }
}

fn at(path: &str, key: &str) -> String {
    if path.is_empty() { key.to_owned() } else { format!("{path}.{key}") }
}

/// A string field: a string, or an integer or boolean written as one (`value: 123`).
fn string_field(
    file: &str,
    path: &str,
    map: &Map<String, Value>,
    key: &str,
) -> anyhow::Result<String> {
    Ok(match map.get(key) {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Number(n)) => n.to_string(),
        Some(Value::Bool(b)) => b.to_string(),
        Some(other) => bail!("{file}: {}: must be a string, not {other}", at(path, key)),
    })
}

fn bool_field(file: &str, path: &str, map: &Map<String, Value>, key: &str) -> anyhow::Result<bool> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => bail!("{file}: {}: must be true or false, not {other}", at(path, key)),
    }
}

fn load_level(
    file: &str,
    path: &str,
    parent: &str,
    descriptors: &Value,
    level: &mut Level,
) -> anyhow::Result<()> {
    let items = match descriptors {
        Value::Array(items) => items.as_slice(),
        Value::Null => &[],
        other => bail!("{file}: {path}: must be a list of descriptors, not {other}"),
    };
    for (i, item) in items.iter().enumerate() {
        let path = format!("{path}[{i}]");
        let Value::Object(map) = item else { unreachable!("checked by check_keys") };
        let key = string_field(file, &path, map, "key")?;
        if key.is_empty() {
            bail!("{file}: {path}: descriptor has empty key");
        }
        let value = string_field(file, &path, map, "value")?;
        let composite = if value.is_empty() { key.clone() } else { format!("{key}_{value}") };
        let full_key = format!("{parent}.{composite}");
        if level.by_key.contains_key(&composite)
            || level.wildcards.iter().any(|(parts, _)| parts.join("*") == composite)
        {
            bail!("{file}: {path}: duplicate descriptor composite key '{full_key}'");
        }
        let shadow = bool_field(file, &path, map, "shadow_mode")?;
        let detailed_metric = bool_field(file, &path, map, "detailed_metric")?;
        let share_threshold = bool_field(file, &path, map, "share_threshold")?;
        if bool_field(file, &path, map, "quota_mode")? {
            bail!(
                "{file}: {path}.quota_mode: tollgate does not support quota mode (a request \
                 here is taken all or nothing); remove it"
            );
        }
        if share_threshold && !composite.contains('*') {
            bail!(
                "{file}: {path}: share_threshold can only be used with wildcard values \
                 (containing '*'), but found key '{composite}'"
            );
        }
        let base = Rule {
            full_key: full_key.clone(),
            name: String::new(),
            limit: Limit::Unlimited,
            shadow,
            detailed_metric,
            replaces: Vec::new(),
            share_threshold,
            also: Vec::new(),
        };
        let rule = match (map.get("rate_limit"), map.get("rate_limits")) {
            (None | Some(Value::Null), None | Some(Value::Null)) => None,
            (Some(Value::Object(rate_limit)), None | Some(Value::Null)) => {
                Some(load_rule(file, &format!("{path}.rate_limit"), rate_limit, base)?)
            }
            (Some(other), None | Some(Value::Null)) => {
                bail!("{file}: {path}.rate_limit: must be a map, not {other}")
            }
            (None | Some(Value::Null), Some(Value::Array(items))) => {
                // tollgate's: several limits on one descriptor, taken all or nothing.
                let mut rules = Vec::new();
                for (i, item) in items.iter().enumerate() {
                    let Value::Object(rate_limit) = item else {
                        unreachable!("checked by check_keys")
                    };
                    let mut base = base.clone();
                    if i > 0 {
                        base.full_key = format!("{full_key}#{}", i + 1);
                    }
                    let at = format!("{path}.rate_limits[{i}]");
                    rules.push(load_rule(file, &at, rate_limit, base)?);
                }
                if rules.is_empty() {
                    bail!("{file}: {path}.rate_limits: must hold at least one rate limit");
                }
                let mut first = rules.remove(0);
                first.also = rules;
                Some(first)
            }
            (None | Some(Value::Null), Some(other)) => {
                bail!("{file}: {path}.rate_limits: must be a list of rate limits, not {other}")
            }
            (Some(_), Some(_)) => bail!(
                "{file}: {path}: give rate_limit (one limit) or rate_limits (several), not both"
            ),
        };
        let mut children = Level::default();
        if let Some(descriptors) = map.get("descriptors") {
            load_level(
                file,
                &format!("{path}.descriptors"),
                &full_key,
                descriptors,
                &mut children,
            )?;
        }
        let index = level.nodes.len();
        level.nodes.push(Node { rule, children });
        if composite.contains('*') {
            level.wildcards.push((composite.split('*').map(str::to_owned).collect(), index));
        } else {
            level.by_key.insert(composite, index);
        }
    }
    Ok(())
}

fn load_rule(
    file: &str,
    path: &str,
    map: &Map<String, Value>,
    mut rule: Rule,
) -> anyhow::Result<Rule> {
    let unlimited = bool_field(file, path, map, "unlimited")?;
    let unit_name = string_field(file, path, map, "unit")?;
    let unit = Unit::parse(&unit_name);
    if unlimited && unit.is_some() {
        bail!("{file}: {path}: should not specify rate limit unit when unlimited");
    }
    rule.name = string_field(file, path, map, "name")?;
    if let Some(replaces) = map.get("replaces") {
        let Value::Array(items) = replaces else {
            bail!("{file}: {path}.replaces: must be a list of {{name}}, not {replaces}");
        };
        for (i, item) in items.iter().enumerate() {
            let Value::Object(entry) = item else { unreachable!("checked by check_keys") };
            let name = string_field(file, &format!("{path}.replaces[{i}]"), entry, "name")?;
            if name.is_empty() {
                bail!("{file}: {path}.replaces[{i}]: should not have an empty replaces entry");
            }
            if name == rule.name {
                bail!(
                    "{file}: {path}.replaces[{i}]: replaces should not contain name of same \
                     descriptor"
                );
            }
            rule.replaces.push(name);
        }
    }
    if unlimited {
        rule.limit = Limit::Unlimited;
        return Ok(rule);
    }
    let Some(unit) = unit else {
        bail!("{file}: {path}.unit: invalid rate limit unit '{unit_name}'");
    };
    let requests_per_unit = match map.get("requests_per_unit") {
        None | Some(Value::Null) => 0,
        Some(Value::Number(n)) => match n.as_u64().and_then(|n| u32::try_from(n).ok()) {
            Some(n) => n,
            None => {
                bail!("{file}: {path}.requests_per_unit: {n} is not an integer in 0..=4294967295")
            }
        },
        Some(other) => {
            bail!("{file}: {path}.requests_per_unit: must be an integer, not {other}")
        }
    };
    if requests_per_unit == 0 {
        rule.limit = Limit::Blocked { unit };
        return Ok(rule);
    }
    // tollgate's config: the fields in its own words, checked by its own rules.
    let mut raw = Map::new();
    let kind = match map.get("kind") {
        None => Value::String("fixed window".into()),
        Some(kind) => kind.clone(),
    };
    let fixed = kind == Value::String("fixed window".into());
    // `unit_multiplier` (tollgate's): windows of N units.
    let multiplier = match map.get("unit_multiplier") {
        None | Some(Value::Null) => 1,
        Some(Value::Number(n)) => match n.as_u64().and_then(|n| u32::try_from(n).ok()) {
            Some(n) if n >= 1 => n,
            _ => bail!("{file}: {path}.unit_multiplier: {n} is not an integer in 1..=4294967295"),
        },
        Some(other) => bail!("{file}: {path}.unit_multiplier: must be an integer, not {other}"),
    };
    // `time_zone` (tollgate's): a day, week, month or year of the calendar there.
    let time_zone = match map.get("time_zone") {
        None | Some(Value::Null) => None,
        Some(Value::String(zone)) => Some(zone.clone()),
        Some(other) => bail!("{file}: {path}.time_zone: must be a string, not {other}"),
    };
    raw.insert("kind".into(), kind);
    raw.insert("rate".into(), Value::from(requests_per_unit));
    if let Some(zone) = &time_zone {
        let calendar = match unit {
            Unit::Day | Unit::Week | Unit::Month | Unit::Year if multiplier == 1 => {
                unit.name().to_ascii_lowercase()
            }
            Unit::Day | Unit::Week | Unit::Month | Unit::Year => bail!(
                "{file}: {path}.unit_multiplier: a calendar unit (with time_zone) is one day, \
                 week, month or year; remove unit_multiplier or time_zone"
            ),
            _ => bail!(
                "{file}: {path}.time_zone: applies to the units day, week, month and year (their \
                 calendar periods), not {}",
                unit.name().to_ascii_lowercase()
            ),
        };
        raw.insert("calendar".into(), Value::String(calendar));
        raw.insert("timeZone".into(), Value::String(zone.clone()));
    } else {
        raw.insert("period".into(), Value::from(unit.millis() * f64::from(multiplier)));
    }
    for (ours, theirs) in
        [("capacity", "capacity"), ("max_reserved", "maxReserved"), ("shards", "shards")]
    {
        if let Some(value) = map.get(ours) {
            raw.insert(theirs.into(), value.clone());
        }
    }
    if fixed && time_zone.is_none() {
        // Windows from the Unix epoch, as envoyproxy/ratelimit counts them.
        raw.insert("start".into(), Value::from(0));
    }
    let raw: RawConfig = serde_json::from_value(Value::Object(raw))
        .map_err(|e| anyhow::anyhow!("{file}: {path}: {e}"))?;
    let config = Config::try_from(&raw).map_err(|e| {
        let mut message = format!("{file}: {path}.");
        let field = match e.field() {
            "rate" => "requests_per_unit",
            "period" => "unit",
            "maxReserved" => "max_reserved",
            "timeZone" => "time_zone",
            "calendar" => "unit",
            other => other,
        };
        let _ = write!(message, "{field}: {e}");
        anyhow::anyhow!(message)
    })?;
    rule.limit = Limit::Limited { requests_per_unit, unit, config };
    Ok(rule)
}

/// Whether `text` matches a wildcard pattern split on its `*`s: it starts with the first
/// part, ends with the last, and holds the others in order between them without overlap.
fn wildcard_match(parts: &[String], text: &str) -> bool {
    let (Some(first), Some(last)) = (parts.first(), parts.last()) else { return false };
    if !text.starts_with(first.as_str()) {
        return false;
    }
    let mut rest = &text[first.len()..];
    for middle in &parts[1..parts.len() - 1] {
        match rest.find(middle.as_str()) {
            Some(at) => rest = &rest[at + middle.len()..],
            None => return false,
        }
    }
    parts.len() > 1 && rest.ends_with(last.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str) -> anyhow::Result<RlsConfig> {
        let mut config = RlsConfig::default();
        config.add("test.yaml", text)?;
        Ok(config)
    }

    fn err(text: &str) -> String {
        load(text).unwrap_err().to_string()
    }

    /// A directory with a symlink to nothing, or a symlink loop, is refused with a message
    /// (the first was skipped in silence, dropping its domain; the second never finished).
    #[test]
    fn dangling_symlinks_and_loops_are_refused() {
        use std::os::unix::fs::symlink;
        let dir = tempfile::tempdir().unwrap();
        let rls = dir.path().join("rls");
        std::fs::create_dir_all(rls.join("z")).unwrap();
        std::fs::write(rls.join("a.yaml"), "domain: a\ndescriptors: []\n").unwrap();
        std::fs::write(rls.join("z/b.yaml"), "domain: b\ndescriptors: []\n").unwrap();
        assert_eq!(RlsConfig::load(&rls).unwrap().domain_names(), ["a", "b"]);

        symlink(rls.join("gone.yaml"), rls.join("c.yaml")).unwrap();
        let e = format!("{:#}", RlsConfig::load(&rls).unwrap_err());
        assert!(e.contains("c.yaml is a symlink to") && e.contains("which does not exist"), "{e}");
        std::fs::remove_file(rls.join("c.yaml")).unwrap();

        symlink(".", rls.join("z/loop")).unwrap();
        symlink("..", rls.join("z/up")).unwrap();
        let e = format!("{:#}", RlsConfig::load(&rls).unwrap_err());
        assert!(e.contains("again (a symlink loop"), "{e}");
        std::fs::remove_file(rls.join("z/loop")).unwrap();
        std::fs::remove_file(rls.join("z/up")).unwrap();
        // A symlink to a file elsewhere, or to a directory outside, is read as before.
        let outside = dir.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("d.yaml"), "domain: d\ndescriptors: []\n").unwrap();
        symlink(&outside, rls.join("o")).unwrap();
        assert_eq!(RlsConfig::load(&rls).unwrap().domain_names(), ["a", "b", "d"]);
    }

    /// tollgate's `rate_limits`, `unit_multiplier` and `time_zone`, and their errors.
    #[test]
    fn several_limits_n_units_and_calendar_units() {
        let c = load(
            "domain: d\ndescriptors:\n  - key: k\n    rate_limits:\n      - name: burst\n        \
             unit: second\n        requests_per_unit: 10\n      - name: daily\n        unit: month\n        \
             requests_per_unit: 1000\n        time_zone: America/New_York\n  - key: w\n    rate_limit:\n      \
             unit: minute\n      unit_multiplier: 5\n      requests_per_unit: 2\n",
        )
        .unwrap();
        let rule = c.find("d", &[("k", "x")]).unwrap();
        assert_eq!((rule.name.as_str(), rule.full_key.as_str()), ("burst", "d.k"));
        assert_eq!(rule.also.len(), 1);
        let also = &rule.also[0];
        assert_eq!((also.name.as_str(), also.full_key.as_str()), ("daily", "d.k#2"));
        let Limit::Limited { config, .. } = &also.limit else { panic!("{:?}", also.limit) };
        let calendar = config.calendar().unwrap();
        assert_eq!((calendar.unit().as_str(), calendar.time_zone()), ("month", "America/New_York"));
        let Limit::Limited { config, .. } = &c.find("d", &[("w", "x")]).unwrap().limit else {
            panic!()
        };
        assert_eq!((config.period(), config.start()), (300_000.0, Some(0.0)));
        assert_eq!(c.rules(), [("d", "d.k"), ("d", "d.k#2"), ("d", "d.w")]);
        for (yaml, error) in [
            (
                "  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n    rate_limits: [{unit: second, requests_per_unit: 1}]\n",
                "give rate_limit (one limit) or rate_limits (several), not both",
            ),
            ("  - key: k\n    rate_limits: []\n", "must hold at least one rate limit"),
            (
                "  - key: k\n    rate_limit: {unit: minute, unit_multiplier: 0, requests_per_unit: 1}\n",
                "unit_multiplier: 0 is not an integer in 1..=4294967295",
            ),
            (
                "  - key: k\n    rate_limit: {unit: minute, time_zone: UTC, requests_per_unit: 1}\n",
                "time_zone: applies to the units day, week, month and year",
            ),
            (
                "  - key: k\n    rate_limit: {unit: day, unit_multiplier: 2, time_zone: UTC, requests_per_unit: 1}\n",
                "a calendar unit (with time_zone) is one day",
            ),
            (
                "  - key: k\n    rate_limit: {unit: day, time_zone: Mars/Olympus, requests_per_unit: 1}\n",
                "time_zone: invalid config: timeZone is \"Mars/Olympus\"",
            ),
            (
                "  - key: k\n    rate_limits: [{unit: day, requests_per_unit: 1, bogus: 1}]\n",
                "unknown key 'bogus'",
            ),
        ] {
            let e = err(&format!("domain: d\ndescriptors:\n{yaml}"));
            assert!(e.contains(error), "{yaml}: {e}");
        }
    }

    const BASIC: &str = r"
domain: test
descriptors:
  - key: key1
    value: value1
    descriptors:
      - key: subkey1
        rate_limit:
          unit: second
          requests_per_unit: 5
  - key: key2
    rate_limit:
      unit: Minute
      requests_per_unit: 20
  - key: key2
    value: value2
    rate_limit:
      unit: minute
      requests_per_unit: 30
  - key: key2
    value: value3
  - key: key3
    value: pre*
    rate_limit:
      unit: hour
      requests_per_unit: 7
  - key: key3
    value: a*b*c
    rate_limit:
      unit: hour
      requests_per_unit: 8
  - key: key5
    value: value5
    rate_limit:
      unit: day
      requests_per_unit: 15
    descriptors:
      - key: subkey5
        value: subvalue5
        rate_limit:
          unit: second
          requests_per_unit: 25
";

    fn found<'c>(config: &'c RlsConfig, entries: &[(&str, &str)]) -> Option<&'c str> {
        config.find("test", entries).map(|r| r.full_key.as_str())
    }

    #[test]
    fn matching_as_envoyproxy_ratelimit_matches() {
        let c = load(BASIC).unwrap();
        assert_eq!(
            found(&c, &[("key1", "value1"), ("subkey1", "x")]),
            Some("test.key1_value1.subkey1")
        );
        // Exact depth: fewer or more entries do not match.
        assert_eq!(found(&c, &[("key1", "value1")]), None);
        assert_eq!(found(&c, &[("key1", "value1"), ("subkey1", "x"), ("z", "z")]), None);
        // Value before key-only; a value without a limit lets it through (no fallback).
        assert_eq!(found(&c, &[("key2", "value2")]), Some("test.key2_value2"));
        assert_eq!(found(&c, &[("key2", "other")]), Some("test.key2"));
        assert_eq!(found(&c, &[("key2", "value3")]), None);
        // Wildcards.
        assert_eq!(found(&c, &[("key3", "prefix")]), Some("test.key3_pre*"));
        assert_eq!(found(&c, &[("key3", "pre")]), Some("test.key3_pre*"));
        assert_eq!(found(&c, &[("key3", "axbxc")]), Some("test.key3_a*b*c"));
        assert_eq!(found(&c, &[("key3", "abc")]), Some("test.key3_a*b*c"));
        assert_eq!(found(&c, &[("key3", "acb")]), None);
        // A node with a limit and children: its limit at its depth, the child's deeper.
        assert_eq!(found(&c, &[("key5", "value5")]), Some("test.key5_value5"));
        assert_eq!(
            found(&c, &[("key5", "value5"), ("subkey5", "subvalue5")]),
            Some("test.key5_value5.subkey5_subvalue5")
        );
        assert_eq!(found(&c, &[("key5", "value5"), ("subkey5", "other")]), None);
        assert_eq!(found(&c, &[]), None);
        assert!(c.find("other", &[("key2", "x")]).is_none());
        let rule = c.find("test", &[("key2", "x")]).unwrap();
        let Limit::Limited { requests_per_unit, unit, config } = &rule.limit else { panic!() };
        assert_eq!((*requests_per_unit, *unit), (20, Unit::Minute));
        assert_eq!(*config, Config::fixed_window(20.0, 60_000.0).with_start(0.0));
    }

    #[test]
    fn tollgate_fields_extend_a_rate_limit() {
        let c = load(
            "domain: d\ndescriptors:\n  - key: user\n    rate_limit:\n      unit: minute\n      \
             requests_per_unit: 10\n      kind: token bucket\n      capacity: 3\n      shards: 2\n",
        )
        .unwrap();
        let Limit::Limited { config, .. } = &c.find("d", &[("user", "a")]).unwrap().limit else {
            panic!()
        };
        assert_eq!(*config, Config::token_bucket(10.0, 60_000.0).with_capacity(3.0).with_shards(2));
        assert_eq!(
            err("domain: d\ndescriptors:\n  - key: u\n    rate_limit:\n      unit: minute\n      \
                 requests_per_unit: 10\n      capacity: -1\n"),
            "test.yaml: descriptors[0].rate_limit.capacity: invalid config: capacity is -1; it \
             must be finite, >= 0 and at most 1e15"
        );
        // Only inside rate_limit.
        assert_eq!(
            err("domain: d\ndescriptors:\n  - key: u\n    capacity: 3\n"),
            "test.yaml: descriptors[0].capacity: config error, unknown key 'capacity'"
        );
    }

    #[test]
    fn configs_envoyproxy_ratelimit_rejects_are_rejected() {
        let cases: &[(&str, &str)] = &[
            ("domain: d\nfoo: 1\n", "test.yaml: foo: config error, unknown key 'foo'"),
            (
                "domain: d\ndescriptors:\n  - key: a\n    ratelimit: {}\n",
                "test.yaml: descriptors[0].ratelimit: config error, unknown key 'ratelimit'",
            ),
            ("descriptors: []\n", "test.yaml: config file cannot have empty domain"),
            ("", "test.yaml: config file cannot have empty domain"),
            (
                "domain: d\ndescriptors:\n  - value: v\n",
                "test.yaml: descriptors[0]: descriptor has empty key",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    value: b\n  - key: a\n    value: b\n",
                "test.yaml: descriptors[1]: duplicate descriptor composite key 'd.a_b'",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: fortnight\n      requests_per_unit: 1\n",
                "test.yaml: descriptors[0].rate_limit.unit: invalid rate limit unit 'fortnight'",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      requests_per_unit: 1\n",
                "test.yaml: descriptors[0].rate_limit.unit: invalid rate limit unit ''",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unlimited: true\n      unit: second\n",
                "test.yaml: descriptors[0].rate_limit: should not specify rate limit unit when unlimited",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: 1\n      replaces:\n        - name: ''\n",
                "test.yaml: descriptors[0].rate_limit.replaces[0]: should not have an empty replaces entry",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      name: n\n      unit: second\n      requests_per_unit: 1\n      replaces:\n        - name: n\n",
                "test.yaml: descriptors[0].rate_limit.replaces[0]: replaces should not contain name of same descriptor",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: -1\n",
                "test.yaml: descriptors[0].rate_limit.requests_per_unit: -1 is not an integer in 0..=4294967295",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: 1.5\n",
                "test.yaml: descriptors[0].rate_limit.requests_per_unit: error checking config: 1.5 is not an integer",
            ),
            (
                "domain: d\ndescriptors:\n  - a\n",
                "test.yaml: descriptors[0]: config error, yaml file contains list of type other than map: \"a\"",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    value: b\n    share_threshold: true\n",
                "test.yaml: descriptors[0]: share_threshold can only be used with wildcard values (containing '*'), but found key 'a_b'",
            ),
        ];
        for (text, message) in cases {
            assert_eq!(err(text), *message, "{text}");
        }
        let mut two = load("domain: d\n").unwrap();
        assert_eq!(
            two.add("b.yaml", "domain: d\n").unwrap_err().to_string(),
            "b.yaml: duplicate domain 'd' in config file"
        );
        assert!(err("domain: [1\n").starts_with("test.yaml: error loading config file: "));
    }

    #[test]
    fn units_and_special_limits() {
        let c = load(
            "domain: d\ndescriptors:\n  - key: free\n    rate_limit:\n      unlimited: true\n  \
             - key: none\n    rate_limit:\n      unit: WEEK\n      requests_per_unit: 0\n",
        )
        .unwrap();
        assert!(matches!(c.find("d", &[("free", "x")]).unwrap().limit, Limit::Unlimited));
        assert!(matches!(
            c.find("d", &[("none", "x")]).unwrap().limit,
            Limit::Blocked { unit: Unit::Week }
        ));
        assert_eq!(Unit::Month.millis(), 2_592_000_000.0);
        for n in 1..=7 {
            assert_eq!(Unit::from_response_number(n).unwrap().response_number(), n);
        }
    }
}

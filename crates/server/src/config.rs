//! The server's settings: a TOML file, overridden by flags and `TOLLGATE_TOKENS`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;

use anyhow::{Context, bail};
use serde::Deserialize;
use tollgate::{Config, HOUR, MINUTE, RawConfig};

/// The default address: loopback only.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8787";
/// The default store: a SQLite file in the working directory.
pub const DEFAULT_STORE: &str = "sqlite://tollgate.db";

/// The config file (SPEC §6).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    #[serde(default)]
    server: ServerSection,
    #[serde(default)]
    limits: BTreeMap<String, LimitTable>,
}

/// A `[limits.<name>]` table: the limit's config (SPEC §1), and `failOpen = true` for a limit
/// that is granted while the store fails (see `tollgate::RateLimiterBuilder::fail_open`).
#[derive(Debug)]
struct LimitTable {
    config: RawConfig,
    fail_open: bool,
}

impl<'de> Deserialize<'de> for LimitTable {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error as _;
        let mut table = toml::Table::deserialize(deserializer)?;
        let fail_open = match table.remove("failOpen") {
            None => false,
            Some(toml::Value::Boolean(open)) => open,
            Some(other) => {
                return Err(D::Error::custom(format!(
                    "failOpen is {other}; it must be true or false"
                )));
            }
        };
        // The rest is the config, with its own errors for unknown or invalid fields.
        let config = toml::Value::Table(table).try_into().map_err(D::Error::custom)?;
        Ok(LimitTable { config, fail_open })
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ServerSection {
    listen: Option<String>,
    store: Option<String>,
    tokens: Option<Vec<String>>,
    allow_inline_config: Option<bool>,
    allow_config_override: Option<bool>,
    max_keys: Option<usize>,
}

/// Everything `tollgate serve` runs with.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// Where to listen.
    pub listen: SocketAddr,
    /// The store URL.
    pub store: String,
    /// Accepted bearer tokens; empty: no authentication.
    pub tokens: Vec<String>,
    /// Whether requests may carry their own config for names the server does not define.
    pub allow_inline_config: bool,
    /// Whether requests may carry their own config for names the server defines.
    pub allow_config_override: bool,
    /// The most live states of the memory store (none: no bound but memory itself).
    pub max_keys: Option<usize>,
    /// The named limits.
    pub limits: Vec<(String, Config)>,
    /// The named limits that fail open (`failOpen = true`).
    pub fail_open: Vec<String>,
}

/// What the command line says, to override the file.
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    /// `--listen`.
    pub listen: Option<String>,
    /// `--store`.
    pub store: Option<String>,
    /// `TOLLGATE_TOKENS`, comma-separated.
    pub tokens_env: Option<String>,
}

impl FileConfig {
    /// Reads and parses a config file.
    ///
    /// # Errors
    ///
    /// The file cannot be read, is not TOML of this shape, or a limit's config is invalid.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("in {}", path.display()))
    }

    /// Parses a config file's text.
    ///
    /// # Errors
    ///
    /// Not TOML of this shape.
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        Ok(toml::from_str(text)?)
    }

    /// The limits this file defines, validated; the examples when it defines none and `examples`.
    fn limits(&self, examples: bool) -> anyhow::Result<Vec<(String, Config)>> {
        if self.limits.is_empty() && examples {
            return Ok(example_limits());
        }
        self.limits
            .iter()
            .map(|(name, table)| {
                let config =
                    Config::try_from(&table.config).with_context(|| format!("[limits.{name}]"))?;
                tollgate::core::validate_name_key(name, None)
                    .with_context(|| format!("[limits.{name}]"))?;
                Ok((name.clone(), config))
            })
            .collect()
    }

    /// The settings: this file, then the overrides, then the defaults.
    ///
    /// # Errors
    ///
    /// An address that does not parse, or an invalid limit.
    pub fn settings(&self, overrides: &Overrides, examples: bool) -> anyhow::Result<Settings> {
        let listen = overrides
            .listen
            .clone()
            .or_else(|| self.server.listen.clone())
            .unwrap_or_else(|| DEFAULT_LISTEN.into());
        let listen: SocketAddr =
            listen.parse().with_context(|| format!("listen address {listen:?} is not IP:PORT"))?;
        let store = overrides
            .store
            .clone()
            .or_else(|| self.server.store.clone())
            .unwrap_or_else(|| DEFAULT_STORE.into());
        let mut tokens = self.server.tokens.clone().unwrap_or_default();
        if let Some(env) = &overrides.tokens_env {
            tokens
                .extend(env.split(',').map(str::trim).filter(|t| !t.is_empty()).map(String::from));
        }
        if tokens.iter().any(|t| t.chars().any(|c| c.is_whitespace() || c.is_control())) {
            bail!("tokens must not contain spaces or control characters");
        }
        Ok(Settings {
            listen,
            store,
            tokens,
            allow_inline_config: self.server.allow_inline_config.unwrap_or(true),
            allow_config_override: self.server.allow_config_override.unwrap_or(false),
            max_keys: self.server.max_keys,
            limits: self.limits(examples)?,
            fail_open: self
                .limits
                .iter()
                .filter(|(_, table)| table.fail_open)
                .map(|(name, _)| name.clone())
                .collect(),
        })
    }

    /// The named limits only (for the simulator).
    ///
    /// # Errors
    ///
    /// An invalid limit.
    pub fn named_limits(&self) -> anyhow::Result<Vec<(String, Config)>> {
        self.limits(false)
    }
}

/// The limits a server without a config file starts with, so that it can be tried at once.
pub fn example_limits() -> Vec<(String, Config)> {
    vec![
        ("example".into(), Config::token_bucket(10.0, MINUTE).with_capacity(3.0)),
        ("signup".into(), Config::fixed_window(100.0, HOUR)),
        ("llmTokens".into(), Config::token_bucket(40_000.0, MINUTE).with_shards(10)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_without_a_file() {
        let s = FileConfig::default().settings(&Overrides::default(), true).unwrap();
        assert_eq!(s.listen.to_string(), DEFAULT_LISTEN);
        assert_eq!(s.store, DEFAULT_STORE);
        assert!(s.tokens.is_empty());
        assert!(s.allow_inline_config);
        assert_eq!(s.limits.len(), 3);
    }

    #[test]
    fn file_then_flags_then_env() {
        let file = FileConfig::parse(
            r#"
            [server]
            listen = "127.0.0.1:9000"
            store = "memory"
            tokens = ["a"]
            allowInlineConfig = false

            [limits.send]
            kind = "token bucket"
            rate = 10
            period = "1m"
            capacity = 3
            "#,
        )
        .unwrap();
        let s = file.settings(&Overrides::default(), true).unwrap();
        assert_eq!(
            (s.listen.port(), s.store.as_str(), s.allow_inline_config),
            (9000, "memory", false)
        );
        assert_eq!(
            s.limits,
            vec![("send".into(), Config::token_bucket(10.0, MINUTE).with_capacity(3.0))]
        );
        let o = Overrides {
            listen: Some("127.0.0.1:9001".into()),
            store: Some("sqlite://x.db".into()),
            tokens_env: Some("b, c".into()),
        };
        let s = file.settings(&o, true).unwrap();
        assert_eq!((s.listen.port(), s.store.as_str()), (9001, "sqlite://x.db"));
        assert_eq!(s.tokens, ["a", "b", "c"]);
    }

    #[test]
    fn bad_files_say_where() {
        let err =
            FileConfig::parse("[limits.x]\nkind = \"token bucket\"\nrate = -1\nperiod = 1000\n")
                .unwrap()
                .settings(&Overrides::default(), true)
                .unwrap_err();
        assert_eq!(
            format!("{err:#}"),
            "[limits.x]: invalid config: rate is -1; it must be finite, at least 1e-9 and at most 1e15"
        );
        assert!(
            FileConfig::parse("[server]\nport = 1\n")
                .unwrap_err()
                .to_string()
                .contains("unknown field `port`")
        );
        let err = FileConfig::default()
            .settings(&Overrides { listen: Some("localhost".into()), ..Overrides::default() }, true)
            .unwrap_err();
        assert!(err.to_string().contains("is not IP:PORT"), "{err}");
    }
}

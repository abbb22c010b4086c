//! How limits are named to a person: a line of names for the log, the banner and
//! `check-config`, and a limit's `[limits.NAME]` table as TOML writes it.

/// The names of a config's limits for a line of the log, the banner or `check-config`: all of
/// them up to 20, else the first 20 and how many more (a config of a million limits once
/// logged every name at each reload).
pub fn names_line(names: &[&str]) -> String {
    const SHOWN: usize = 20;
    match names.len() {
        0 => "(none defined)".to_owned(),
        n if n <= SHOWN => names.join(", "),
        n => format!("{}, and {} more", names[..SHOWN].join(", "), n - SHOWN),
    }
}

/// `[limits.NAME]` as TOML writes it: a name that is not a bare key (letters, digits, `_`,
/// `-`) in quotes, so that `edge.user` is one table, not `user` in `edge`.
pub fn limits_table(name: &str) -> String {
    let bare = !name.is_empty()
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if bare {
        return format!("[limits.{name}]");
    }
    let mut quoted = String::with_capacity(name.len() + 2);
    for c in name.chars() {
        match c {
            '"' => quoted.push_str("\\\""),
            '\\' => quoted.push_str("\\\\"),
            c if c.is_control() => quoted.push_str(&format!("\\u{:04X}", u32::from(c))),
            c => quoted.push(c),
        }
    }
    format!("[limits.\"{quoted}\"]")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hint's table names the limit as TOML reads it back: a dotted or odd name quoted.
    #[test]
    fn a_limits_table_reads_back_as_its_name() {
        assert_eq!(limits_table("api"), "[limits.api]");
        for name in ["edge.user", "a b", "q\"uote", "back\\slash", "tab\there", "é"] {
            let table = limits_table(name);
            let text = format!("{table}\nkind = \"token bucket\"\nrate = 1\nperiod = 1000\n");
            let file = crate::config::FileConfig::parse(&text).unwrap();
            assert_eq!(file.named_limits().unwrap()[0].0, name, "{table}");
        }
        let names: Vec<String> = (0..25).map(|i| format!("l{i}")).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        assert!(names_line(&names).ends_with("l19, and 5 more"), "{}", names_line(&names));
        assert_eq!(names_line(&names[..2]), "l0, l1");
        assert_eq!(names_line(&[]), "(none defined)");
    }
}

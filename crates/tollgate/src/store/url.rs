//! Store URLs as messages show them: with their passwords left out.

/// A store URL fit to print: its password (`USER:PASSWORD@`) and any `…password=` parameter
/// replaced by `***`.
///
/// ```
/// assert_eq!(
///     tollgate::store::redacted_url("redis+sentinel://app:s3cret@h:26379/m?sentinel_password=x&replicas=1"),
///     "redis+sentinel://app:***@h:26379/m?sentinel_password=***&replicas=1"
/// );
/// assert_eq!(tollgate::store::redacted_url("sqlite://tollgate.db"), "sqlite://tollgate.db");
/// assert_eq!(tollgate::store::redacted_url("postgres://u@h/db"), "postgres://u@h/db");
/// assert_eq!(tollgate::store::redacted_url("postgres://:pw@h/db"), "postgres://:***@h/db");
/// ```
pub fn redacted_url(url: &str) -> String {
    let (head, query) = url.split_once('?').map_or((url, None), |(h, q)| (h, Some(q)));
    let mut out = match head.split_once("://") {
        Some((scheme, rest)) => match credentials_and_hosts(rest).0 {
            // A user without a password is shown as it is.
            Some(auth) => match auth.split_once(':') {
                Some((user, _)) => format!("{scheme}://{user}:***{}", &rest[auth.len()..]),
                None => head.to_string(),
            },
            None => head.to_string(),
        },
        None => head.to_string(),
    };
    if let Some(query) = query {
        let params: Vec<String> = query
            .split('&')
            .map(|p| match p.split_once('=') {
                Some((name, _)) if name.ends_with("password") => format!("{name}=***"),
                _ => p.to_string(),
            })
            .collect();
        out.push('?');
        out.push_str(&params.join("&"));
    }
    out
}

/// `[USER:PASSWORD@]HOST:PORT[,HOST:PORT…][/…]` (a URL after its scheme): the credentials,
/// if any, and the hosts.
pub(crate) fn credentials_and_hosts(rest: &str) -> (Option<&str>, &str) {
    let head = &rest[..rest.find('/').unwrap_or(rest.len())];
    match head.rsplit_once('@') {
        Some((auth, hosts)) => (Some(auth), hosts),
        None => (None, head),
    }
}

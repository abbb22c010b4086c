//! The IETF `RateLimit-Policy` and `RateLimit` header fields of a request's limits, bounded in
//! size: a transaction of thousands of limits (or a rate limit service call of thousands of
//! descriptors) would otherwise make header fields of 100 KB, which proxies reject with the
//! whole response. The draft lets a server list only the policies that matter; past
//! [`MAX_MEMBERS`] members or [`MAX_FIELD_BYTES`] bytes, the fields list the tightest ones
//! (the least left of their capacity), in the request's order.

use std::borrow::Cow;

use tollgate::Status;
use tollgate::tower::fields::status_member;

/// The most members each field lists.
pub const MAX_MEMBERS: usize = 8;

/// The most bytes each field may take: well inside the 4 KiB that some proxies (nginx's
/// `proxy_buffer_size`) give a whole response's header.
pub const MAX_FIELD_BYTES: usize = 1024;

/// One limit of a request, for the fields.
pub struct Member<'a> {
    /// The limit's name in the fields.
    pub name: &'a str,
    /// Its `RateLimit-Policy` member (see `tollgate::tower::fields::policy_member`).
    pub policy: Cow<'a, str>,
    /// Its capacity, to rank how tight it is.
    pub capacity: f64,
    /// How it stands.
    pub status: Status,
}

/// `RateLimit-Policy` and `RateLimit` for `members`, or none without members (or when their
/// numbers are not known: granted because the store failed, `Status::UNKNOWN`): all of them
/// when they fit, else the tightest that fit.
pub fn rate_limit_fields(members: &[Member<'_>]) -> Option<(String, String)> {
    if members.iter().any(|m| !m.status.is_known()) {
        return None;
    }
    match members {
        [] => return None,
        // The common case: one limit.
        [one] => return Some((one.policy.to_string(), status_member(one.name, &one.status))),
        _ => {}
    }
    let statuses: Vec<String> = members.iter().map(|m| status_member(m.name, &m.status)).collect();
    let size = |kept: &mut dyn Iterator<Item = usize>| {
        kept.fold((0, 0), |(p, s), i| (p + members[i].policy.len() + 2, s + statuses[i].len() + 2))
    };
    let (policy_bytes, status_bytes) = size(&mut (0..members.len()));
    let mut kept: Vec<usize> = (0..members.len()).collect();
    if members.len() > MAX_MEMBERS || policy_bytes.max(status_bytes) > MAX_FIELD_BYTES + 2 {
        // The least left of capacity first (a refused limit has 0 left), then the request's
        // order; the first always fits (a name is at most 256 bytes).
        let left = |i: usize| members[i].status.remaining / members[i].capacity;
        kept.sort_by(|&a, &b| left(a).total_cmp(&left(b)).then(a.cmp(&b)));
        let mut chosen = Vec::new();
        let (mut p, mut s) = (0, 0);
        for i in kept {
            if chosen.len() == MAX_MEMBERS {
                break;
            }
            let (dp, ds) = size(&mut std::iter::once(i));
            if !chosen.is_empty() && (p + dp).max(s + ds) > MAX_FIELD_BYTES + 2 {
                continue;
            }
            (p, s) = (p + dp, s + ds);
            chosen.push(i);
        }
        chosen.sort_unstable();
        kept = chosen;
    }
    let join = |parts: &mut dyn Iterator<Item = &str>| {
        let mut out = String::new();
        for part in parts {
            if !out.is_empty() {
                out.push_str(", ");
            }
            out.push_str(part);
        }
        out
    };
    let policy = join(&mut kept.iter().map(|&i| &*members[i].policy));
    let current = join(&mut kept.iter().map(|&i| statuses[i].as_str()));
    Some((policy, current))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate::tower::fields::policy_member;
    use tollgate::{Config, MINUTE};

    fn member(name: &str, capacity: f64, remaining: f64) -> Member<'_> {
        let config = Config::token_bucket(capacity, MINUTE);
        Member {
            name,
            policy: policy_member(name, &config).into(),
            capacity,
            status: Status { remaining, reset_after: 1_000.0 },
        }
    }

    #[test]
    fn a_few_members_are_all_listed_in_order() {
        let members = [member("a", 10.0, 9.0), member("b", 5.0, 0.0)];
        let (policy, current) = rate_limit_fields(&members).unwrap();
        assert_eq!(policy, "\"a\";q=10;w=60, \"b\";q=5;w=60");
        assert_eq!(current, "\"a\";r=9;t=1, \"b\";r=0;t=1");
        assert_eq!(rate_limit_fields(&[]), None);
    }

    #[test]
    fn many_members_list_the_tightest_within_the_bounds() {
        let names: Vec<String> = (0..3_000).map(|i| format!("limit{i:04}")).collect();
        // limit0100 has nothing left; then every 100th has little.
        let members: Vec<Member<'_>> = names
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let remaining = if i == 100 {
                    0.0
                } else if i % 100 == 0 {
                    1.0
                } else {
                    9.0
                };
                member(name, 10.0, remaining)
            })
            .collect();
        let (policy, current) = rate_limit_fields(&members).unwrap();
        assert!(policy.len() <= MAX_FIELD_BYTES && current.len() <= MAX_FIELD_BYTES);
        let listed: Vec<&str> = current.split(", ").map(|m| m.split(';').next().unwrap()).collect();
        assert_eq!(listed.len(), MAX_MEMBERS);
        // The empty one, then the nearly empty ones in order.
        assert_eq!(
            listed,
            [0, 100, 200, 300, 400, 500, 600, 700].map(|i| format!("\"limit{i:04}\"")).to_vec()
        );
        // Long names: fewer fit in the bytes.
        let long: Vec<String> = (0..10).map(|i| format!("{i}{}", "x".repeat(255))).collect();
        let members: Vec<Member<'_>> = long.iter().map(|n| member(n, 10.0, 5.0)).collect();
        let (policy, current) = rate_limit_fields(&members).unwrap();
        assert!(policy.len() <= MAX_FIELD_BYTES && current.len() <= MAX_FIELD_BYTES);
        assert_eq!(current.split(", ").count(), 3, "{current}");
        assert!(current.starts_with("\"0xxx"), "{current}");
    }
}

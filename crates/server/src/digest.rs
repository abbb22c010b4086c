//! The digest that stands for a value too long to keep whole: a rate limit service
//! descriptor's key, name or label, and a Redis protocol client's long key.

use std::fmt::Write as _;

/// The SHA-256 digest of `text`, in hex.
pub(crate) fn digest(text: &str) -> String {
    use sha2::Digest as _;
    let mut hex = String::with_capacity(64);
    for byte in sha2::Sha256::digest(text.as_bytes()) {
        let _ = write!(hex, "{byte:02x}");
    }
    hex
}

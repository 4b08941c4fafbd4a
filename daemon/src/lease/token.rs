//! Lease tokens: 256 bits from the OS's CSPRNG, shown once, stored only as a hash.

use rand::RngCore;
use sha2::{Digest, Sha256};

/// Prefix that makes a token recognisable in a leaked log (and greppable by scanners).
pub const PREFIX: &str = "tsr1_";

/// A new token: `tsr1_` + 64 hex digits (32 random bytes).
pub fn generate() -> String {
    let mut bytes = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut bytes);
    format!("{PREFIX}{}", hex::encode(bytes))
}

/// The hash under which a token is stored (SHA-256, hex).
pub fn hash(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// Cheap shape check before any lookup (length bounded, prefix, hex).
pub fn looks_valid(token: &str) -> bool {
    token.len() == PREFIX.len() + 64
        && token.starts_with(PREFIX)
        && token[PREFIX.len()..].bytes().all(|b| b.is_ascii_hexdigit())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_unique_well_formed_and_hash_stably() {
        let a = generate();
        let b = generate();
        assert_ne!(a, b);
        assert!(looks_valid(&a));
        assert_eq!(hash(&a), hash(&a));
        assert_ne!(hash(&a), hash(&b));
        assert!(!hash(&a).contains(&a[PREFIX.len()..]));
        assert!(!looks_valid("tsr1_xyz"));
        assert!(!looks_valid(&a.replace(PREFIX, "abc1_")));
    }
}

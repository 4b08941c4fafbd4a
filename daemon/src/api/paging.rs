//! ListLeases paging (AIP-158): page sizes, and page tokens that are opaque to
//! clients and that only this daemon run can have made.
//!
//! A token is hex of `version | filter hash | revision | created_at_ms | lease id`
//! followed by an HMAC-SHA256 (truncated to 16 bytes) under a key drawn at start.
//! The filter hash binds it to the listing's tenant, state and include_ended; the
//! revision is the first page's, which every later page answers; the (creation
//! time, id) pair is the last lease listed, where the next page goes on. A token
//! from before the daemon's last start fails its MAC like a forged one.

use rand::RngCore;
use sha2::{Digest, Sha256};

use crate::store::ListKey;

/// Leases in a page when the request names no size.
pub const DEFAULT_PAGE_SIZE: usize = 500;
/// The most leases in a page; a larger size asked is this.
pub const MAX_PAGE_SIZE: usize = 1000;

const VERSION: u8 = 1;
const MAC_LEN: usize = 16;
/// version + filter hash + revision + created_at_ms.
const FIXED_LEN: usize = 1 + 8 + 8 + 8;
/// A lease id longer than this is not one the daemon made.
const MAX_ID_LEN: usize = 256;

/// Why a page token is refused (INVALID_ARGUMENT).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error(
        "page_token is not a token this daemon issued (altered, or issued before it last started): list again from the first page"
    )]
    NotIssued,
    #[error(
        "page_token belongs to a listing with another tenant, state or include_ended: send the same fields as for the first page, or list again"
    )]
    OtherFilter,
}

/// Why a page size is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("page_size {0} is negative (0 = {DEFAULT_PAGE_SIZE}, at most {MAX_PAGE_SIZE})")]
pub struct NegativePageSize(pub i32);

/// The page size to use for `asked` (0 = the default; larger than the maximum =
/// the maximum).
pub fn page_size(asked: i32) -> Result<usize, NegativePageSize> {
    match usize::try_from(asked) {
        Err(_) => Err(NegativePageSize(asked)),
        Ok(0) => Ok(DEFAULT_PAGE_SIZE),
        Ok(n) => Ok(n.min(MAX_PAGE_SIZE)),
    }
}

/// Where a listing goes on, as a token carried it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    /// The revision of the listing's first page.
    pub revision: u64,
    /// The last lease listed.
    pub after: ListKey,
}

/// Issues and checks page tokens with a key of this daemon run.
pub struct PageTokens {
    key: [u8; 32],
}

impl std::fmt::Debug for PageTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageTokens").finish_non_exhaustive()
    }
}

impl Default for PageTokens {
    fn default() -> Self {
        let mut key = [0u8; 32];
        rand::rngs::OsRng.fill_bytes(&mut key);
        PageTokens { key }
    }
}

/// The listing's filter, hashed: a token is good only for the same one.
pub fn filter_hash(tenant: &str, state: i32, include_ended: bool) -> [u8; 8] {
    let d = Sha256::new()
        .chain_update(b"tessera.v1.ListLeases\0")
        .chain_update((tenant.len() as u64).to_be_bytes())
        .chain_update(tenant.as_bytes())
        .chain_update(state.to_be_bytes())
        .chain_update([u8::from(include_ended)])
        .finalize();
    let mut out = [0u8; 8];
    out.copy_from_slice(&d[..8]);
    out
}

impl PageTokens {
    fn mac(&self, msg: &[u8]) -> [u8; MAC_LEN] {
        // HMAC-SHA256 (RFC 2104) with a 32-byte key (shorter than the block).
        let mut ipad = [0x36u8; 64];
        let mut opad = [0x5cu8; 64];
        for (i, k) in self.key.iter().enumerate() {
            ipad[i] ^= k;
            opad[i] ^= k;
        }
        let inner = Sha256::new()
            .chain_update(ipad)
            .chain_update(msg)
            .finalize();
        let outer = Sha256::new()
            .chain_update(opad)
            .chain_update(inner)
            .finalize();
        let mut out = [0u8; MAC_LEN];
        out.copy_from_slice(&outer[..MAC_LEN]);
        out
    }

    /// The token of the page after `after` in the listing `filter` at `revision`.
    pub fn issue(&self, filter: &[u8; 8], revision: u64, after: &ListKey) -> String {
        let mut msg = Vec::with_capacity(FIXED_LEN + after.1.len() + MAC_LEN);
        msg.push(VERSION);
        msg.extend_from_slice(filter);
        msg.extend_from_slice(&revision.to_be_bytes());
        msg.extend_from_slice(&after.0.to_be_bytes());
        msg.extend_from_slice(after.1.as_bytes());
        let mac = self.mac(&msg);
        msg.extend_from_slice(&mac);
        hex::encode(msg)
    }

    /// The cursor `token` carries, if this daemon run issued it for `filter`.
    pub fn open(&self, token: &str, filter: &[u8; 8]) -> Result<Cursor, TokenError> {
        let raw = hex::decode(token).map_err(|_| TokenError::NotIssued)?;
        if raw.len() < FIXED_LEN + 1 + MAC_LEN || raw.len() > FIXED_LEN + MAX_ID_LEN + MAC_LEN {
            return Err(TokenError::NotIssued);
        }
        let (msg, mac) = raw.split_at(raw.len() - MAC_LEN);
        let want = self.mac(msg);
        // Compared in constant time.
        if want.iter().zip(mac).fold(0u8, |acc, (a, b)| acc | (a ^ b)) != 0 || msg[0] != VERSION {
            return Err(TokenError::NotIssued);
        }
        if msg[1..9] != filter[..] {
            return Err(TokenError::OtherFilter);
        }
        let be8 = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&msg[at..at + 8]);
            b
        };
        let revision = u64::from_be_bytes(be8(9));
        let created = i64::from_be_bytes(be8(17));
        let id = std::str::from_utf8(&msg[FIXED_LEN..]).map_err(|_| TokenError::NotIssued)?;
        Ok(Cursor {
            revision,
            after: (created, id.to_owned()),
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn a_token_carries_its_cursor_back() {
        let t = PageTokens::default();
        let f = filter_hash("team-a", 0, false);
        let tok = t.issue(&f, 42, &(1_700_000_000_000, "l-abc".into()));
        assert_eq!(
            t.open(&tok, &f).unwrap(),
            Cursor {
                revision: 42,
                after: (1_700_000_000_000, "l-abc".into())
            }
        );
    }

    #[test]
    fn altered_foreign_and_garbage_tokens_are_refused() {
        let t = PageTokens::default();
        let f = filter_hash("team-a", 0, false);
        let tok = t.issue(&f, 42, &(5, "l-abc".into()));
        // Every single altered hex digit is caught.
        for i in 0..tok.len() {
            let mut b = tok.clone().into_bytes();
            b[i] = if b[i] == b'0' { b'1' } else { b'0' };
            let altered = String::from_utf8(b).unwrap();
            assert_eq!(
                t.open(&altered, &f),
                Err(TokenError::NotIssued),
                "digit {i}"
            );
        }
        // Another daemon run (another key) made it.
        let other = PageTokens::default();
        assert_eq!(other.open(&tok, &f), Err(TokenError::NotIssued));
        // Another filter.
        for g in [
            filter_hash("team-b", 0, false),
            filter_hash("team-a", 2, false),
            filter_hash("team-a", 0, true),
        ] {
            assert_eq!(t.open(&tok, &g), Err(TokenError::OtherFilter));
        }
        for junk in ["", "zz", "00", &"ab".repeat(400)] {
            assert_eq!(t.open(junk, &f), Err(TokenError::NotIssued), "{junk:?}");
        }
    }

    #[test]
    fn page_sizes_default_clamp_and_refuse_negatives() {
        assert_eq!(page_size(0), Ok(DEFAULT_PAGE_SIZE));
        assert_eq!(page_size(7), Ok(7));
        assert_eq!(page_size(5000), Ok(MAX_PAGE_SIZE));
        assert_eq!(page_size(-1), Err(NegativePageSize(-1)));
    }
}

//! The DRA driver's prepared claims (table `dra_claims`): which leases a
//! ResourceClaim (by UID) was prepared with, so that NodePrepareResources answers the
//! same leases again after a retry or a restart of tesserad or kubelet, and
//! NodeUnprepareResources finds what to release.

use rusqlite::{OptionalExtension, params};

use super::dra_claim::DraClaim;
use super::{Store, StoreError, Writer, decode, decode_rows, encode};

impl Store {
    /// Every claim of the DRA driver.
    pub fn dra_claims(&self) -> Result<Vec<DraClaim>, StoreError> {
        self.read(|conn| decode_rows(conn, "dra claim", "SELECT uid, body FROM dra_claims"))
    }

    /// The claim of this UID, if recorded.
    pub fn dra_claim(&self, uid: &str) -> Result<Option<DraClaim>, StoreError> {
        self.read(|conn| {
            let body: Option<String> = conn
                .query_row(
                    "SELECT body FROM dra_claims WHERE uid = ?1",
                    params![uid],
                    |r| r.get(0),
                )
                .optional()?;
            body.map(|b| decode("dra claim", uid, &b)).transpose()
        })
    }
}

impl Writer<'_> {
    pub fn put_dra_claim(&self, c: &DraClaim) -> Result<(), StoreError> {
        let body = encode("dra claim", &c.uid, c)?;
        self.exec(
            "INSERT INTO dra_claims (uid, body) VALUES (?1, ?2) \
             ON CONFLICT(uid) DO UPDATE SET body = excluded.body",
            params![c.uid, body],
        )?;
        Ok(())
    }

    pub fn delete_dra_claim(&self, uid: &str) -> Result<(), StoreError> {
        self.exec("DELETE FROM dra_claims WHERE uid = ?1", params![uid])?;
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::store::DraDevice;

    #[test]
    fn a_claim_is_kept_until_deleted() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let c = DraClaim {
            uid: "u-1".into(),
            namespace: "ns".into(),
            name: "c".into(),
            tenant: "t".into(),
            nonce: "n".into(),
            prepared: true,
            devices: vec![DraDevice {
                requests: vec!["gpu".into()],
                pool: "node-1".into(),
                device: "gpu-0".into(),
                lease_id: "l-1".into(),
                token: "tok".into(),
            }],
            created_at_ms: 1,
        };
        let c2 = c.clone();
        store.write_blocking(move |w| w.put_dra_claim(&c2)).unwrap();
        drop(store);
        let store = Store::open(dir.path()).unwrap();
        assert_eq!(store.dra_claim("u-1").unwrap(), Some(c));
        store.write_blocking(|w| w.delete_dra_claim("u-1")).unwrap();
        assert!(store.dra_claims().unwrap().is_empty());
    }
}

//! The kubelet device plugin's devices (table `k8s_devices`): which device id stands
//! for which lease, its token (Allocate answers the same one every time kubelet asks),
//! and whether a pod was given it.

use super::k8s_device::K8sDevice;
use super::{Store, StoreError, Writer, decode_rows, encode};
use rusqlite::params;

impl Store {
    /// Every device of the plugin, oldest first.
    pub fn k8s_devices(&self) -> Result<Vec<K8sDevice>, StoreError> {
        self.read(|conn| {
            let mut out: Vec<K8sDevice> = decode_rows(
                conn,
                "k8s device",
                "SELECT device_id, body FROM k8s_devices",
            )?;
            out.sort_by(|a, b| {
                (a.created_at_ms, &a.device_id).cmp(&(b.created_at_ms, &b.device_id))
            });
            Ok(out)
        })
    }
}

impl Writer<'_> {
    pub fn put_k8s_device(&self, d: &K8sDevice) -> Result<(), StoreError> {
        let body = encode("k8s device", &d.device_id, d)?;
        self.exec(
            "INSERT INTO k8s_devices (device_id, lease_id, body) VALUES (?1, ?2, ?3) \
             ON CONFLICT(device_id) DO UPDATE SET lease_id = excluded.lease_id, body = excluded.body",
            params![d.device_id, d.lease_id, body],
        )?;
        Ok(())
    }

    pub fn delete_k8s_device(&self, device_id: &str) -> Result<(), StoreError> {
        self.exec(
            "DELETE FROM k8s_devices WHERE device_id = ?1",
            params![device_id],
        )?;
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn devices_outlive_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let d = K8sDevice {
            device_id: "l-1".into(),
            class: "mig-1g.10gb".into(),
            lease_id: "l-1".into(),
            token: "t".into(),
            allocated: true,
            pod: Some(("team-a".into(), "p".into())),
            unseen_since_ms: None,
            created_at_ms: 5,
        };
        {
            let store = Store::open(dir.path()).unwrap();
            let d2 = d.clone();
            store
                .write_blocking(move |w| w.put_k8s_device(&d2))
                .unwrap();
            store.close();
        }
        let store = Store::open(dir.path()).unwrap();
        assert_eq!(store.k8s_devices().unwrap(), vec![d]);
        store
            .write_blocking(|w| w.delete_k8s_device("l-1"))
            .unwrap();
        assert!(store.k8s_devices().unwrap().is_empty());
    }
}

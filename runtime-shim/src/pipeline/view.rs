//! The spec's view: the tenant's config.json parsed once, with what the rest of the
//! pipeline asks of it (its lease tokens, its pod, whether it is a pod's sandbox).

use crate::bundle::{self, BundleError};
use crate::config::RuntimeConfig;
use crate::harden::{self, TokenError};
use crate::lease::LeaseError;
use serde_json::Value;
use std::path::Path;
use thiserror::Error;

/// Why the spec cannot be read.
#[derive(Debug, Error)]
pub enum ViewError {
    #[error(transparent)]
    Bundle(#[from] BundleError),
    #[error(transparent)]
    Token(#[from] TokenError),
    #[error(transparent)]
    Tokens(#[from] LeaseError),
}

/// The tenant's spec and what it names.
#[derive(Debug, Clone)]
pub struct SpecView {
    pub spec: Value,
    /// Its lease tokens (one, or several joined by ',': a container with several
    /// devices); none for a pod's sandbox.
    pub tokens: Vec<String>,
    /// The pod it belongs to (CRI annotations); `None` outside Kubernetes.
    pub pod: Option<String>,
    /// A Kubernetes pod's sandbox (pause) container carries the pod's annotations too;
    /// it runs no tenant code, so it gets the baseline hardening and never the GPU.
    pub sandbox: bool,
}

impl SpecView {
    /// Load the bundle's spec (parse `tenant`, its bytes as already read, if given) and
    /// find its tokens, pod and sandbox status.
    pub fn read(
        bundle: &Path,
        tenant: Option<&[u8]>,
        id: &str,
        cfg: &RuntimeConfig,
    ) -> Result<Self, ViewError> {
        let spec = match tenant {
            Some(bytes) => bundle::parse_object(&bundle.join(bundle::CONFIG_JSON), bytes),
            None => bundle::load(bundle, cfg.policy.max_config_bytes),
        }?;
        let mut tokens = match harden::find_token(&spec)? {
            Some(t) => crate::lease::parse_tokens(&t)?,
            None => Vec::new(),
        };
        let sandbox = harden::is_cri_sandbox(&spec, id, &cfg.policy);
        if sandbox {
            tokens.clear();
        }
        let pod = harden::pod_of(&spec);
        Ok(Self {
            spec,
            tokens,
            pod,
            sandbox,
        })
    }
}

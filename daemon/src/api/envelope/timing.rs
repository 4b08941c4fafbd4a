//! How long each API call takes, for `tessera_api_call_duration_seconds`.
//!
//! A wrapper around the generated `TesseraServer`: it reads the method from the
//! request's path, times the inner service's future (from the request's arrival to
//! the response's headers: the whole call for a unary RPC, the first answer for a
//! stream) and records it. The method becomes a label only when it is one of the
//! API's own RPC names (a client may send any path), otherwise "other".
//!
//! Owns: the latency measurement of the tessera.v1 service. May use: metrics, auth's
//! list of RPCs.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use tonic::codegen::http;
use tonic::server::NamedService;

use crate::api::auth::Rpc;
use crate::metrics::Metrics;

/// The service `S`, each call timed into `metrics`.
#[derive(Debug, Clone)]
pub struct Timed<S> {
    inner: S,
    metrics: Arc<Metrics>,
}

impl<S> Timed<S> {
    pub fn new(inner: S, metrics: Arc<Metrics>) -> Self {
        Timed { inner, metrics }
    }
}

impl<S: NamedService> NamedService for Timed<S> {
    const NAME: &'static str = S::NAME;
}

/// The RPC a request path names ("/tessera.v1.Tessera/CreateLease" -> "CreateLease"),
/// or "other" for any path that is not one of the API's methods.
pub fn rpc_label(path: &str) -> &'static str {
    let method = path.rsplit('/').next().unwrap_or_default();
    Rpc::ALL
        .iter()
        .map(|r| r.name())
        .find(|n| *n == method)
        .unwrap_or("other")
}

impl<S, B> tower::Service<http::Request<B>> for Timed<S>
where
    S: tower::Service<http::Request<B>> + Send,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let rpc = rpc_label(req.uri().path());
        let started = Instant::now();
        let metrics = self.metrics.clone();
        let fut = self.inner.call(req);
        Box::pin(async move {
            let r = fut.await;
            metrics.record_latency(rpc, started.elapsed().as_secs_f64());
            r
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_apis_own_methods_become_labels() {
        assert_eq!(rpc_label("/tessera.v1.Tessera/CreateLease"), "CreateLease");
        assert_eq!(rpc_label("/tessera.v1.Tessera/WatchLeases"), "WatchLeases");
        assert_eq!(rpc_label("/tessera.v1.Tessera/NoSuchCall"), "other");
        assert_eq!(rpc_label("/x/y/a-very-long-made-up-name"), "other");
        assert_eq!(rpc_label(""), "other");
    }
}

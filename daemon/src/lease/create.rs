//! CreateLease: check the request, answer a retry of an earlier call, then decide
//! and act until the lease is placed or refused. The decision (`admission.rs`)
//! returns a [`Plan`]; the executor (`executor.rs`) runs it. The request and plan
//! types are in `plan.rs`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_common::clock::now_ms;
use tokio::sync::Notify;
use tracing::info;

use crate::config::TenancyConfig;
use crate::names::{new_id, truncate};
use crate::partition::Shape;

use super::error::{LeaseError, invalid};
use super::manager::LeaseManager;
use super::plan::{Ask, CreateRequest, Created, Plan};
use super::queue::{Ticket, queue_key};
use super::table::State;
use super::validate::validate_create;
use super::{quota, token};

/// A request after its checks: new (its shape resolved, and its ttl), or a retry
/// of an earlier call and the answer to give.
enum Checked {
    New(Shape, Duration),
    Retry(Box<Created>),
}

impl LeaseManager {
    /// CreateLease. Steps: check the request; answer a retry of an earlier call;
    /// refuse a shape no GPU's mode can take; then decide and act until a plan
    /// places the lease (preempting burst leases, moving idle ones or waiting for
    /// teardowns at most three times each) and the executor runs it: intent,
    /// hardware, outcome, publish.
    pub async fn create(&self, mut req: CreateRequest) -> Result<Created, LeaseError> {
        if self.shutting_down.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(LeaseError::ShuttingDown);
        }
        super::exact::pin(&mut req)?;
        let (shape, ttl) = match self.check(&mut req).await? {
            Checked::New(shape, ttl) => (shape, ttl),
            Checked::Retry(answer) => return Ok(*answer),
        };
        let tenancy = self.tenancy();
        let priority_class = self.priority_class_of(&req, &tenancy)?;
        let ask = Ask {
            req: &req,
            shape,
            ttl,
            priority_class,
            lease_id: new_id("l-"),
            partition_id: new_id("p-"),
            now: now_ms(),
            count: req.count.max(1),
        };
        // A shape no GPU's mode can take is refused before anything is held.
        self.refuse_wrong_mode(&ask.shape, req.gpu_index)?;
        // MPS inside MIG: its host instance first (held until the share is reserved).
        let host_claim = self.ensure_mig_mps_host(&ask, &tenancy).await?;
        let notify = Arc::new(Notify::new());
        let extra = self.grants_extra(&req.tenant, ask.now);
        let (mut rounds, mut holding) = (0u32, false);
        let placed = loop {
            let plan = self.reserve(&ask, &tenancy, extra, (rounds, holding), &notify)?;
            // A preemption or a wait holds the capacity it frees until the next
            // decision.
            holding = matches!(plan, Plan::Preempt(_) | Plan::WaitTeardowns);
            match plan {
                Plan::Place(placed) => break placed,
                Plan::Preempt(victims) => self.preempt(&victims, &req.tenant).await,
                Plan::Move(moves, refusal) => self.make_room(&moves, &refusal).await?,
                Plan::WaitTeardowns => self.wait_for_teardowns(Duration::from_secs(5)).await,
                // A call with the same request id reserved first: answered as its
                // retry, or decided again when that call failed.
                Plan::SameRequest => match self.answer_retry(&req).await? {
                    Some(answer) => return Ok(answer),
                    None => continue,
                },
            }
            rounds += 1;
        };
        drop(host_claim);
        self.execute(*placed, ask.now).await
    }

    /// The checks of a request that need no capacity. A request by need is
    /// answered as a retry before its need is resolved (with the lease the first
    /// call got, whatever fits now); one by shape after its checks.
    async fn check(&self, req: &mut CreateRequest) -> Result<Checked, LeaseError> {
        if let Some(need) = req.need.take() {
            if req.shape.is_some() {
                return Err(invalid("shape", "give a shape or a need, not both"));
            }
            need.validate()?;
            if let Some(answer) = self.answer_retry(req).await? {
                return Ok(Checked::Retry(Box::new(answer)));
            }
            req.shape = Some(self.resolve_need(&need, req.gpu_index)?);
            let (shape, ttl) = validate_create(req, &self.config.lease)?;
            return Ok(Checked::New(shape, ttl));
        }
        let (shape, ttl) = validate_create(req, &self.config.lease)?;
        match self.answer_retry(req).await? {
            Some(answer) => Ok(Checked::Retry(Box::new(answer))),
            None => Ok(Checked::New(shape, ttl)),
        }
    }

    /// An earlier call with the same (tenant, request id): wait for it while it is
    /// still being created, then replay it (a fresh token for a live lease, none for
    /// an ended one). `None`: no such call, go on and create.
    ///
    /// A live lease is in memory (reserved there before it reaches the store); an
    /// ended one only in the store. The memory check and the store read are not one
    /// atomic step: a first call can reserve and write its lease between them, so a
    /// live lease read from the store sends this call back to the memory check
    /// rather than being answered as an ended lease without a token.
    async fn answer_retry(&self, req: &CreateRequest) -> Result<Option<Created>, LeaseError> {
        let Some(rid) = &req.request_id else {
            return Ok(None);
        };
        let key = (req.tenant.clone(), rid.clone());
        let mut rounds = 0u32;
        loop {
            let wait = {
                let st = self.read();
                st.requests
                    .get(&key)
                    .cloned()
                    .map(|lid| match st.pending.get(&lid) {
                        Some(n) => Ok(n.clone().notified_owned()),
                        None => Err(lid),
                    })
            };
            match wait {
                Some(Ok(notified)) => {
                    notified.await;
                    continue;
                }
                Some(Err(lid)) => return self.replay(&lid).await.map(Some),
                None => {}
            }
            match self.store.find_by_request(&req.tenant, rid)? {
                None => return Ok(None),
                Some(l) if l.state().is_live() => {
                    // Reserved and written since the memory check, or ended and
                    // not yet written as ended: look again.
                    rounds += 1;
                    if rounds > 100 {
                        return Err(LeaseError::FailedPrecondition(format!(
                            "lease {} for this request_id is changing state; retry",
                            l.id
                        )));
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Some(l) => {
                    return Ok(Some(Created {
                        lease: l,
                        partition: None,
                        token: None,
                        replayed: true,
                    }));
                }
            }
        }
    }

    /// The request's priority class (else its tenant's, else the default), which
    /// must exist and may not exceed the tenant's own.
    fn priority_class_of(
        &self,
        req: &CreateRequest,
        tenancy: &TenancyConfig,
    ) -> Result<String, LeaseError> {
        let class = match req.priority_class.as_deref() {
            Some(c) if !c.is_empty() => c.to_string(),
            _ => tenancy
                .tenants
                .get(&req.tenant)
                .map(|q| q.priority_class.clone())
                .unwrap_or_else(|| tenancy.default_priority_class.clone()),
        };
        if !tenancy.priority_classes.contains_key(&class) {
            let known: Vec<&str> = tenancy
                .priority_classes
                .keys()
                .map(String::as_str)
                .collect();
            return Err(invalid(
                "priority_class",
                format!(
                    "{:?} is not one of {}",
                    truncate(&class, 64),
                    known.join(", ")
                ),
            ));
        }
        if let Some(q) = tenancy.tenants.get(&req.tenant)
            && quota::priority(tenancy, &class) > quota::priority(tenancy, &q.priority_class)
        {
            return Err(LeaseError::PermissionDenied(format!(
                "tenant {:?} may use priority classes up to {:?}, not {class:?}",
                req.tenant, q.priority_class
            )));
        }
        Ok(class)
    }

    /// ModeUnavailable when no GPU considered (every GPU of the node, healthy or not,
    /// or the one asked for) is in the mode `shape` needs: only an operator's mode
    /// change would let it succeed, so it is not a capacity refusal.
    pub(super) fn refuse_wrong_mode(
        &self,
        shape: &Shape,
        gpu_index: Option<u32>,
    ) -> Result<(), LeaseError> {
        wrong_mode(&self.read(), shape, gpu_index)
    }

    pub(super) async fn replay(&self, lease_id: &str) -> Result<Created, LeaseError> {
        let (lease, partition) = self.get(lease_id)?;
        if !lease.state().is_live() {
            return Ok(Created {
                lease,
                partition,
                token: None,
                replayed: true,
            });
        }
        let tok = token::generate();
        let h = token::hash(&tok);
        let (h2, lid) = (h.clone(), lease.id.clone());
        let now = now_ms();
        self.store
            .write(move |w| w.add_token(&h2, &lid, now))
            .await?;
        self.change().tokens.insert(h, lease.id.clone());
        Ok(Created {
            lease,
            partition,
            token: Some(tok),
            replayed: true,
        })
    }

    /// CreateLease calls waiting in the admission queue now.
    pub fn queued_requests(&self) -> usize {
        self.queue.len()
    }

    /// [`LeaseManager::create`], waiting up to `wait` for room when it is refused for
    /// lack of it (see `queue.rs`). `wait` is at most `lease.max_queue_wait`.
    pub async fn create_queued(
        self: &Arc<Self>,
        req: CreateRequest,
        wait: Duration,
    ) -> Result<Created, LeaseError> {
        let max = self.config.lease.max_queue_wait;
        if wait > max {
            return Err(invalid(
                "queue_wait_ms",
                format!(
                    "{} ms is longer than this node's lease.max_queue_wait ({} ms)",
                    wait.as_millis(),
                    max.as_millis()
                ),
            ));
        }
        // A shape no GPU's mode can take does not wait (its key may have requests
        // ahead of it that would make it wait before its first try).
        if let Some(shape) = &req.shape {
            self.refuse_wrong_mode(shape, req.gpu_index)?;
        }
        let lease = &self.config.lease;
        match self.queue.enter(
            queue_key(&req),
            &req.tenant,
            lease.max_queued_per_tenant,
            lease.max_queued,
        ) {
            Ok(ticket) => self.wait_for_room(req, wait, ticket).await,
            // No place to wait: one try, as without a wait.
            Err(LeaseError::ResourceExhausted(full)) => {
                match self.create_to_the_end(req, "create").await {
                    Err(LeaseError::ResourceExhausted(m)) => Err(LeaseError::ResourceExhausted(
                        format!("{m}; it cannot wait for room: {full}"),
                    )),
                    other => other,
                }
            }
            Err(e) => Err(e),
        }
    }

    /// Holding `ticket`: try whenever it is the oldest of its key and room may have
    /// come, until a try is not refused for lack of room or `wait` has passed.
    async fn wait_for_room(
        self: &Arc<Self>,
        req: CreateRequest,
        wait: Duration,
        ticket: Ticket<'_>,
    ) -> Result<Created, LeaseError> {
        let started = Instant::now();
        let deadline = tokio::time::Instant::now() + wait;
        let mut refusal = String::new();
        let mut tries = 0u32;
        loop {
            // Registered before the try, so a lease ending during it is not missed.
            let room = self.queue.room.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            if ticket.first_of_its_key() {
                tries += 1;
                match self.create_to_the_end(req.clone(), "queued create").await {
                    Err(LeaseError::ResourceExhausted(m)) => refusal = m,
                    other => {
                        if tries > 1 {
                            info!(
                                tenant = %req.tenant,
                                waited_ms = started.elapsed().as_millis() as u64,
                                ok = other.is_ok(),
                                "queued create request served"
                            );
                        }
                        return other;
                    }
                }
            }
            if tokio::time::timeout_at(deadline, room).await.is_err() {
                drop(ticket);
                if refusal.is_empty() {
                    refusal = "older requests for the same shape were still waiting".into();
                }
                return Err(LeaseError::ResourceExhausted(format!(
                    "no room within the queue wait of {} ms: {refusal}",
                    wait.as_millis()
                )));
            }
        }
    }

    /// One [`LeaseManager::create`], run to its end even if the caller goes away: a
    /// create cut off between its steps would stay half done.
    async fn create_to_the_end(
        self: &Arc<Self>,
        req: CreateRequest,
        what: &str,
    ) -> Result<Created, LeaseError> {
        let this = self.clone();
        match tokio::spawn(async move { this.create(req).await }).await {
            Ok(outcome) => outcome,
            Err(e) => Err(LeaseError::FailedPrecondition(format!(
                "the {what} did not finish: {e}"
            ))),
        }
    }
}

/// [`LeaseManager::refuse_wrong_mode`] over the table `st`.
fn wrong_mode(st: &State, shape: &Shape, gpu_index: Option<u32>) -> Result<(), LeaseError> {
    // A GPU that could not be read has no known mode: the health check that
    // follows names why it takes nothing.
    if let Some(g) = gpu_index
        && st
            .gpus
            .iter()
            .any(|x| x.info.index == g && x.info.fault.is_some())
    {
        return Ok(());
    }
    let infos: Vec<&crate::gpu::GpuInfo> = st
        .gpus
        .iter()
        .map(|g| &g.info)
        .filter(|i| i.fault.is_none())
        .collect();
    match crate::partition::mode_unavailable(shape, &infos, gpu_index) {
        Some(why) => Err(LeaseError::ModeUnavailable(why)),
        None => Ok(()),
    }
}

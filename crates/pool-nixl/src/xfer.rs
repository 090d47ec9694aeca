//! One NIXL transfer from creation to completion: build the descriptor lists, post, poll
//! without blocking the executor, bounded by a deadline, and never release a request (and so
//! never let the caller free or reuse its buffer) while NIXL may still be moving bytes.

use std::time::{Duration, Instant};

use kvferry_pool::PoolError;
use nixl_sys::{Agent, MemType, XferDescList, XferOp, XferRequest, XferStatus};

use crate::BACKEND;
use crate::agent::{fatal, transfer_error};

/// Poll with `yield_now` this long before switching to short sleeps: small transfers finish
/// within microseconds and a timer tick (1 ms in tokio) would dominate them.
const SPIN: Duration = Duration::from_micros(300);
/// Sleep between polls after `SPIN`.
const POLL_SLEEP: Duration = Duration::from_micros(250);
/// After a timeout, how long `Drop` still waits for NIXL to settle before releasing.
const TIMEOUT_GRACE: Duration = Duration::from_millis(200);
/// Upper bound on how long a dropped (cancelled) transfer blocks its dropper.
const MAX_DRAIN: Duration = Duration::from_secs(10);

/// A transfer's descriptors: `(local addr, remote addr, len)` triples, remote on `dev`.
#[derive(Debug, Default)]
pub(crate) struct Plan {
    pub(crate) pieces: Vec<(usize, usize, usize)>,
    pub(crate) remote_dev: Vec<u64>,
}

impl Plan {
    pub(crate) fn push(&mut self, local: usize, remote: usize, len: usize, dev: u64) {
        self.pieces.push((local, remote, len));
        self.remote_dev.push(dev);
    }
}

/// Run `plan` as one NIXL request (`op` is from the daemon's side: READ pulls remote bytes into
/// the local buffer, WRITE pushes local bytes out) and wait for it until `timeout` passes.
///
/// The caller must keep the local buffer alive and unaliased until this future completes or is
/// dropped; dropping it mid-transfer blocks (bounded) until NIXL is done with the buffer.
pub(crate) async fn run(
    agent: &Agent,
    peer: &str,
    op: XferOp,
    remote_type: MemType,
    plan: &Plan,
    timeout: Duration,
) -> Result<(), PoolError> {
    if plan.pieces.is_empty() {
        return Ok(());
    }
    let deadline = Instant::now() + timeout;
    // The descriptor lists are not `Send`: build and drop them before the first await.
    let req = create(agent, peer, op, remote_type, plan)?;
    let mut inflight = InFlight { agent, req, finished: false, drain: timeout.min(MAX_DRAIN) };
    match agent.post_xfer_req(&inflight.req, None) {
        Ok(false) => {
            inflight.finished = true;
            return Ok(());
        }
        Ok(true) => {}
        // NIXL refuses to post once the peer has disconnected (engine exited): retrying this
        // backend cannot help; the engine must be attached again with fresh metadata.
        Err(e) => {
            return Err(fatal(format!("post {op:?} to {peer:?} (engine disconnected or gone?)"), e));
        }
    }
    let start = Instant::now();
    loop {
        match agent.get_xfer_status(&inflight.req) {
            Ok(XferStatus::Success) => {
                inflight.finished = true;
                return Ok(());
            }
            Ok(XferStatus::InProgress) => {}
            Err(e) => {
                inflight.finished = true;
                return Err(transfer_error(format!("{op:?} with {peer:?} failed"), e));
            }
        }
        let now = Instant::now();
        if now >= deadline {
            inflight.drain = TIMEOUT_GRACE;
            return Err(PoolError::Backend {
                backend: BACKEND,
                retryable: true,
                detail: format!(
                    "{op:?} with {peer:?} still in progress after {timeout:?} (peer hung or gone?)"
                ),
            });
        }
        pause(now - start).await;
    }
}

fn create(
    agent: &Agent,
    peer: &str,
    op: XferOp,
    remote_type: MemType,
    plan: &Plan,
) -> Result<XferRequest, PoolError> {
    let mut local = XferDescList::new(MemType::Dram).map_err(|e| fatal("create local descriptor list", e))?;
    let mut remote = XferDescList::new(remote_type).map_err(|e| fatal("create remote descriptor list", e))?;
    for (&(l, r, len), &dev) in plan.pieces.iter().zip(&plan.remote_dev) {
        local.add_desc(l, len, 0);
        remote.add_desc(r, len, dev);
    }
    agent.create_xfer_req(op, &local, &remote, peer, None).map_err(|e| {
        fatal(
            format!(
                "create {op:?} request with {peer:?} ({} descriptors): the engine's registration does \
                 not cover them (deregistered or metadata invalidated?)",
                plan.pieces.len()
            ),
            e,
        )
    })
}

/// Yield to the executor between polls: first by rescheduling at once, then by short sleeps.
async fn pause(elapsed: Duration) {
    if elapsed < SPIN {
        tokio::task::yield_now().await;
    } else if tokio::runtime::Handle::try_current().is_ok() {
        tokio::time::sleep(POLL_SLEEP).await;
    } else {
        // Not on a tokio runtime (another executor): a short blocking nap keeps us correct.
        std::thread::sleep(POLL_SLEEP);
    }
}

/// A posted request; dropping it before completion waits (bounded) for NIXL to finish with the
/// buffers before the request is released.
struct InFlight<'a> {
    agent: &'a Agent,
    req: XferRequest,
    finished: bool,
    drain: Duration,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        let until = Instant::now() + self.drain;
        while Instant::now() < until {
            match self.agent.get_xfer_status(&self.req) {
                Ok(XferStatus::InProgress) => std::thread::sleep(Duration::from_micros(50)),
                _ => break,
            }
        }
        // `req` drops next: NIXL releases it, aborting whatever is still pending.
    }
}

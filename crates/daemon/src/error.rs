//! The daemon's errors and their one mapping to gRPC statuses. Every handler returns
//! [`DaemonError`]; nothing else builds a `tonic::Status` from an error (the one exception is
//! the fault-injection Load failure in test builds).
//!
//! An error's variant is its gRPC class; each carries a [`Fault`]: where it came from
//! ([`Origin`]), whether the same request can succeed later (`retryable`), and the reason.
//! The errors of the layers below are mapped here and nowhere else: [`PoolError`],
//! [`CudaError`](kvferry_pool_cuda::CudaError), [`WireError`] (a fetch's and a query's, with
//! retryability from [`WireError::retryable`]) and [`PlanError`]. A status carries the origin
//! and retryability as metadata (`kvferry-origin`, `kvferry-retryable`) beside its code.

use kvferry_model::PlanError;
use kvferry_pool::PoolError;
use kvferry_wire::WireError;
use thiserror::Error;

/// Where a failure came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The caller's request: malformed, names what is not here, or out of time.
    Request,
    /// This daemon's own resources: landing zone, staging, concurrency limits, host drivers.
    Local,
    /// An engine attached to this daemon: its pool, its recompute, its attachment.
    Engine,
    /// A peer region: its answer or the link to it.
    Peer,
    /// A broken invariant of this daemon (a bug).
    Internal,
}

impl Origin {
    /// The lowercase name (the `kvferry-origin` metadata value).
    pub fn as_str(self) -> &'static str {
        match self {
            Origin::Request => "request",
            Origin::Local => "local",
            Origin::Engine => "engine",
            Origin::Peer => "peer",
            Origin::Internal => "internal",
        }
    }
}

/// What an error says beside its class.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    /// Where it came from.
    pub origin: Origin,
    /// Whether the same request can succeed if sent again later.
    pub retryable: bool,
    /// Why, for a person.
    pub reason: String,
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.reason)
    }
}

/// Why a request was refused by policy (the `kvferry-reason` metadata of a PERMISSION_DENIED
/// status).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Denial {
    /// This region's `peers[].tenants` for that peer does not name the tenant: the peer was
    /// not asked.
    TenantNotAllowedForPeer,
    /// The peer refused the tenant (its own allow-list for this region), before any KV byte.
    PeerRefusedTenant,
}

impl Denial {
    /// The metadata value.
    pub fn as_str(self) -> &'static str {
        match self {
            Denial::TenantNotAllowedForPeer => "tenant_not_allowed_for_peer",
            Denial::PeerRefusedTenant => "peer_refused_tenant",
        }
    }
}

/// Why a request failed, by gRPC class.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DaemonError {
    #[error("invalid argument: {0}")]
    Invalid(Fault),
    #[error("not found: {0}")]
    NotFound(Fault),
    #[error("precondition failed: {0}")]
    Precondition(Fault),
    #[error("deadline exceeded: {0}")]
    Deadline(Fault),
    #[error("resource exhausted: {0}")]
    Exhausted(Fault),
    #[error("unavailable: {0}")]
    Unavailable(Fault),
    #[error("unauthenticated: {0}")]
    Unauthenticated(Fault),
    #[error("permission denied: {0}")]
    Denied(Fault, Denial),
    #[error("internal: {0}")]
    Internal(Fault),
}

/// The [`Fault`] of any variant (by reference or mutably, as `$e` is).
macro_rules! fault_of {
    ($e:expr) => {
        match $e {
            DaemonError::Invalid(f)
            | DaemonError::NotFound(f)
            | DaemonError::Precondition(f)
            | DaemonError::Deadline(f)
            | DaemonError::Exhausted(f)
            | DaemonError::Unavailable(f)
            | DaemonError::Unauthenticated(f)
            | DaemonError::Denied(f, _)
            | DaemonError::Internal(f) => f,
        }
    };
}

fn fault(origin: Origin, retryable: bool, reason: impl Into<String>) -> Fault {
    Fault { origin, retryable, reason: reason.into() }
}

impl DaemonError {
    /// A malformed request. Never retryable.
    pub fn invalid(reason: impl Into<String>) -> Self {
        Self::Invalid(fault(Origin::Request, false, reason))
    }

    /// The request names what is not here (region, engine, lease, block). Not retryable.
    pub fn not_found(reason: impl Into<String>) -> Self {
        Self::NotFound(fault(Origin::Request, false, reason))
    }

    /// The request does not fit the state here (fingerprint, model). Not retryable.
    pub fn precondition(reason: impl Into<String>) -> Self {
        Self::Precondition(fault(Origin::Request, false, reason))
    }

    /// The request's deadline passed. Not retryable as sent (the same deadline ends the same way).
    pub fn deadline(reason: impl Into<String>) -> Self {
        Self::Deadline(fault(Origin::Request, false, reason))
    }

    /// A bound of this daemon is reached (landing zone, concurrent migrations). Retryable:
    /// the bound frees up.
    pub fn exhausted(reason: impl Into<String>) -> Self {
        Self::Exhausted(fault(Origin::Local, true, reason))
    }

    /// Something needed is not there now (engine detached, peer down). Retryable.
    pub fn unavailable(origin: Origin, reason: impl Into<String>) -> Self {
        Self::Unavailable(fault(origin, true, reason))
    }

    /// No valid credentials. Not retryable.
    pub fn unauthenticated(reason: impl Into<String>) -> Self {
        Self::Unauthenticated(fault(Origin::Request, false, reason))
    }

    /// Refused by policy (`why`), from `origin` (this region's config, or the peer's). Not
    /// retryable: the same request meets the same policy.
    pub fn denied(origin: Origin, why: Denial, reason: impl Into<String>) -> Self {
        Self::Denied(fault(origin, false, reason), why)
    }

    /// A broken invariant of this daemon. Not retryable.
    pub fn internal(reason: impl Into<String>) -> Self {
        Self::Internal(fault(Origin::Internal, false, reason))
    }

    /// The same error with another origin.
    pub fn at(mut self, origin: Origin) -> Self {
        self.fault_mut().origin = origin;
        self
    }

    /// The same error with another retryability.
    pub fn retry(mut self, retryable: bool) -> Self {
        self.fault_mut().retryable = retryable;
        self
    }

    /// Origin, retryability and reason.
    pub fn fault(&self) -> &Fault {
        fault_of!(self)
    }

    fn fault_mut(&mut self) -> &mut Fault {
        fault_of!(self)
    }

    /// Where it came from.
    pub fn origin(&self) -> Origin {
        self.fault().origin
    }

    /// Whether the same request can succeed later.
    pub fn retryable(&self) -> bool {
        self.fault().retryable
    }

    /// The reason alone, without the class.
    pub fn reason(&self) -> &str {
        &self.fault().reason
    }

    /// The gRPC status code of this class.
    pub fn code(&self) -> tonic::Code {
        use tonic::Code;
        match self {
            Self::Invalid(_) => Code::InvalidArgument,
            Self::NotFound(_) => Code::NotFound,
            Self::Precondition(_) => Code::FailedPrecondition,
            Self::Deadline(_) => Code::DeadlineExceeded,
            Self::Exhausted(_) => Code::ResourceExhausted,
            Self::Unavailable(_) => Code::Unavailable,
            Self::Unauthenticated(_) => Code::Unauthenticated,
            Self::Denied(..) => Code::PermissionDenied,
            Self::Internal(_) => Code::Internal,
        }
    }

    /// A fetch from `src` failed. A deadline is the request's running out; anything else
    /// leaves the prefix unavailable from that source: the peer's fault unless the failure was
    /// this side's ([`WireError::Local`]). Retryable as [`WireError::retryable`] says.
    pub fn from_fetch(src: &str, e: &WireError) -> Self {
        let retryable = e.retryable();
        let origin = if matches!(e, WireError::Local(_)) { Origin::Local } else { Origin::Peer };
        match e {
            WireError::DeadlineExceeded => Self::Deadline(fault(
                Origin::Request,
                retryable,
                "the fetch did not finish before the deadline",
            )),
            WireError::Refused { code: kvferry_wire::frame::RefusalCode::NotAuthorized, detail } => {
                Self::denied(
                    Origin::Peer,
                    Denial::PeerRefusedTenant,
                    format!("fetch from {src} refused: {detail}"),
                )
            }
            other => Self::Unavailable(fault(origin, retryable, format!("fetch from {src}: {other}"))),
        }
    }

    /// Asking `region` what it holds failed: a typed refusal, or no answer. Never a failure of
    /// the request (the decision goes on without that region); the reason becomes the
    /// decision's note on that region.
    pub fn from_query(region: &str, e: &WireError) -> Self {
        let retryable = e.retryable();
        match e {
            WireError::Refused { code: kvferry_wire::frame::RefusalCode::NotAuthorized, detail } => {
                Self::denied(Origin::Peer, Denial::PeerRefusedTenant, format!("{region} refused: {detail}"))
            }
            WireError::Refused { code, detail } => Self::Unavailable(fault(
                Origin::Peer,
                retryable,
                format!("{region} refused: {code:?}: {detail}"),
            )),
            WireError::Local(_) => {
                Self::Unavailable(fault(Origin::Local, retryable, format!("{region} unreachable: {e}")))
            }
            other => {
                Self::Unavailable(fault(Origin::Peer, retryable, format!("{region} unreachable: {other}")))
            }
        }
    }

    /// The migration plan could not be made. A prefix that can only be recomputed but came
    /// without its tokens is the request's precondition failing (`reason` says why only a
    /// recompute was possible, with any note on the sources); anything else is this daemon's
    /// inputs (an engine profile or link figures the model refuses) — a bug here.
    pub fn from_plan(e: &PlanError, reason: impl FnOnce(&kvferry_model::PlanReason) -> String) -> Self {
        match e {
            PlanError::CannotRecompute { reason: r } => Self::precondition(format!(
                "{}; and the request carries block hashes, not tokens, so the prefix cannot be recomputed",
                reason(r)
            )),
            other => Self::internal(other.to_string()),
        }
    }
}

impl From<DaemonError> for tonic::Status {
    fn from(e: DaemonError) -> Self {
        let mut s = tonic::Status::new(e.code(), e.to_string());
        let md = s.metadata_mut();
        md.insert("kvferry-origin", tonic::metadata::MetadataValue::from_static(e.origin().as_str()));
        md.insert(
            "kvferry-retryable",
            tonic::metadata::MetadataValue::from_static(if e.retryable() { "true" } else { "false" }),
        );
        if let DaemonError::Denied(_, why) = &e {
            md.insert("kvferry-reason", tonic::metadata::MetadataValue::from_static(why.as_str()));
        }
        s
    }
}

impl From<PoolError> for DaemonError {
    /// An engine pool's error: an extent outside the pool is the request's (a bad block id);
    /// a closed pool is the engine gone; anything else the backend's, retryable as it says.
    fn from(e: PoolError) -> Self {
        match e {
            PoolError::OutOfBounds { .. } | PoolError::UnknownRegion { .. } => Self::invalid(e.to_string()),
            PoolError::Closed => Self::unavailable(Origin::Engine, e.to_string()).retry(false),
            other => {
                let retryable = other.is_retryable();
                Self::internal(other.to_string()).at(Origin::Engine).retry(retryable)
            }
        }
    }
}

impl From<kvferry_pool_cuda::CudaError> for DaemonError {
    /// Errors opening an engine's CUDA IPC pool. The descriptor's shape was checked before
    /// (INVALID_ARGUMENT); what is left is about this host: no driver, a handle that does not
    /// open here (foreign, stale, wrong device), a region past its allocation, a failed driver
    /// call. All of these are preconditions the engine or operator must fix, except a deadline
    /// (retryable) and pool-contract errors (mapped as above).
    fn from(e: kvferry_pool_cuda::CudaError) -> Self {
        use kvferry_pool_cuda::CudaError;
        match e {
            CudaError::Pool(p) => p.into(),
            CudaError::Deadline(_) => Self::unavailable(Origin::Engine, format!("CUDA IPC pool: {e}")),
            CudaError::Unavailable(_)
            | CudaError::Descriptor(_)
            | CudaError::Driver { .. }
            | CudaError::Kernel(_) => {
                Self::precondition(format!("cannot open the CUDA IPC pool: {e}")).at(Origin::Engine)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvferry_model::PlanReason;
    use kvferry_wire::frame::RefusalCode;
    use kvferry_wire::{Cause, LocalError};
    use tonic::Code;

    fn status(e: DaemonError) -> (Code, String, String, String) {
        let s = tonic::Status::from(e);
        let md = |k| s.metadata().get(k).unwrap().to_str().unwrap().to_owned();
        (s.code(), s.message().to_owned(), md("kvferry-origin"), md("kvferry-retryable"))
    }

    #[test]
    fn each_class_has_its_code_origin_and_retryability() {
        let cases = [
            (DaemonError::invalid("x"), Code::InvalidArgument, "request", "false", "invalid argument: x"),
            (DaemonError::not_found("x"), Code::NotFound, "request", "false", "not found: x"),
            (
                DaemonError::precondition("x"),
                Code::FailedPrecondition,
                "request",
                "false",
                "precondition failed: x",
            ),
            (DaemonError::deadline("x"), Code::DeadlineExceeded, "request", "false", "deadline exceeded: x"),
            (DaemonError::exhausted("x"), Code::ResourceExhausted, "local", "true", "resource exhausted: x"),
            (
                DaemonError::unavailable(Origin::Engine, "x"),
                Code::Unavailable,
                "engine",
                "true",
                "unavailable: x",
            ),
            (
                DaemonError::unauthenticated("x"),
                Code::Unauthenticated,
                "request",
                "false",
                "unauthenticated: x",
            ),
            (DaemonError::internal("x"), Code::Internal, "internal", "false", "internal: x"),
        ];
        for (e, code, origin, retry, msg) in cases {
            assert_eq!(e.reason(), "x");
            assert_eq!(status(e), (code, msg.to_owned(), origin.to_owned(), retry.to_owned()));
        }
        let e = DaemonError::exhausted("too big").at(Origin::Request).retry(false);
        assert_eq!((e.origin(), e.retryable(), e.code()), (Origin::Request, false, Code::ResourceExhausted));
    }

    #[test]
    fn a_fetch_error_keeps_the_wire_verdict_on_retrying() {
        let e = DaemonError::from_fetch("b", &WireError::DeadlineExceeded);
        assert_eq!((e.code(), e.origin(), e.retryable()), (Code::DeadlineExceeded, Origin::Request, false));
        assert_eq!(e.reason(), "the fetch did not finish before the deadline");

        let lost = WireError::Connection("reset".into());
        let e = DaemonError::from_fetch("b", &lost);
        assert_eq!((e.code(), e.origin(), e.retryable()), (Code::Unavailable, Origin::Peer, true));
        assert_eq!(e.reason(), "fetch from b: connection: reset");

        let refused = WireError::Refused { code: RefusalCode::TenantMismatch, detail: "no".into() };
        let e = DaemonError::from_fetch("b", &refused);
        assert_eq!((e.code(), e.origin(), e.retryable()), (Code::Unavailable, Origin::Peer, false));
        let busy = WireError::Refused { code: RefusalCode::Overloaded, detail: "busy".into() };
        assert!(DaemonError::from_fetch("b", &busy).retryable());
        let denied = WireError::NotAuthorised("unknown CA".into());
        assert!(!DaemonError::from_fetch("b", &denied).retryable());

        let local = WireError::Local(LocalError::Memory(Cause::new(PoolError::Closed)));
        let e = DaemonError::from_fetch("b", &local);
        assert_eq!((e.code(), e.origin(), e.retryable()), (Code::Unavailable, Origin::Local, false));
    }

    #[test]
    fn a_query_error_is_a_note_on_that_region() {
        let refused = WireError::Refused { code: RefusalCode::FingerprintMismatch, detail: "other".into() };
        let e = DaemonError::from_query("b", &refused);
        assert_eq!(e.reason(), "b refused: FingerprintMismatch: other");
        assert_eq!((e.origin(), e.retryable()), (Origin::Peer, false));
        let e = DaemonError::from_query("c", &WireError::Connection("timed out".into()));
        assert_eq!(e.reason(), "c unreachable: connection: timed out");
        assert!(e.retryable());
        let e = DaemonError::from_query("c", &WireError::Local(LocalError::StagingClosed));
        assert_eq!((e.origin(), e.retryable()), (Origin::Local, false));
    }

    #[test]
    fn a_tenant_refused_by_policy_is_permission_denied_with_its_reason_in_metadata() {
        let reason = |e: DaemonError| {
            let s = tonic::Status::from(e);
            let md = |k| s.metadata().get(k).map(|v| v.to_str().unwrap().to_owned());
            (s.code(), md("kvferry-reason"), md("kvferry-origin"), md("kvferry-retryable"))
        };
        let here = DaemonError::denied(Origin::Request, Denial::TenantNotAllowedForPeer, "not with b");
        assert_eq!(here.to_string(), "permission denied: not with b");
        assert_eq!(
            reason(here),
            (
                Code::PermissionDenied,
                Some("tenant_not_allowed_for_peer".into()),
                Some("request".into()),
                Some("false".into())
            )
        );
        let refused = WireError::Refused { code: RefusalCode::NotAuthorized, detail: "not with a".into() };
        for e in [DaemonError::from_query("b", &refused), DaemonError::from_fetch("b", &refused)] {
            assert!(matches!(e, DaemonError::Denied(_, Denial::PeerRefusedTenant)), "{e}");
            assert_eq!(
                reason(e),
                (
                    Code::PermissionDenied,
                    Some("peer_refused_tenant".into()),
                    Some("peer".into()),
                    Some("false".into())
                )
            );
        }
        // Other classes carry no reason key.
        assert_eq!(reason(DaemonError::invalid("x")).1, None);
    }

    #[test]
    fn a_plan_that_needs_tokens_is_a_failed_precondition() {
        let e =
            DaemonError::from_plan(&PlanError::CannotRecompute { reason: PlanReason::NoSourceHolds }, |r| {
                format!("{r} (b unreachable)")
            });
        assert_eq!(e.code(), Code::FailedPrecondition);
        assert!(!e.retryable());
        assert_eq!(
            e.reason(),
            "no peer holds this prefix (b unreachable); and the request carries block hashes, not tokens, so the prefix cannot be recomputed"
        );
        let e = DaemonError::from_plan(&PlanError::NotMeasured, |r| r.to_string());
        assert_eq!((e.code(), e.origin()), (Code::Internal, Origin::Internal));
    }

    #[test]
    fn pool_errors_map_by_cause() {
        let oob = PoolError::OutOfBounds { region: 0, offset: 8, len: 8, region_len: 8 };
        assert_eq!(DaemonError::from(oob).code(), Code::InvalidArgument);
        let closed = DaemonError::from(PoolError::Closed);
        assert_eq!(
            (closed.code(), closed.origin(), closed.retryable()),
            (Code::Unavailable, Origin::Engine, false)
        );
        let flaky =
            DaemonError::from(PoolError::Backend { backend: "nixl", retryable: true, detail: "busy".into() });
        assert_eq!((flaky.code(), flaky.origin(), flaky.retryable()), (Code::Internal, Origin::Engine, true));
    }
}

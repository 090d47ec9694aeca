//! The router-facing gRPC service (`kvferry.v1.Migration`): `MigrateSession` streams the
//! decision, progress and the receipt; `PlanMigration` returns the decision alone;
//! `GetLinks` reports each peer's live figures; `GetResidency` which regions hold how much of a
//! prefix ([`crate::residency`]). Bearer-token authentication, when configured,
//! is checked here before anything else.

use std::sync::Arc;
use std::time::Instant;

use kvferry_model::MigrationAction;
use kvferry_pool::sync::LockExt;
use kvferry_proto::v1::migration_server::Migration;
use kvferry_proto::v1::{
    Decision, GetLinksRequest, GetLinksResponse, MigrateSessionRequest, MigrationEvent, ResidencyRequest,
    ResidencyResponse, migration_event,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::Shared;
use crate::error::DaemonError;
use crate::plan::{
    decide, engine_calibration, grpc_timeout, link_state, prepare, to_proto, with_calibration,
};

/// The Migration service.
#[derive(Debug)]
pub struct MigrationService {
    pub shared: Arc<Shared>,
}

impl MigrationService {
    fn authorise<T>(&self, req: &Request<T>) -> Result<(), DaemonError> {
        check_bearer(&self.shared.config.auth.bearer_token, req.metadata())
    }
}

/// Whether an `authorization` header value admits a caller: anything when no token is
/// configured (`want` empty), else exactly `Bearer <want>` (compared in constant time).
pub fn bearer_ok(want: &str, authorization: Option<&str>) -> bool {
    if want.is_empty() {
        return true;
    }
    authorization
        .and_then(|h| h.strip_prefix("Bearer "))
        .is_some_and(|t| constant_time_eq(t.as_bytes(), want.as_bytes()))
}

/// The router API's authentication: with a configured token (`auth.bearer_token`), a request
/// must carry `authorization: Bearer <token>`. Every service on the router port (Migration
/// and server reflection) checks it.
pub fn check_bearer(want: &str, md: &tonic::metadata::MetadataMap) -> Result<(), DaemonError> {
    let got = md.get("authorization").and_then(|v| v.to_str().ok());
    if bearer_ok(want, got) {
        Ok(())
    } else {
        Err(DaemonError::unauthenticated("a valid bearer token is required"))
    }
}

/// The router port's server reflection: behind the same bearer token as Migration, and
/// describing only the services that port serves (Migration, and reflection itself), not the
/// Engine or ReferenceEngine services that share the proto file.
pub fn reflection(
    bearer_token: String,
) -> anyhow::Result<
    tonic::service::interceptor::InterceptedService<
        tonic_reflection::server::v1::ServerReflectionServer<
            impl tonic_reflection::server::v1::ServerReflection,
        >,
        impl tonic::service::Interceptor + Clone,
    >,
> {
    use prost::Message;
    let mut set = prost_types::FileDescriptorSet::decode(kvferry_proto::FILE_DESCRIPTOR_SET)?;
    for f in &mut set.file {
        f.service.retain(|s| s.name() == ROUTER_SERVICE);
    }
    let svc = tonic_reflection::server::Builder::configure()
        .register_file_descriptor_set(set)
        .with_service_name(format!("kvferry.v1.{ROUTER_SERVICE}"))
        .with_service_name("grpc.reflection.v1.ServerReflection")
        .build_v1()?;
    Ok(tonic::service::interceptor::InterceptedService::new(svc, move |req: Request<()>| {
        check_bearer(&bearer_token, req.metadata()).map_err(Status::from)?;
        Ok(req)
    }))
}

/// The one `kvferry.v1` service of the router port.
const ROUTER_SERVICE: &str = "Migration";

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn timeout_of<T>(req: &Request<T>) -> Option<std::time::Duration> {
    req.metadata().get("grpc-timeout").and_then(|v| v.to_str().ok()).and_then(grpc_timeout)
}

fn count(shared: &crate::Shared, action: MigrationAction) {
    count_decision(&shared.metrics, action);
}

/// Counts a decision under its action's metric.
fn count_decision(m: &crate::metrics::Metrics, action: MigrationAction) {
    match action {
        MigrationAction::Fetch => m.decisions_fetch.inc(),
        MigrationAction::Recompute => m.decisions_recompute.inc(),
        MigrationAction::Split => m.decisions_split.inc(),
        MigrationAction::AlreadyLocal => m.decisions_local.inc(),
    }
}

#[tonic::async_trait]
impl Migration for MigrationService {
    type MigrateSessionStream = ReceiverStream<Result<MigrationEvent, Status>>;

    async fn migrate_session(
        &self,
        req: Request<MigrateSessionRequest>,
    ) -> Result<Response<Self::MigrateSessionStream>, Status> {
        self.authorise(&req)?;
        let permit = self
            .shared
            .migrations
            .clone()
            .try_acquire_owned()
            .map_err(|_| DaemonError::exhausted("too many concurrent migrations"))?;
        let timeout = timeout_of(&req);
        let r = req.into_inner();
        let prepared = prepare(&self.shared, &r, timeout).await?;
        let planned = decide(&prepared)?;
        count(&self.shared, planned.action);
        let span = tracing::info_span!("migration", session = ?r.session_id, tenant = ?r.tenant, action = planned.action.as_str(),
            source = prepared.source.as_ref().map(|s| s.0.as_str()).unwrap_or(""), target = %self.shared.config.region);
        let (tx, rx) = mpsc::channel(16);
        let decision = to_proto(&prepared, &planned);
        let _ = tx.send(Ok(MigrationEvent { event: Some(migration_event::Event::Decision(decision)) })).await;
        let shared = self.shared.clone();
        tokio::spawn(tracing::Instrument::instrument(
            async move {
                let t0 = Instant::now();
                // The slot is held by the work, not by the stream: it is free again as soon as
                // the work ends, however slowly the router reads (a stream that stops taking
                // its events is closed by the connection's bounds, `limits.stream_stall_ms`).
                let res = crate::execute::execute(&shared, &prepared, &planned, &tx).await;
                drop(permit);
                match res {
                    Ok(receipt) => {
                        tracing::info!(wall_s = receipt.wall_s, action = %receipt.action, bytes = receipt.bytes_moved, "migration done");
                        let _ = tx
                            .send(Ok(MigrationEvent {
                                event: Some(migration_event::Event::Receipt(receipt)),
                            }))
                            .await;
                    }
                    Err(e) => {
                        shared.metrics.migrations_failed.inc();
                        tracing::warn!(error = %e, elapsed_s = t0.elapsed().as_secs_f64(), "migration failed");
                        let _ = tx.send(Err(e.into())).await;
                    }
                }
            },
            span,
        ));
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn plan_migration(
        &self,
        req: Request<MigrateSessionRequest>,
    ) -> Result<Response<Decision>, Status> {
        self.authorise(&req)?;
        let timeout = timeout_of(&req);
        let r = req.into_inner();
        let prepared = prepare(&self.shared, &r, timeout).await?;
        let planned = decide(&prepared)?;
        Ok(Response::new(to_proto(&prepared, &planned)))
    }

    async fn get_links(&self, req: Request<GetLinksRequest>) -> Result<Response<GetLinksResponse>, Status> {
        self.authorise(&req)?;
        let links = self
            .shared
            .links
            .regions()
            .into_iter()
            .filter_map(|region| {
                let f = self.shared.links.figures(&region)?;
                let id = kvferry_peer::RegionId::new(&self.shared.config.trust_domain, &region).ok()?;
                let connected = self.shared.node.rtt_to(&id).is_some();
                let mut l = link_state(&region, &f, connected);
                if let Some(p) = self.shared.links.peer(&region) {
                    l.transport_setting = p.transport.name().into();
                }
                l.transport =
                    self.shared.node.link_to(&id).map(|i| i.transport.name().into()).unwrap_or_default();
                Some(match self.shared.calib.fetch_estimate(&region, f.rtt_s) {
                    Some(e) => with_calibration(l, &e),
                    None => l,
                })
            })
            .collect();
        // Every registered engine is listed, at its reported profile until a migration to it
        // calibrates it (the same state its first plan would start from).
        if self.shared.config.policy.calibrate {
            for e in self.shared.registry.all() {
                let profile = *e.profile.locked();
                let _ = self.shared.calib.recompute(&e.engine_id, profile);
            }
        }
        let engines = self
            .shared
            .calib
            .engines()
            .iter()
            .map(|(id, reported, e)| {
                let policy = &self.shared.config.policy;
                let (split_i, split_n) = self.shared.calib.split_state(id, policy.split_interference);
                let split = (
                    split_i,
                    split_n,
                    self.shared.calib.split_scatter(id, policy.split_noise).0,
                    self.shared.calib.split_overhead(id, policy.split_overhead_ms / 1000.0).0,
                );
                let hedge = self.shared.calib.hedge_state(id, policy.hedge_interference);
                engine_calibration(id, *reported, e, split, hedge, self.shared.calib.load_state(id))
            })
            .collect();
        Ok(Response::new(GetLinksResponse { region: self.shared.config.region.clone(), links, engines }))
    }

    async fn get_residency(
        &self,
        req: Request<ResidencyRequest>,
    ) -> Result<Response<ResidencyResponse>, Status> {
        self.authorise(&req)?;
        let timeout = timeout_of(&req);
        Ok(Response::new(crate::residency::residency(&self.shared, req.into_inner(), timeout).await?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_configured_token_every_caller_is_admitted() {
        assert!(bearer_ok("", None));
        assert!(bearer_ok("", Some("Bearer anything")));
        assert!(bearer_ok("", Some("garbage")));
    }

    #[test]
    fn with_a_token_only_the_exact_bearer_header_is_admitted() {
        let want = "s3cret-token";
        assert!(bearer_ok(want, Some("Bearer s3cret-token")));
        for bad in [
            None,
            Some(""),
            Some("s3cret-token"),
            Some("bearer s3cret-token"),
            Some("Bearer  s3cret-token"),
            Some("Bearer s3cret-toke"),
            Some("Bearer s3cret-token2"),
            Some("Bearer S3CRET-TOKEN"),
            Some("Basic s3cret-token"),
        ] {
            assert!(!bearer_ok(want, bad), "{bad:?}");
        }
    }

    #[test]
    fn constant_time_eq_is_equality() {
        assert!(constant_time_eq(b"", b""));
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }

    #[test]
    fn each_action_counts_under_its_own_metric() {
        let m = crate::metrics::Metrics::default();
        for (a, n) in [
            (MigrationAction::Fetch, 1),
            (MigrationAction::Recompute, 2),
            (MigrationAction::Split, 3),
            (MigrationAction::AlreadyLocal, 4),
        ] {
            for _ in 0..n {
                count_decision(&m, a);
            }
        }
        let got = (
            m.decisions_fetch.get(),
            m.decisions_recompute.get(),
            m.decisions_split.get(),
            m.decisions_local.get(),
        );
        assert_eq!(got, (1, 2, 3, 4));
    }
}

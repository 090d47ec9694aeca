//! The router-facing gRPC service (`kvferry.v1.Migration`): `MigrateSession` streams the
//! decision, progress and the receipt; `PlanMigration` returns the decision alone;
//! `GetLinks` reports each peer's live figures; `GetResidency` which regions hold how much of a
//! prefix ([`crate::residency`]). Bearer-token authentication, when configured,
//! is checked here before anything else.

use std::sync::Arc;
use std::time::Instant;

use kvferry_model::MigrationAction;
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
        let want = &self.shared.config.auth.bearer_token;
        if want.is_empty() {
            return Ok(());
        }
        let got = req.metadata().get("authorization").and_then(|v| v.to_str().ok()).unwrap_or("");
        let ok = got.strip_prefix("Bearer ").is_some_and(|t| constant_time_eq(t.as_bytes(), want.as_bytes()));
        if ok { Ok(()) } else { Err(DaemonError::Unauthenticated("a valid bearer token is required".into())) }
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn timeout_of<T>(req: &Request<T>) -> Option<std::time::Duration> {
    req.metadata().get("grpc-timeout").and_then(|v| v.to_str().ok()).and_then(grpc_timeout)
}

fn count(shared: &crate::Shared, action: MigrationAction) {
    let m = &shared.metrics;
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
            .map_err(|_| DaemonError::Exhausted("too many concurrent migrations".into()))?;
        let timeout = timeout_of(&req);
        let r = req.into_inner();
        let prepared = prepare(&self.shared, &r, timeout).await?;
        let planned = decide(&prepared)?;
        count(&self.shared, planned.action);
        let span = tracing::info_span!("migration", session = %r.session_id, tenant = %r.tenant, action = planned.action.as_str(),
            source = prepared.source.as_ref().map(|s| s.0.as_str()).unwrap_or(""), target = %self.shared.config.region);
        let (tx, rx) = mpsc::channel(16);
        let decision = to_proto(&prepared, &planned);
        let _ = tx.send(Ok(MigrationEvent { event: Some(migration_event::Event::Decision(decision)) })).await;
        let shared = self.shared.clone();
        tokio::spawn(tracing::Instrument::instrument(
            async move {
                let _permit = permit;
                let t0 = Instant::now();
                let res = crate::execute::execute(&shared, &prepared, &planned, &tx).await;
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
                let l = link_state(&region, &f, connected);
                Some(match self.shared.calib.fetch_estimate(&region, f.rtt_s) {
                    Some(e) => with_calibration(l, &e),
                    None => l,
                })
            })
            .collect();
        let engines = self
            .shared
            .calib
            .engines()
            .iter()
            .map(|(id, reported, e)| engine_calibration(id, *reported, e))
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

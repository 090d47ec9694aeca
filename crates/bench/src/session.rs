//! Driving one migration through the router API: seed a session in region A, wait until
//! region B can see it, migrate it with a policy, verify the bytes that landed.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvferry_proto::v1::migration_client::MigrationClient;
use kvferry_proto::v1::reference_engine_client::ReferenceEngineClient;
use kvferry_proto::v1::{
    Decision, MigrateSessionRequest, Policy, PolicyMode, PrefixDigestResponse, PrefixRequest, Receipt,
    migration_event,
};
use tonic::transport::Channel;

/// The tenant every bench session belongs to.
pub const TENANT: &str = "tenant-bench";
/// The reference engine's default vocabulary.
pub const VOCAB: u32 = 1024;

/// `n` token ids of the reference engine's vocabulary (`seed` picks the conversation).
pub fn prompt(n: usize, seed: u64) -> Vec<u32> {
    kvferry_engine_node::prompt(n, VOCAB, seed)
}

fn request(session: &str, tokens: &[u32], mode: PolicyMode, allow_split: bool) -> MigrateSessionRequest {
    MigrateSessionRequest {
        session_id: session.to_owned(),
        tenant: TENANT.into(),
        token_ids: tokens.to_vec(),
        source_region: "region-a".into(),
        deadline_ms: 900_000,
        policy: Some(Policy { mode: mode as i32, allow_split, max_egress_bytes: 0, allow_hedge: false }),
        ..Default::default()
    }
}

/// Stores synthetic KV for `tokens` in the engine (see `ReferenceEngine.Fill`).
pub async fn fill(
    engine: &mut ReferenceEngineClient<Channel>,
    tokens: &[u32],
) -> anyhow::Result<PrefixDigestResponse> {
    let r = engine.fill(PrefixRequest { tenant: TENANT.into(), token_ids: tokens.to_vec() }).await?;
    Ok(r.into_inner())
}

/// The digest of the prefix the engine can take from its region (see `PrefixDigest`).
pub async fn digest(
    engine: &mut ReferenceEngineClient<Channel>,
    tokens: &[u32],
) -> anyhow::Result<PrefixDigestResponse> {
    let r = engine.prefix_digest(PrefixRequest { tenant: TENANT.into(), token_ids: tokens.to_vec() }).await?;
    Ok(r.into_inner())
}

/// Waits until the target daemon's plan sees `want` tokens held by the source (the source
/// engine reports stored blocks asynchronously), returning that plan.
pub async fn wait_for_holdings(
    mig: &mut MigrationClient<Channel>,
    tokens: &[u32],
    want: u64,
    timeout: Duration,
) -> anyhow::Result<Decision> {
    let end = Instant::now() + timeout;
    loop {
        let d =
            mig.plan_migration(request("plan-probe", tokens, PolicyMode::Auto, false)).await?.into_inner();
        if d.source_tokens >= want {
            return Ok(d);
        }
        if Instant::now() > end {
            bail!(
                "region-b never saw {want} tokens held in region-a (last plan: {} tokens)",
                d.source_tokens
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The daemon's decision alone (nothing moves).
pub async fn plan(
    mig: &mut MigrationClient<Channel>,
    tokens: &[u32],
    allow_split: bool,
) -> anyhow::Result<Decision> {
    Ok(mig.plan_migration(request("plan", tokens, PolicyMode::Auto, allow_split)).await?.into_inner())
}

/// What one MigrateSession answered.
#[derive(Debug, Clone)]
pub struct Migrated {
    pub decision: Decision,
    pub receipt: Receipt,
    /// Wall time the router saw, seconds.
    pub router_s: f64,
}

/// Runs MigrateSession to its receipt.
pub async fn migrate(
    mig: &mut MigrationClient<Channel>,
    session: &str,
    tokens: &[u32],
    mode: PolicyMode,
    allow_split: bool,
) -> anyhow::Result<Migrated> {
    let t0 = Instant::now();
    let mut stream = mig.migrate_session(request(session, tokens, mode, allow_split)).await?.into_inner();
    let (mut decision, mut receipt) = (None, None);
    while let Some(ev) = stream.message().await? {
        match ev.event {
            Some(migration_event::Event::Decision(d)) => decision = Some(d),
            Some(migration_event::Event::Receipt(r)) => receipt = Some(r),
            _ => {}
        }
    }
    Ok(Migrated {
        decision: decision.context("MigrateSession sent no decision")?,
        receipt: receipt.context("MigrateSession ended without a receipt")?,
        router_s: t0.elapsed().as_secs_f64(),
    })
}

/// The predicted seconds of `action` among a decision's candidates.
pub fn predicted(d: &Decision, action: &str) -> Option<f64> {
    d.candidates.iter().find(|c| c.action == action).map(|c| c.seconds)
}

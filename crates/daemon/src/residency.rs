//! The residency view for routers (`Migration.GetResidency`): how much of a prefix each region
//! holds now. This region's count comes from its engines' block index and its landing zone; each
//! peer is asked with the same `Query` a migration's plan sends (no KV byte read), concurrently
//! and within the request's deadline, and the answers are ranked as sources for this region
//! ([`kvferry_model::rank_sources`]). Engines withdraw a block before reusing it, so what an
//! engine evicted is no longer counted: nothing here is cached.

use std::sync::Arc;
use std::time::Duration;

use kvferry_proto::v1::{Holding, MigrateSessionRequest, ResidencyRequest, ResidencyResponse};

use crate::Shared;
use crate::error::DaemonError;
use crate::plan::prepare_with;

/// Answers a residency request.
pub async fn residency(
    shared: &Arc<Shared>,
    r: ResidencyRequest,
    transport_timeout: Option<Duration>,
) -> Result<ResidencyResponse, DaemonError> {
    let req = MigrateSessionRequest {
        session_id: "residency".into(),
        tenant: r.tenant,
        model_id: r.model_id,
        layout_fingerprint: r.layout_fingerprint,
        token_ids: r.token_ids,
        block_hashes: r.block_hashes,
        source_regions: r.regions,
        deadline_ms: r.deadline_ms,
        ..Default::default()
    };
    let p = prepare_with(shared, &req, transport_timeout, true).await?;
    let bs = u64::from(p.block_size);
    let mut holdings = vec![Holding {
        region: shared.config.region.clone(),
        tokens: p.local_blocks as u64 * bs,
        reachable: true,
        predicted_s: 0.0,
        note: String::new(),
    }];
    holdings.extend(p.holdings);
    Ok(ResidencyResponse {
        region: shared.config.region.clone(),
        prefix_tokens: p.hashes.len() as u64 * bs,
        holdings,
    })
}

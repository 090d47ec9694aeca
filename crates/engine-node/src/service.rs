//! The `kvferry.v1.ReferenceEngine` control service: each Generate is queued to the engine
//! worker and answered from there; errors become gRPC statuses through
//! `NodeError::to_status` only.

use kvferry_proto::v1::reference_engine_server::ReferenceEngine;
use kvferry_proto::v1::{GenerateRequest, GenerateResponse, PrefixDigestResponse, PrefixRequest};
use tonic::{Request, Response, Status};

use crate::worker::JobQueue;

/// The control service over the worker's queue.
#[derive(Debug, Clone)]
pub struct ControlService {
    jobs: JobQueue,
}

impl ControlService {
    /// A service that queues to `jobs`.
    pub fn new(jobs: JobQueue) -> Self {
        ControlService { jobs }
    }
}

#[tonic::async_trait]
impl ReferenceEngine for ControlService {
    async fn generate(
        &self,
        request: Request<GenerateRequest>,
    ) -> Result<Response<GenerateResponse>, Status> {
        let req = request.into_inner();
        let (tenant, tokens, use_cache) = (req.tenant.clone(), req.token_ids.len(), req.use_cache);
        match self.jobs.generate(req).await {
            Ok(resp) => {
                tracing::info!(
                    tenant,
                    tokens,
                    use_cache,
                    loaded = resp.loaded_tokens,
                    computed = resp.computed_tokens,
                    prefill_s = resp.prefill_s,
                    "generate"
                );
                Ok(Response::new(resp))
            }
            Err(e) => {
                tracing::warn!(tenant, tokens, error = %e, "generate failed");
                Err(e.to_status())
            }
        }
    }

    async fn fill(&self, request: Request<PrefixRequest>) -> Result<Response<PrefixDigestResponse>, Status> {
        let req = request.into_inner();
        let (tenant, tokens) = (req.tenant.clone(), req.token_ids.len());
        let resp = self.jobs.fill(req).await.map_err(|e| e.to_status())?;
        tracing::info!(tenant, tokens, bytes = resp.bytes, seconds = resp.seconds, "fill (synthetic KV)");
        Ok(Response::new(resp))
    }

    async fn prefix_digest(
        &self,
        request: Request<PrefixRequest>,
    ) -> Result<Response<PrefixDigestResponse>, Status> {
        let req = request.into_inner();
        let resp = self.jobs.prefix_digest(req).await.map_err(|e| e.to_status())?;
        Ok(Response::new(resp))
    }
}

//! The engine-facing gRPC service (`kvferry.v1.Engine`, on a Unix socket) and the fd-passing
//! socket that shared-memory pools arrive on.
//!
//! A pool's lifetime: the engine hands its memfd to `pool.sock` and gets a token; it calls
//! `RegisterPool` with the token and gets a lease; it keeps the lease alive by holding its
//! `Attach` stream open. When that stream ends, the lease, the pool mapping and every block
//! index entry of the engine are released.

use std::sync::Arc;
use std::time::Instant;

use kvferry_layout::{AttnSpec, BlockHash, Dtype, PoolLayout, StrideOrder};
use kvferry_pool::MemoryBackend;
use kvferry_proto::v1::engine_server::Engine;
use kvferry_proto::v1::{
    DaemonCommand, EngineEvent, LoadRequest, LoadResponse, LookupRequest, LookupResponse, PoolLayoutSpec,
    PublishRequest, PublishResponse, RegisterPoolRequest, RegisterPoolResponse, ReleaseRequest,
    ReleaseResponse, engine_event, register_pool_request,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::Shared;
use crate::blockbuf::BlockShape;
use crate::error::{DaemonError, Origin};
use crate::registry::{EngineEntry, EngineLoad, Profile};
use kvferry_pool::sync::LockExt;

/// Parses a wire layout spec into a layout.
pub fn layout_of(spec: &PoolLayoutSpec) -> Result<PoolLayout, DaemonError> {
    let dtype = match spec.dtype.as_str() {
        "f32" => Dtype::F32,
        "bf16" => Dtype::Bf16,
        "f16" => Dtype::F16,
        "fp8_e4m3" => Dtype::Fp8E4m3,
        other => {
            return Err(DaemonError::invalid(format!(
                "layout.dtype {other:?} is not f32, bf16, f16 or fp8_e4m3"
            )));
        }
    };
    let attn = AttnSpec {
        layers: spec.layers,
        kv_heads: spec.kv_heads,
        head_dim: spec.head_dim,
        block_size: spec.block_size,
        dtype,
    };
    let r = match spec.kind.as_str() {
        "vllm_flash_attn_nhd" => PoolLayout::vllm_flash_attn(attn, spec.num_blocks, StrideOrder::Nhd),
        "vllm_flash_attn_hnd" => PoolLayout::vllm_flash_attn(attn, spec.num_blocks, StrideOrder::Hnd),
        "flashinfer_nhd" => PoolLayout::flashinfer(attn, spec.num_blocks, StrideOrder::Nhd),
        "flashinfer_hnd" => PoolLayout::flashinfer(attn, spec.num_blocks, StrideOrder::Hnd),
        "vllm_cpu" => PoolLayout::vllm_cpu(attn, spec.num_blocks),
        other => return Err(DaemonError::invalid(format!("layout.kind {other:?} is not supported"))),
    };
    r.map_err(|e| DaemonError::invalid(format!("layout: {e}")))
}

/// The region's block hashes for a token list (full blocks only).
pub fn hashes_for(tenant: &str, tokens: &[u32], block_size: u32) -> Vec<BlockHash> {
    kvferry_layout::block_hashes(tenant.as_bytes(), tokens, block_size)
}

/// Environment variable naming the NIXL helper program (run as `PROGRAM --nixl-helper`, as
/// `kvferry-nixl-engine` is); it overrides the automatic choice.
pub const NIXL_HELPER_ENV: &str = "KVFERRY_NIXL_HELPER";

/// Name of the hidden `kvferry` subcommand that runs the NIXL helper process.
pub const KVFERRY_HELPER_SUBCOMMAND: &str = "nixl-helper";

/// The program that runs each NIXL pool's helper process: `$KVFERRY_NIXL_HELPER`, else the
/// running `kvferry` binary itself (`kvferry nixl-helper`), else a `kvferry-nixl-engine` next
/// to the running executable (or one directory up, where cargo puts binaries for test
/// executables). `None` when there is none: NIXL registrations are then refused.
///
/// The engine's NIXL metadata is loaded only in that helper: handing its packed UCX keys to
/// UCX can crash the loading process (crates/pool-nixl/FINDINGS.md, `proxy` module docs).
pub fn nixl_helper() -> Option<kvferry_pool_nixl::HelperCommand> {
    use kvferry_pool_nixl::HelperCommand;
    if let Some(p) = std::env::var_os(NIXL_HELPER_ENV) {
        return (!p.is_empty()).then(|| HelperCommand::nixl_engine(p));
    }
    let exe = std::env::current_exe().ok()?;
    if exe.file_name().is_some_and(|n| n == "kvferry") {
        return Some(HelperCommand { program: exe, args: vec![KVFERRY_HELPER_SUBCOMMAND.into()] });
    }
    let dir = exe.parent()?;
    [dir.join("kvferry-nixl-engine"), dir.parent()?.join("kvferry-nixl-engine")]
        .into_iter()
        .find(|p| p.is_file())
        .map(HelperCommand::nixl_engine)
}

/// Parses a NIXL pool descriptor (kvferry_pool_nixl's JSON form), checks its regions against
/// the layout's (one NIXL region per layout region, each at least as long), and attaches to it.
/// Blocking (starts the pool's NIXL helper process and waits for its attach): call it off the
/// async executor.
pub fn attach_nixl(
    descriptor_json: &[u8],
    region_lens: &[u64],
) -> Result<Arc<dyn MemoryBackend>, DaemonError> {
    use kvferry_pool_nixl::{NixlBackend, NixlOptions, NixlPoolDescriptor};
    let text = std::str::from_utf8(descriptor_json)
        .map_err(|_| DaemonError::invalid("nixl.descriptor_json is not UTF-8"))?;
    let desc = NixlPoolDescriptor::from_json(text)
        .map_err(|e| DaemonError::invalid(format!("nixl.descriptor_json: {e}")))?;
    if desc.regions.len() != region_lens.len() {
        return Err(DaemonError::invalid(format!(
            "the NIXL descriptor has {} regions, the layout has {} (one NIXL region per layout region)",
            desc.regions.len(),
            region_lens.len()
        )));
    }
    for (i, (r, &want)) in desc.regions.iter().zip(region_lens).enumerate() {
        if r.len < want {
            return Err(DaemonError::invalid(format!(
                "NIXL region {i} is {} bytes, the layout needs {want}",
                r.len
            )));
        }
    }
    if !kvferry_pool_nixl::COMPILED {
        return Err(DaemonError::precondition(
            "NIXL pools are not supported by this daemon: it was built without the `nixl` cargo feature \
             (build with `cargo build --release --features nixl`)",
        )
        .at(Origin::Local));
    }
    let Some(helper) = nixl_helper() else {
        return Err(DaemonError::precondition(format!(
            "NIXL registration of agent {:?} refused: no NIXL helper program (the daemon runs \
             `kvferry {KVFERRY_HELPER_SUBCOMMAND}` when it is the kvferry binary; otherwise set \
             {NIXL_HELPER_ENV} to a kvferry-nixl-engine binary). Engine metadata is never loaded \
             into NIXL inside the daemon's process.",
            desc.agent_name
        ))
        .at(Origin::Local));
    };
    let opts = NixlOptions { helper: Some(helper), ..NixlOptions::default() };
    let backend = NixlBackend::attach_with(&desc, opts).map_err(|e| {
        DaemonError::precondition(format!("cannot attach the NIXL pool of agent {:?}: {e}", desc.agent_name))
            .at(Origin::Engine)
    })?;
    tracing::info!(engine_agent = %backend.peer(), daemon_agent = %backend.agent_name(), "NIXL pool attached");
    Ok(Arc::new(backend))
}

/// Parses a CUDA IPC pool descriptor (kvferry_pool_cuda's JSON form), validates its shape and
/// checks its regions against the layout's: one IPC region per layout region, each at least as
/// long. Needs no driver (and no `cuda` feature): malformed input is refused the same way on
/// every host.
pub fn parse_cuda_descriptor(
    descriptor_json: &[u8],
    region_lens: &[u64],
) -> Result<kvferry_pool_cuda::CudaIpcDescriptor, DaemonError> {
    let desc: kvferry_pool_cuda::CudaIpcDescriptor = serde_json::from_slice(descriptor_json)
        .map_err(|e| DaemonError::invalid(format!("cuda.descriptor_json: {e}")))?;
    desc.validate().map_err(|e| DaemonError::invalid(format!("cuda.descriptor_json: {e}")))?;
    if desc.handles.len() != region_lens.len() {
        return Err(DaemonError::invalid(format!(
            "the CUDA IPC descriptor has {} regions, the layout has {} (one IPC region per layout region)",
            desc.handles.len(),
            region_lens.len()
        )));
    }
    for (i, (r, &want)) in desc.handles.iter().zip(region_lens).enumerate() {
        if r.len < want {
            return Err(DaemonError::invalid(format!(
                "CUDA IPC region {i} is {} bytes, the layout needs {want}",
                r.len
            )));
        }
    }
    Ok(desc)
}

/// Parses and checks a CUDA IPC pool descriptor ([`parse_cuda_descriptor`]), then opens the
/// engine's device memory with `cuIpcOpenMemHandle` (the daemon never frees it; the mappings
/// close when the backend drops). Blocking (driver calls, a copy-path measurement on scratch
/// memory): call it off the async executor.
///
/// A daemon built without the `cuda` feature, or on a host with no usable driver, refuses a
/// well-formed descriptor with FAILED_PRECONDITION.
pub fn attach_cuda(
    descriptor_json: &[u8],
    region_lens: &[u64],
) -> Result<Arc<dyn MemoryBackend>, DaemonError> {
    let desc = parse_cuda_descriptor(descriptor_json, region_lens)?;
    open_cuda(&desc)
}

#[cfg(feature = "cuda")]
fn open_cuda(desc: &kvferry_pool_cuda::CudaIpcDescriptor) -> Result<Arc<dyn MemoryBackend>, DaemonError> {
    use kvferry_pool_cuda::{CudaBackend, CudaBackendConfig, unavailable_reason};
    // Probe first: cudarc (dynamic loading) panics on a call into a library it cannot load.
    if let Some(reason) = unavailable_reason() {
        return Err(
            DaemonError::precondition(format!("no CUDA driver on this host ({reason})")).at(Origin::Local)
        );
    }
    let backend = CudaBackend::open(desc, CudaBackendConfig::default()).map_err(|e| {
        let e = DaemonError::from(e);
        tracing::warn!(device = desc.device, error = %e, "cannot open the CUDA IPC pool");
        e
    })?;
    let (gather, scatter) = backend.paths();
    tracing::info!(
        device = desc.device,
        regions = desc.handles.len(),
        mappings = backend.ipc_mappings(),
        ?gather,
        ?scatter,
        "CUDA IPC pool opened"
    );
    Ok(Arc::new(backend))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_desc: &kvferry_pool_cuda::CudaIpcDescriptor) -> Result<Arc<dyn MemoryBackend>, DaemonError> {
    Err(DaemonError::precondition(
        "this daemon was built without the `cuda` feature (cargo build --features cuda)",
    )
    .at(Origin::Local))
}

/// The Engine service.
#[derive(Debug)]
pub struct EngineService {
    pub shared: Arc<Shared>,
}

impl EngineService {
    fn engine(&self, lease_id: &str) -> Result<Arc<EngineEntry>, DaemonError> {
        self.shared
            .registry
            .by_lease(lease_id)
            .ok_or_else(|| DaemonError::not_found(format!("lease {lease_id:?}")))
    }
}

/// The most bytes one batch of an engine's `Load` moves through staging. A batch is one
/// staging copy and one backend write (for a NIXL pool one transfer, milliseconds each, which
/// is why blocks are batched at all); the call allocates one staging buffer of its largest
/// batch and reuses it. Batches of `limits.staging_bytes` (256 MiB by default) made that
/// buffer too large for the staging free list ([`kvferry_pool::RECYCLE_MAX_BYTES`]), so every
/// batch of every load was fresh memory: the 2 GiB load after a bench fetch took 27 s of one
/// core on this host, most of it page faults (2026-12-06; 0.35 s for 256 MiB with memory the
/// host had already backed).
pub const LOAD_BATCH_MAX_BYTES: usize = 64 << 20;
const _: () = assert!(LOAD_BATCH_MAX_BYTES <= kvferry_pool::RECYCLE_MAX_BYTES);

/// A `Load` batch's byte cap: `limits.staging_bytes`, at most [`LOAD_BATCH_MAX_BYTES`], at
/// least 1.
pub fn load_batch_bytes(staging_bytes: u64) -> usize {
    usize::try_from(staging_bytes).unwrap_or(usize::MAX).clamp(1, LOAD_BATCH_MAX_BYTES)
}

/// The staging buffer a `Load` whose largest batch is `largest` bytes uses: the next power of
/// two, at most the batch cap `cap` (or `largest` itself, a block above the cap). The staging
/// free list recycles a buffer only for a request of its own size, and loads come in every
/// size (a prefix's blocks): sized to the batch, nearly every load of a decision sweep was a
/// fresh allocation whose pages the kernel cleared, 3–4 ms per MiB on this host where a
/// recycled buffer loads at ~0.2 (2026-12-06). Power-of-two classes are recycled after the
/// first of each.
pub fn load_staging_bytes(largest: usize, cap: usize) -> usize {
    largest.checked_next_power_of_two().unwrap_or(largest).min(cap.max(largest))
}

/// One batch of a `Load`: blocks `blocks` of the call's plan, `bytes` of them in all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadBatch {
    pub blocks: std::ops::Range<usize>,
    pub bytes: usize,
}

/// Blocks of `sizes` bytes, in order, in batches of at most `cap` bytes; a block larger than
/// `cap` goes alone. Every block is in exactly one batch, in order.
pub fn load_batches(sizes: &[usize], cap: usize) -> Vec<LoadBatch> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < sizes.len() {
        let (mut end, mut bytes) = (start, 0usize);
        while end < sizes.len() && (end == start || bytes.saturating_add(sizes[end]) <= cap) {
            bytes = bytes.saturating_add(sizes[end]);
            end += 1;
        }
        out.push(LoadBatch { blocks: start..end, bytes });
        start = end;
    }
    out
}

fn hash_of(b: &[u8]) -> Result<BlockHash, DaemonError> {
    b.try_into().map_err(|_| DaemonError::invalid(format!("a block hash is {} bytes, not 32", b.len())))
}

#[tonic::async_trait]
impl Engine for EngineService {
    async fn register_pool(
        &self,
        req: Request<RegisterPoolRequest>,
    ) -> Result<Response<RegisterPoolResponse>, Status> {
        // The engine's process (the socket's peer credentials): its CPU is this region's own
        // work, not the host's other work ([`crate::hostcpu`]).
        if let Some(pid) = req.extensions().get::<crate::conn::ConnInfo>().and_then(|c| c.1) {
            self.shared.host_cpu.add_engine_pid(pid);
        }
        let r = req.into_inner();
        if r.engine_id.is_empty() || r.model_id.is_empty() {
            return Err(DaemonError::invalid("engine_id and model_id are required").into());
        }
        let spec = r.layout.as_ref().ok_or_else(|| DaemonError::invalid("layout is required"))?;
        let layout = layout_of(spec)?;
        let backend: Arc<dyn MemoryBackend> = match r.access {
            Some(register_pool_request::Access::Shm(shm)) => {
                let (model, offered, backend) =
                    self.shared.registry.take_pending_pool(&shm.pool_token).ok_or_else(|| {
                        DaemonError::not_found(format!(
                            "shm pool token {:?} (hand the fd to pool.sock first)",
                            shm.pool_token
                        ))
                    })?;
                if model != r.model_id {
                    return Err(DaemonError::precondition(format!(
                        "the shm pool was offered for model {model:?}, registered as {:?}",
                        r.model_id
                    ))
                    .into());
                }
                if offered.as_ref() != Some(&layout) {
                    return Err(DaemonError::precondition(
                        "the registered layout differs from the offered pool's",
                    )
                    .into());
                }
                backend
            }
            Some(register_pool_request::Access::Nixl(nixl)) => {
                let json = nixl.descriptor_json;
                let lens = layout.region_lens().to_vec();
                tokio::task::spawn_blocking(move || attach_nixl(&json, &lens))
                    .await
                    .map_err(|e| DaemonError::internal(format!("NIXL attach task: {e}")))??
            }
            Some(register_pool_request::Access::Cuda(cuda)) => {
                let json = cuda.descriptor_json;
                let lens = layout.region_lens().to_vec();
                tokio::task::spawn_blocking(move || attach_cuda(&json, &lens))
                    .await
                    .map_err(|e| DaemonError::internal(format!("CUDA attach task: {e}")))??
            }
            None => return Err(DaemonError::invalid("access is required").into()),
        };
        let profile = Profile::reported(&r.profile.unwrap_or_default()).map_err(DaemonError::invalid)?;
        let fingerprint = layout.fingerprint(&r.model_id);
        let digest = fingerprint.digest_bytes();
        if self.shared.config.limits.landing_prefault {
            let shape = BlockShape::of(&layout).map_err(DaemonError::internal)?;
            let (zone, engine) = (self.shared.landing.clone(), r.engine_id.clone());
            let spawned =
                crate::landing::spawn_prefault(zone, shape.block_bytes() as usize, move |added, seconds| {
                    tracing::info!(engine = ?engine, bytes = added, seconds,
                    "landing zone prefaulted for this engine's block size (idle priority)");
                });
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "could not start the landing zone's prefault; fetches fault their memory in");
            }
        }
        let lease_id = format!("{:032x}", rand::random::<u128>());
        let entry = Arc::new(EngineEntry {
            engine_id: r.engine_id.clone(),
            model_id: r.model_id.clone(),
            lease_id: lease_id.clone(),
            layout,
            fingerprint,
            digest,
            backend,
            profile: std::sync::Mutex::new(profile),
            load: std::sync::Mutex::new(EngineLoad::default()),
            blocks: Default::default(),
            commands: std::sync::Mutex::new(None),
            recompute_waiters: Default::default(),
            registered_at: Instant::now(),
        });
        self.shared.registry.insert(entry.clone());
        tracing::info!(engine = ?r.engine_id, model = ?r.model_id, lease = %lease_id, "engine pool registered");
        // A lease lives as long as its Attach stream; one never attached expires.
        let grace = self.shared.config.limits.attach_grace_ms;
        let shared = self.shared.clone();
        let weak = Arc::downgrade(&entry);
        drop(entry);
        tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(grace)).await;
            let Some(entry) = weak.upgrade() else { return };
            let attached = entry.commands.locked().is_some();
            if !attached && shared.registry.remove(&entry.lease_id).is_some() {
                tracing::warn!(engine = ?entry.engine_id, lease = %entry.lease_id, grace_ms = grace,
                    "no Attach within the grace period: lease released");
            }
        });
        Ok(Response::new(RegisterPoolResponse {
            lease_id,
            layout_fingerprint: digest.to_vec(),
            lease_ttl_ms: grace,
        }))
    }

    type AttachStream = ReceiverStream<Result<DaemonCommand, Status>>;

    async fn attach(
        &self,
        req: Request<Streaming<EngineEvent>>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        let mut events = req.into_inner();
        let first = events
            .message()
            .await?
            .ok_or_else(|| DaemonError::invalid("Attach: the first message must name the lease"))?;
        let engine = self.engine(&first.lease_id)?;
        let (tx, rx) = mpsc::channel(64);
        {
            // One live Attach stream per lease: a second one is refused and the first left
            // untouched (replacing it would drop the first engine's command stream).
            let mut c = engine.commands.locked();
            if c.as_ref().is_some_and(|s| !s.is_closed()) {
                return Err(DaemonError::precondition(format!(
                    "lease {:?} already has a live Attach stream; a second one is refused",
                    first.lease_id
                ))
                .into());
            }
            *c = Some(tx);
        }
        let shared = self.shared.clone();
        tokio::spawn(async move {
            let mut next = Some(first);
            loop {
                let ev = match next.take() {
                    Some(e) => e,
                    None => match events.message().await {
                        Ok(Some(e)) => e,
                        _ => break,
                    },
                };
                if let Err(e) = apply_event(&engine, &shared.metrics, ev) {
                    // The stream's only way to refuse an event is to end with its status.
                    tracing::warn!(engine = ?engine.engine_id, error = %e, "Attach: engine event refused; ending the stream");
                    let tx = engine.commands.locked().clone();
                    if let Some(tx) = tx {
                        let _ = tx.try_send(Err(e.into()));
                    }
                    break;
                }
            }
            // The stream ended: the engine is gone, and so is its lease.
            tracing::info!(engine = ?engine.engine_id, "engine detached; releasing its lease");
            shared.registry.remove(&engine.lease_id);
            engine.commands.locked().take();
            // Its recomputes will never be answered: each waiter is dropped unanswered, which
            // its migration reads as the engine gone (UNAVAILABLE, retryable), not as an
            // answer that failed (INTERNAL).
            engine.recompute_waiters.locked().clear();
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn lookup(&self, req: Request<LookupRequest>) -> Result<Response<LookupResponse>, Status> {
        let r = req.into_inner();
        let engine = self.engine(&r.lease_id)?;
        let bs = engine.layout.spec().block_size;
        let hashes = hashes_for(&r.tenant, &r.token_ids, bs);
        let mut out = LookupResponse::default();
        for h in hashes {
            let in_engine = engine.block_of(&r.tenant, &h).is_some();
            let landed = !in_engine
                && self.shared.landing.get(&r.tenant, &h).is_some_and(|l| l.fingerprint == engine.digest);
            if !(in_engine || landed) {
                break;
            }
            out.block_hashes.push(h.to_vec());
            out.in_engine.push(in_engine);
        }
        out.ready_tokens = out.block_hashes.len() as u64 * u64::from(bs);
        self.shared.metrics.lookups.inc();
        self.shared.metrics.lookup_tokens.add(r.token_ids.len() as u64);
        self.shared.metrics.lookup_hit_tokens.add(out.ready_tokens);
        Ok(Response::new(out))
    }

    async fn load(&self, req: Request<LoadRequest>) -> Result<Response<LoadResponse>, Status> {
        let r = req.into_inner();
        let engine = self.engine(&r.lease_id)?;
        #[cfg(feature = "fault-injection")]
        if self.shared.config.faults.fail_loads.contains(&r.tenant) {
            tracing::warn!(tenant = ?r.tenant, "fault injection: failing a Load");
            return Err(Status::unavailable("fault injection: Load failed on purpose"));
        }
        if r.block_hashes.len() != r.block_ids.len() {
            return Err(DaemonError::invalid("block_hashes and block_ids differ in length").into());
        }
        let hashes: Vec<BlockHash> = r.block_hashes.iter().map(|b| hash_of(b)).collect::<Result<_, _>>()?;
        let layers = engine.layout.num_layers();
        // Resolve everything (and bounds-check every block id) before the first write.
        let mut plan = Vec::with_capacity(hashes.len());
        for (h, &id) in hashes.iter().zip(&r.block_ids) {
            let landed = self.shared.landing.get(&r.tenant, h).ok_or_else(|| {
                DaemonError::not_found(format!("block {} is not ready in this region", hex::encode(h)))
            })?;
            if landed.fingerprint != engine.digest {
                return Err(DaemonError::precondition("a ready block was fetched for another layout").into());
            }
            let extents = engine
                .layout
                .extents(&[id], 0..layers)
                .map_err(|e| DaemonError::invalid(format!("block id {id}: {e}")))?;
            plan.push((extents, landed));
        }
        self.shared.landing.lease(&hashes);
        let started = Instant::now();
        let sizes: Vec<usize> = plan.iter().map(|(_, landed)| landed.bytes.len()).collect();
        let result: Result<(), DaemonError> = async {
            // A pool in host memory this daemon maps (shm) takes each landed block straight
            // from the landing zone: one copy, and no staging buffer, whose first use in each
            // size class the kernel had to clear (3–4 ms per MiB on this host: a split's
            // 12 MiB load took 0.053 s against its usual 0.003, full-2026-12-06-split run2).
            if engine.backend.writes_host() {
                for (ext, landed) in &plan {
                    engine.backend.write_host(ext, &landed.bytes)?;
                }
                return Ok(());
            }
            let batches = load_batches(&sizes, load_batch_bytes(self.shared.config.limits.staging_bytes));
            // One staging buffer for the whole call, reused by every batch (module doc of
            // `load_batch_bytes`), of a recyclable size (`load_staging_bytes`). Each batch
            // overwrites the prefix it writes to the pool, so a recycled buffer is not zeroed
            // first: bytes past that prefix never reach the pool.
            let Some(largest) = batches.iter().map(|b| b.bytes).max() else { return Ok(()) };
            let cap = load_batch_bytes(self.shared.config.limits.staging_bytes);
            let mut staging = engine.backend.staging_to_fill(load_staging_bytes(largest, cap))?;
            for b in &batches {
                let mut extents = Vec::new();
                let mut off = 0;
                for (ext, landed) in &plan[b.blocks.clone()] {
                    staging.as_mut_slice()[off..off + landed.bytes.len()].copy_from_slice(&landed.bytes);
                    off += landed.bytes.len();
                    extents.extend_from_slice(ext);
                }
                engine.backend.write(&extents, &staging).await?;
            }
            Ok(())
        }
        .await;
        self.shared.landing.unlease(&hashes);
        let took = started.elapsed();
        let written = result.as_ref().ok().map(|()| sizes.iter().sum::<usize>());
        self.shared.metrics.engine_load(took, written);
        // What loading fetched blocks costs this engine is part of what a fetch costs it
        // (`kvferry_model::calibration::load`).
        if let Some(bytes) = written
            && self.shared.config.policy.calibrate
        {
            self.shared.calib.observe_load(&engine.engine_id, bytes as u64, took.as_secs_f64());
        }
        result?;
        Ok(Response::new(LoadResponse { blocks_loaded: plan.len() as u32 }))
    }

    async fn publish(&self, req: Request<PublishRequest>) -> Result<Response<PublishResponse>, Status> {
        let r = req.into_inner();
        let engine = self.engine(&r.lease_id)?;
        // Validate everything before changing anything.
        let removed: Vec<BlockHash> =
            r.removed_hashes.iter().map(|b| hash_of(b)).collect::<Result<_, _>>()?;
        let mut stored = Vec::new();
        for s in &r.stored {
            stored.extend(checked_stored(&engine, s)?);
        }
        let mut out = PublishResponse::default();
        let mut ix = engine.blocks.locked();
        // Withdrawals first: when this call returns, no peer read that starts later serves
        // them, and every read already running fails its re-check (catalog::Revalidated).
        for h in &removed {
            out.removed += u32::from(ix.remove_hash(h));
        }
        for &id in &r.removed_block_ids {
            out.removed += u32::from(ix.remove_id(id, r.epoch));
        }
        for (h, id, tenant) in stored {
            if ix.store(h, id, tenant, r.epoch) {
                out.stored += 1;
            } else {
                out.stale += 1;
            }
        }
        Ok(Response::new(out))
    }

    async fn release(&self, req: Request<ReleaseRequest>) -> Result<Response<ReleaseResponse>, Status> {
        let r = req.into_inner();
        let _ = self.engine(&r.lease_id)?;
        let hashes: Vec<BlockHash> = r.block_hashes.iter().map(|b| hash_of(b)).collect::<Result<_, _>>()?;
        self.shared.landing.remove(&hashes);
        Ok(Response::new(ReleaseResponse {}))
    }
}

/// Checks one published batch of stored blocks (Attach's `BlockStored`, Publish's `stored`)
/// against the engine's pool: as many ids as hashes, every hash 32 bytes, every block id inside
/// the pool, the tenant bounded. Nothing of a batch that fails is indexed.
fn checked_stored<'a>(
    engine: &EngineEntry,
    s: &'a kvferry_proto::v1::BlockStored,
) -> Result<Vec<(BlockHash, u32, &'a str)>, DaemonError> {
    if s.block_hashes.len() != s.block_ids.len() {
        return Err(DaemonError::invalid("stored: block_hashes and block_ids differ in length"));
    }
    if s.tenant.len() > crate::plan::MAX_ID_BYTES {
        return Err(DaemonError::invalid(format!(
            "stored: tenant is {} bytes, more than {}",
            s.tenant.len(),
            crate::plan::MAX_ID_BYTES
        )));
    }
    let n = engine.layout.num_blocks();
    s.block_hashes
        .iter()
        .zip(&s.block_ids)
        .map(|(h, &id)| {
            if id >= n {
                return Err(DaemonError::invalid(format!(
                    "stored: block id {id} is past the pool's {n} blocks"
                )));
            }
            Ok((hash_of(h)?, id, s.tenant.as_str()))
        })
        .collect()
}

/// Applies one Attach event; an event that does not validate changes nothing and is refused.
fn apply_event(
    engine: &EngineEntry,
    metrics: &crate::metrics::Metrics,
    ev: EngineEvent,
) -> Result<(), DaemonError> {
    match ev.event {
        Some(engine_event::Event::Stored(s)) => {
            let stored = checked_stored(engine, &s)?;
            let mut b = engine.blocks.locked();
            for (h, id, tenant) in stored {
                b.store(h, id, tenant, 0);
            }
        }
        Some(engine_event::Event::Removed(r)) => {
            let hashes: Vec<BlockHash> =
                r.block_hashes.iter().map(|h| hash_of(h)).collect::<Result<_, _>>()?;
            let mut b = engine.blocks.locked();
            for h in &hashes {
                b.remove_hash(h);
            }
        }
        Some(engine_event::Event::Load(l)) => {
            {
                let mut load = engine.load.locked();
                *load = EngineLoad { queue_depth: l.queue_depth, utilization: l.utilization };
            }
            // A profile that is none (see `Profile::reported`) leaves the last one in force.
            if let Some(p) = l.profile.as_ref().and_then(|p| Profile::reported(p).ok()) {
                *engine.profile.locked() = p;
            }
        }
        Some(engine_event::Event::RecomputeDone(d)) => {
            let waiter = engine.recompute_waiters.locked().remove(&d.session_id);
            if let Some(tx) = waiter {
                let _ = tx.send(if d.error.is_empty() { Ok(d.tokens) } else { Err(d.error) });
            } else if d.cancelled {
                metrics.recompute_cancels_acked.inc();
                tracing::info!(recompute = ?d.session_id, tokens = d.tokens, "the engine cancelled a recompute past its deadline");
            }
        }
        None => {}
    }
    Ok(())
}

/// Accepts shm pools on `pool.sock`: each connection carries one offer (fd + layout + model
/// id); the reply is one line, the token, or `error: ...`.
///
/// Each connection is handled on its own thread, bounded in time (the whole offer must arrive
/// within `limits.pool_offer_timeout_ms`; the reply's write is bounded the same way) and in
/// number (at most `limits.max_pending_pool_offers` connections in hand at once; one beyond
/// that is answered `error: ...` and closed): a silent client delays no other engine.
pub fn serve_pool_socket(listener: std::os::unix::net::UnixListener, shared: Arc<Shared>) {
    use std::io::Write;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let timeout = std::time::Duration::from_millis(shared.config.limits.pool_offer_timeout_ms);
    let max_in_hand = shared.config.limits.max_pending_pool_offers as usize;
    let in_hand = Arc::new(AtomicUsize::new(0));
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        if stream
            .set_read_timeout(Some(timeout))
            .and_then(|()| stream.set_write_timeout(Some(timeout)))
            .is_err()
        {
            continue;
        }
        if in_hand.fetch_add(1, Ordering::AcqRel) >= max_in_hand {
            in_hand.fetch_sub(1, Ordering::AcqRel);
            let _ = writeln!(stream, "error: {max_in_hand} pool offers are already in progress; retry");
            continue;
        }
        let (shared, in_hand) = (shared.clone(), in_hand.clone());
        let spawned = std::thread::Builder::new().name("kvferry-pool-offer".into()).spawn(move || {
            let reply = offer(&stream, &shared);
            let _ = writeln!(stream, "{reply}");
            in_hand.fetch_sub(1, Ordering::AcqRel);
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start a pool offer thread; offer dropped");
        }
    }
}

/// One `pool.sock` offer: the token line, or `error: ...`.
fn offer(stream: &std::os::unix::net::UnixStream, shared: &Shared) -> String {
    match kvferry_pool_shm::accept_pool(stream) {
        Ok((offer, backend)) => {
            let token = format!("{:032x}", rand::random::<u128>());
            let added = shared.registry.add_pending_pool(
                token.clone(),
                offer.model_id.clone(),
                offer.layout.clone(),
                Arc::new(backend),
                shared.config.limits.max_pending_pool_offers as usize,
            );
            match added {
                Ok(()) => token,
                Err(held) => format!(
                    "error: {held} shm pool offers are waiting for RegisterPool (limits.max_pending_pool_offers); \
                     register or close them first"
                ),
            }
        }
        Err(e) => format!("error: {e}"),
    }
}

/// Drops the shm pool offers older than `limits.pool_offer_ttl_ms` that no `RegisterPool`
/// claimed (closing their fds and unmapping them), every tenth of the TTL. Runs until aborted.
pub async fn expire_pool_offers(shared: Arc<Shared>) {
    let ttl = std::time::Duration::from_millis(shared.config.limits.pool_offer_ttl_ms);
    let mut tick = tokio::time::interval((ttl / 10).max(std::time::Duration::from_millis(10)));
    loop {
        tick.tick().await;
        let gone = shared.registry.expire_pending_pools(ttl);
        if gone > 0 {
            tracing::warn!(
                offers = gone,
                ttl_ms = ttl.as_millis() as u64,
                "shm pool offers never claimed by RegisterPool expired (fds closed, mappings unmapped)"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    //! The request checks of the Engine API, without a socket: what a layout spec, a block
    //! hash and a CUDA IPC descriptor must look like, and the status each refusal gets.
    use super::*;
    use kvferry_pool_cuda::{CudaIpcDescriptor, IpcRegion};
    use tonic::Code;

    fn spec(kind: &str, dtype: &str) -> PoolLayoutSpec {
        PoolLayoutSpec {
            kind: kind.into(),
            layers: 2,
            kv_heads: 4,
            head_dim: 64,
            block_size: 16,
            num_blocks: 8,
            dtype: dtype.into(),
        }
    }

    #[test]
    fn load_batches_are_capped_at_a_recyclable_size() {
        assert_eq!(load_batch_bytes(256 << 20), LOAD_BATCH_MAX_BYTES);
        assert_eq!(load_batch_bytes(8 << 20), 8 << 20);
        assert_eq!(load_batch_bytes(0), 1);
        assert_eq!(load_batch_bytes(u64::MAX), LOAD_BATCH_MAX_BYTES);
        assert!(load_batches(&[], 10).is_empty());
        let b = load_batches(&[4, 4, 4, 9, 1], 8);
        let ranges: Vec<_> = b.iter().map(|b| (b.blocks.clone(), b.bytes)).collect();
        assert_eq!(ranges, vec![(0..2, 8), (2..3, 4), (3..4, 9), (4..5, 1)]);
        // Loads of 10, 11 and 16 MiB share one 16 MiB staging class; 40 MiB takes 64.
        let mib = 1 << 20;
        for l in [10 * mib, 11 * mib, 16 * mib] {
            assert_eq!(load_staging_bytes(l, LOAD_BATCH_MAX_BYTES), 16 * mib);
        }
        assert_eq!(load_staging_bytes(40 * mib, LOAD_BATCH_MAX_BYTES), 64 * mib);
        assert_eq!(load_staging_bytes(5 * mib, 6 * mib), 6 * mib, "the cap bounds it");
        assert_eq!(load_staging_bytes(9 * mib, 8 * mib), 9 * mib, "one block above the cap");
    }

    proptest::proptest! {
        #[test]
        fn load_batches_cover_every_block_once_in_order_within_the_cap(
            sizes in proptest::collection::vec(0usize..5000, 0..60),
            cap in 1usize..12000,
        ) {
            let batches = load_batches(&sizes, cap);
            let mut next = 0;
            for b in &batches {
                proptest::prop_assert_eq!(b.blocks.start, next);
                proptest::prop_assert!(b.blocks.end > b.blocks.start);
                proptest::prop_assert_eq!(b.bytes, sizes[b.blocks.clone()].iter().sum::<usize>());
                proptest::prop_assert!(b.bytes <= cap || b.blocks.len() == 1);
                next = b.blocks.end;
            }
            proptest::prop_assert_eq!(next, sizes.len());
            // Maximal: the next block would not have fitted.
            for w in batches.windows(2) {
                proptest::prop_assert!(w[0].bytes + sizes[w[1].blocks.start] > cap);
            }
        }

        /// A load's staging holds its largest batch, in a size class (a power of two) unless
        /// the cap or a larger block bounds it, never above both.
        #[test]
        fn load_staging_holds_the_largest_batch_in_few_sizes(largest in 0usize..(1 << 28), cap in 1usize..(1 << 27)) {
            let s = load_staging_bytes(largest, cap);
            proptest::prop_assert!(s >= largest);
            proptest::prop_assert!(s <= cap.max(largest));
            proptest::prop_assert!(s.is_power_of_two() || s == cap || s == largest);
        }
    }

    #[test]
    fn every_supported_layout_kind_and_dtype_parses() {
        let kinds =
            ["vllm_flash_attn_nhd", "vllm_flash_attn_hnd", "flashinfer_nhd", "flashinfer_hnd", "vllm_cpu"];
        for kind in kinds {
            for (dtype, bytes) in [("f32", 4), ("bf16", 2), ("f16", 2), ("fp8_e4m3", 1)] {
                let l = layout_of(&spec(kind, dtype)).unwrap_or_else(|e| panic!("{kind} {dtype}: {e}"));
                assert_eq!(l.spec().block_size, 16);
                // K and V of 2 layers × 4 heads × 64 dims × 16 tokens, in that dtype
                assert_eq!(l.bytes_per_block(0..2).unwrap(), 2 * 2 * 4 * 64 * 16 * bytes, "{kind} {dtype}");
            }
        }
        // the same spec under two kinds is two layouts (fingerprints differ)
        let a = layout_of(&spec("vllm_flash_attn_nhd", "bf16")).unwrap().fingerprint("m").digest();
        let b = layout_of(&spec("vllm_flash_attn_hnd", "bf16")).unwrap().fingerprint("m").digest();
        assert_ne!(a, b);
    }

    #[test]
    fn an_unknown_kind_or_dtype_or_shape_is_an_invalid_argument() {
        let cases = [
            (spec("paged_magic", "bf16"), "layout.kind \"paged_magic\""),
            (spec("vllm_cpu", "int4"), "layout.dtype \"int4\""),
            (PoolLayoutSpec { block_size: 0, ..spec("vllm_cpu", "bf16") }, "layout: "),
            (PoolLayoutSpec { layers: 0, ..spec("flashinfer_nhd", "f16") }, "layout: "),
        ];
        for (s, want) in cases {
            let e = layout_of(&s).unwrap_err();
            assert_eq!(
                (e.code(), e.origin(), e.retryable()),
                (Code::InvalidArgument, Origin::Request, false)
            );
            assert!(e.reason().starts_with(want), "{s:?}: {e}");
        }
    }

    #[test]
    fn block_hashes_are_32_bytes_and_cover_full_blocks_only() {
        assert_eq!(hash_of(&[5; 32]).unwrap(), [5; 32]);
        for n in [0, 31, 33] {
            let e = hash_of(&vec![0; n]).unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument);
            assert_eq!(e.reason(), format!("a block hash is {n} bytes, not 32"));
        }
        let tokens: Vec<u32> = (0..40).collect();
        let h = hashes_for("t", &tokens, 16);
        assert_eq!(h.len(), 2, "40 tokens are 2 full blocks of 16");
        assert_eq!(h, hashes_for("t", &tokens[..32], 16), "the partial block adds nothing");
        assert_ne!(h, hashes_for("u", &tokens, 16), "hashes are salted with the tenant");
        assert_eq!(hashes_for("t", &tokens[..32], 16)[0], hashes_for("t", &tokens[..16], 16)[0]);
    }

    fn descriptor(lens: &[u64]) -> Vec<u8> {
        let d = CudaIpcDescriptor {
            handles: lens.iter().map(|&len| IpcRegion { handle: [7; 64], offset: 0, len }).collect(),
            device: 0,
            device_uuid: None,
            ready_event: None,
        };
        serde_json::to_vec(&d).unwrap()
    }

    #[test]
    fn a_cuda_descriptor_must_cover_the_layouts_regions() {
        let d = parse_cuda_descriptor(&descriptor(&[4096, 8192]), &[4096, 4096]).unwrap();
        assert_eq!(d.handles.len(), 2);
        let cases: [(Vec<u8>, &[u64], &str); 4] = [
            (b"{not json".to_vec(), &[4096], "cuda.descriptor_json: "),
            (descriptor(&[]), &[4096], "cuda.descriptor_json: "),
            (descriptor(&[4096]), &[4096, 4096], "the CUDA IPC descriptor has 1 regions, the layout has 2"),
            (
                descriptor(&[4096, 100]),
                &[4096, 4096],
                "CUDA IPC region 1 is 100 bytes, the layout needs 4096",
            ),
        ];
        for (json, lens, want) in cases {
            let e = parse_cuda_descriptor(&json, lens).unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument);
            assert!(e.reason().starts_with(want), "{e}");
        }
    }
}

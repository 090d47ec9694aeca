//! The NIXL data path itself: [`DirectBackend`], a `MemoryBackend` over an engine's
//! NIXL-registered pool, with the engine's metadata loaded into an agent of *this* process.
//!
//! Only the NIXL helper process (`helper` module) creates one: loading untrusted metadata can
//! crash the loading process (FINDINGS.md, `isolate` history in ARCHITECTURE.md), so the daemon
//! itself never does. The daemon's [`crate::NixlBackend`] forwards to a helper that runs this.

use std::time::Duration;

use kvferry_pool::{
    BoxFut, Extent, MemoryBackend, PoolError, RegionInfo, Staging, check_batch, next_backend_id,
};
use nixl_sys::{Agent, MemType, XferDescList, XferOp};

use crate::agent::{RawRegion, Role, fatal, new_agent};
use crate::descriptor::{NixlPoolDescriptor, NixlRegion};
use crate::xfer::{self, Plan};
use crate::{BACKEND, ensure_nixl};

/// An engine's pool as seen from the daemon: the daemon's own NIXL agent with the engine's
/// metadata loaded. Reads are NIXL READs into staging, writes are NIXL WRITEs from staging.
///
/// Needs a tokio runtime with timers (the daemon's) to poll transfers; elsewhere it falls back
/// to short blocking sleeps.
#[derive(Debug)]
pub(crate) struct DirectBackend {
    id: u64,
    agent: Agent,
    peer: String,
    regions: Vec<NixlRegion>,
    infos: Vec<RegionInfo>,
    remote_type: MemType,
    timeout: Duration,
}

impl DirectBackend {
    /// Attach to the pool `desc` describes.
    ///
    /// Validates the descriptor and the metadata's header before NIXL sees them, loads the
    /// metadata (NIXL's own refusal also becomes `PoolError::BadMetadata`), checks that the
    /// loaded agent is the one the descriptor names and that every region is covered by that
    /// agent's registrations. Accepts metadata from any NIXL agent, including one created by
    /// NIXL's Python API.
    pub(crate) fn attach_with(
        desc: &NixlPoolDescriptor,
        agent_name: Option<String>,
        timeout: Duration,
    ) -> Result<Self, PoolError> {
        ensure_nixl()?;
        let kind = desc.validate()?;
        let id = next_backend_id();
        let name = agent_name.unwrap_or_else(|| format!("kvferry-daemon-{}-{id}", std::process::id()));
        if name == desc.agent_name {
            return Err(PoolError::BadMetadata(format!(
                "engine agent {name:?} has the daemon agent's name: agent names must be unique"
            )));
        }
        let agent = new_agent(&name, Role::Initiator)?;
        let peer = agent.load_remote_md(&desc.agent_metadata).map_err(|e| {
            PoolError::BadMetadata(format!("NIXL refused the metadata of agent {:?}: {e}", desc.agent_name))
        })?;
        if peer != desc.agent_name {
            // Unreachable after validate() unless NIXL parses names differently; keep it honest.
            let _ = agent.invalidate_remote_md(&peer);
            return Err(PoolError::BadMetadata(format!(
                "metadata loaded as agent {peer:?}, descriptor names {:?}",
                desc.agent_name
            )));
        }
        let remote_type = kind.nixl();
        for (i, r) in desc.regions.iter().enumerate() {
            let mut probe = XferDescList::new(remote_type).map_err(|e| fatal("create descriptor list", e))?;
            probe.add_desc(r.addr as usize, r.len as usize, r.dev);
            if !agent.check_remote_metadata(&peer, Some(&probe)) {
                let _ = agent.invalidate_remote_md(&peer);
                return Err(PoolError::BadMetadata(format!(
                    "region {i} ({:#x}+{} {:?} dev {}) is not registered by agent {peer:?}",
                    r.addr, r.len, r.mem_type, r.dev
                )));
            }
        }
        let infos = desc.regions.iter().map(|r| RegionInfo { len: r.len }).collect();
        Ok(Self { id, agent, peer, regions: desc.regions.clone(), infos, remote_type, timeout })
    }

    /// Name of the engine's agent this backend talks to.
    pub(crate) fn peer(&self) -> &str {
        &self.peer
    }

    /// Name of this process's agent.
    pub(crate) fn agent_name(&self) -> String {
        self.agent.name()
    }

    /// Register `staging` (whatever memory it covers) with this agent; the registration is
    /// released with the buffer, before its memory.
    pub(crate) fn register(&self, staging: Staging) -> Result<Staging, PoolError> {
        if staging.capacity() == 0 {
            return Ok(staging);
        }
        let raw = RawRegion {
            addr: staging.as_ptr().expose_provenance(),
            len: staging.capacity(),
            mem_type: MemType::Dram,
            dev: 0,
        };
        let handle = self
            .agent
            .register_memory(&raw, None)
            .map_err(|e| fatal(format!("register {} bytes of staging", raw.len), e))?;
        Ok(staging.with_guard(Box::new(handle)))
    }

    /// Map validated `extents` onto (staging address, engine address, len) pieces, skipping
    /// zero-length extents (NIXL rejects empty descriptors; they move nothing anyway).
    fn plan(&self, extents: &[Extent], staging_addr: usize) -> Plan {
        let mut plan = Plan::default();
        let mut at = 0usize;
        for e in extents {
            // check_batch proved region, offset + len <= region len, and the sum fits staging;
            // descriptor validation proved addr + len fits usize.
            let len = e.len as usize;
            if len > 0 {
                let r = &self.regions[e.region as usize];
                plan.push(staging_addr + at, (r.addr + e.offset) as usize, len, r.dev);
            }
            at += len;
        }
        plan
    }
}

impl MemoryBackend for DirectBackend {
    fn name(&self) -> &'static str {
        BACKEND
    }

    fn id(&self) -> u64 {
        self.id
    }

    fn regions(&self) -> &[RegionInfo] {
        &self.infos
    }

    fn staging(&self, len: usize) -> Result<Staging, PoolError> {
        // The handle deregisters on drop; Staging drops its guard before freeing the memory.
        self.register(Staging::new_host(len, self.id))
    }

    fn read<'a>(
        &'a self,
        extents: &'a [Extent],
        staging: &'a mut Staging,
    ) -> BoxFut<'a, Result<(), PoolError>> {
        Box::pin(async move {
            check_batch(&self.infos, extents, staging.len(), staging.owner(), self.id)?;
            let plan = self.plan(extents, staging.as_mut_ptr().expose_provenance());
            // `staging` stays mutably borrowed by this future until the transfer is over.
            xfer::run(&self.agent, &self.peer, XferOp::Read, self.remote_type, &plan, self.timeout).await
        })
    }

    fn write<'a>(&'a self, extents: &'a [Extent], staging: &'a Staging) -> BoxFut<'a, Result<(), PoolError>> {
        Box::pin(async move {
            check_batch(&self.infos, extents, staging.len(), staging.owner(), self.id)?;
            let plan = self.plan(extents, staging.as_ptr().expose_provenance());
            xfer::run(&self.agent, &self.peer, XferOp::Write, self.remote_type, &plan, self.timeout).await
        })
    }
}

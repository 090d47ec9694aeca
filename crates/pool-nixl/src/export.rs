//! Engine side: register pool memory with the engine's own NIXL agent and describe it for the
//! daemon ([`NixlPoolExport`]).

use kvferry_pool::PoolError;
use nixl_sys::{Agent, RegistrationHandle};

use crate::agent::{RawRegion, Role, fatal, new_agent};
use crate::descriptor::{MemKind, NixlPoolDescriptor, NixlRegion};
use crate::ensure_nixl;

/// An engine's pool memory, registered with the engine's NIXL agent.
///
/// Dropping it deregisters every region and destroys the agent; after that a daemon's
/// transfers fail (they never touch the memory).
#[derive(Debug)]
pub struct NixlPoolExport {
    // Declared first so the registrations are released before the agent handle is dropped.
    registrations: Vec<RegistrationHandle>,
    regions: Vec<NixlRegion>,
    agent: Agent,
    name: String,
}

impl NixlPoolExport {
    /// A new engine-side agent named `agent_name` (unique among the agents a daemon talks to)
    /// with a UCX backend and no regions yet.
    pub fn new(agent_name: &str) -> Result<Self, PoolError> {
        ensure_nixl()?;
        if agent_name.is_empty() || agent_name.contains('\0') {
            return Err(PoolError::BadMetadata(format!("invalid agent name {agent_name:?}")));
        }
        let agent = new_agent(agent_name, Role::Target)?;
        Ok(Self { registrations: Vec::new(), regions: Vec::new(), agent, name: agent_name.to_owned() })
    }

    /// Register one region; returns its index (the `Extent::region` the daemon will use).
    ///
    /// # Safety
    /// `[region.addr, region.addr + region.len)` must be memory of kind `region.mem_type`
    /// (on device `region.dev`) that stays allocated and mapped until this export is dropped.
    /// Any daemon given the descriptor may read and write it at any time meanwhile, so the
    /// engine must treat it as shared memory (no Rust references held across such accesses).
    pub unsafe fn register(&mut self, region: NixlRegion) -> Result<u32, PoolError> {
        let index = u32::try_from(self.regions.len())
            .map_err(|_| PoolError::BadMetadata("too many regions".into()))?;
        let valid = region.len > 0
            && region.addr != 0
            && region.addr.checked_add(region.len).is_some_and(|end| usize::try_from(end).is_ok())
            && (region.mem_type == MemKind::Vram || region.dev == 0);
        if !valid {
            return Err(PoolError::BadMetadata(format!("cannot register region {region:?}")));
        }
        let raw = RawRegion {
            addr: region.addr as usize,
            len: region.len as usize,
            mem_type: region.mem_type.nixl(),
            dev: region.dev,
        };
        let handle = self
            .agent
            .register_memory(&raw, None)
            .map_err(|e| fatal(format!("register region {index} ({} bytes)", region.len), e))?;
        self.registrations.push(handle);
        self.regions.push(region);
        Ok(index)
    }

    /// The descriptor to hand the daemon: this agent's current metadata and the regions.
    pub fn descriptor(&self) -> Result<NixlPoolDescriptor, PoolError> {
        let agent_metadata = self.agent.get_local_md().map_err(|e| fatal("get local metadata", e))?;
        Ok(NixlPoolDescriptor {
            agent_name: self.name.clone(),
            agent_metadata,
            regions: self.regions.clone(),
        })
    }

    /// The agent's name.
    pub fn agent_name(&self) -> &str {
        &self.name
    }

    /// The regions registered so far.
    pub fn regions(&self) -> &[NixlRegion] {
        &self.regions
    }
}

//! NIXL engine-side fixtures: host memory registered with an engine-side NIXL agent, and a
//! `RegisterPool` request carrying its descriptor.

use kvferry_pool_nixl::{MemKind, NixlPoolExport, NixlRegion};
use kvferry_proto::v1::{NixlAccess, RegisterPoolRequest, register_pool_request};

pub fn request(engine: &str, descriptor_json: Vec<u8>) -> RegisterPoolRequest {
    RegisterPoolRequest {
        engine_id: engine.into(),
        model_id: "model-nixl-test".into(),
        layout: Some(super::spec()),
        access: Some(register_pool_request::Access::Nixl(NixlAccess { descriptor_json })),
        profile: Some(super::profile()),
    }
}

/// Host memory registered with an engine-side NIXL agent; the export is dropped first.
pub struct EnginePool {
    pub export: Option<NixlPoolExport>,
    pub regions: Vec<Vec<u8>>,
}

impl Drop for EnginePool {
    fn drop(&mut self) {
        self.export.take();
    }
}

pub fn engine_pool(lens: &[u64]) -> EnginePool {
    let mut export = NixlPoolExport::new(&format!("kvferry-test-engine-{}", std::process::id()))
        .unwrap_or_else(|e| panic!("NIXL is required: `source deploy/install-nixl.sh` first ({e})"));
    let mut regions: Vec<Vec<u8>> =
        lens.iter().enumerate().map(|(i, &l)| vec![i as u8 + 1; l as usize]).collect();
    for r in &mut regions {
        let region =
            NixlRegion { addr: r.as_mut_ptr() as u64, len: r.len() as u64, mem_type: MemKind::Dram, dev: 0 };
        // SAFETY: the Vec's heap buffer is plain host memory of exactly that length; it is
        // never reallocated, and `EnginePool::drop` drops the export (deregistering) before the
        // Vecs are freed. The test reads the Vecs only while no transfer is in flight.
        unsafe { export.register(region) }.unwrap();
    }
    EnginePool { export: Some(export), regions }
}

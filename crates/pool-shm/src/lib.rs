//! The shared-memory pool backend (the embedded default): the engine's KV pool lives in a
//! sealed memfd that the engine maps and passes to the daemon over a Unix socket
//! (`SCM_RIGHTS`); the daemon maps the same file and implements `MemoryBackend` over it.
//!
//! Codemap: `table` (regions inside the file), `mapping` (memfd creation, mmap, bounded raw
//! copies: the unsafe lives here), `backend` (`ShmBackend`), `transport` (offer frames with the
//! fd attached). CPU only; no knowledge of engines beyond `kvferry-layout`.

mod backend;
mod mapping;
mod table;
mod transport;

pub use backend::{CloseHandle, ShmBackend};
pub use mapping::{Mapping, create_memfd};
pub use table::{REGION_ALIGN, RegionTable, ShmRegion};
pub use transport::{MAGIC, MAX_BODY, Offer, accept_pool, recv_offer, send_frame, send_offer};

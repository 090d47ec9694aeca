//! kvferry-peer: QUIC (and TLS-over-TCP) endpoints with mutual TLS between regions, the transfer driver over the
//! sans-IO cores of `kvferry-wire`, and transport tuning for long fat pipes.

mod budget;
mod coalesce;
pub mod io;
mod link;
pub mod node;
mod offload;
mod owner;
pub mod pool_io;
pub mod probe;
pub mod query;
mod recvbuf;
mod requester;
mod router;
pub mod stripe;
mod tcp;
pub mod tls;
pub mod tolerant;
pub mod transport;

pub use io::{BoxFut, ChunkBytes, ChunkError, ChunkSink, ChunkSource};
pub use link::{LinkInfo, Transport, TransportChoice};
pub use node::{BlockCatalog, Credentials, FetchPolicy, PeerConfig, PeerNode, Rotation, Served};
pub use pool_io::{FlatChunks, PoolChunks, flat_span};
pub use probe::{MAX_PROBE_BYTES, ProbeReceipt};
pub use query::Holdings;
pub use requester::{FetchReceipt, FetchSpec};
pub use tcp::MAX_PENDING as MAX_PENDING_TCP;
pub use tls::{DevPki, PeerSide, RegionId, TlsIdentity, TrustPolicy};
pub use transport::{Congestion, LinkTuning};

//! kvferry's peer protocol: KV blocks between regions in pipelined, checksummed, resumable
//! chunks.
//!
//! The core is sans-IO, in the manner of `quinn-proto`: no sockets, no runtime, no clock (time
//! is passed in). [`frame`] is the byte format, [`plan`] cuts a transfer into layer-major chunks,
//! [`state`] is the transition table, [`requester`] and [`owner`] are the two ends of one
//! transfer, [`estimator`] the link estimator, [`checksum`] the chunk checksums and transfer
//! digest. The async driver over quinn lives in another crate (`kvferry-peer`) and only moves
//! bytes between sockets, pools and these cores.

pub mod checksum;
pub mod error;
pub mod estimator;
pub mod frame;
pub mod owner;
pub mod plan;
pub mod requester;
pub mod state;

pub use checksum::Summed;
pub use error::{Cause, LocalError, WireError};
pub use estimator::{EstimatorConfig, EstimatorError, LinkEstimate, LinkEstimator};
pub use frame::{BlockHash, ChunkHeader, Done, FetchRequest, Frame, Manifest, Probe, Refusal, RefusalCode};
pub use owner::{Owner, Work};
pub use plan::{ChunkPlan, ChunkSpec};
pub use requester::{ChunkVerdict, Requester, RequesterConfig};
pub use state::{Event, Machine, State};

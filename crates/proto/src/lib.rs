//! Generated gRPC types and services for `kvferry.v1` (see `proto/kvferry/v1/kvferry.proto`).
//! Nothing here is hand-written except this wrapper: the code is regenerated on every build
//! from the .proto by `build.rs`, with no `protoc` install.

#![allow(missing_docs, missing_debug_implementations, clippy::all, clippy::pedantic, unused_qualifications)]

/// The `kvferry.v1` package.
pub mod v1 {
    tonic::include_proto!("kvferry.v1");
}

/// Encoded `FileDescriptorSet` of the API, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/kvferry_descriptor.bin"));

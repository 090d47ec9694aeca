//! Generates the gRPC code from `proto/kvferry/v1/kvferry.proto` with protox (a pure-Rust
//! protobuf compiler), so a normal build needs no `protoc`. The file descriptor set is kept in
//! OUT_DIR for gRPC server reflection. Regenerate: `cargo build -p kvferry-proto`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Read at run time, not with env!(): worktrees sharing one CARGO_TARGET_DIR share this
    // build script's binary, and a path baked in at its compile time is another checkout's.
    let root = std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let file = root.join("kvferry/v1/kvferry.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let fds = protox::compile([&file], [&root])?;
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("kvferry_descriptor.bin"), prost::Message::encode_to_vec(&fds))?;
    tonic_prost_build::configure().build_client(true).build_server(true).compile_fds(fds)?;
    Ok(())
}

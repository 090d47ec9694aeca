//! One side of the `nixl-ucx-tcp` baseline; see `kvferry_baselines::nixl_peer`.

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    kvferry_baselines::nixl_peer::peer_main(&args)
}

//! Gather/scatter throughput of the CUDA backend next to a plain device↔host `cuMemcpy` of the
//! same bytes, measured in the same run.
//!
//! Shapes: 64 blocks of 2 MiB (every other block of the pool, so nothing coalesces) and 4096
//! blocks of 32 KiB (per-layer K/V block size of a small model), each with both copy paths.
//! Baseline: one contiguous `cuMemcpyDtoHAsync` / `cuMemcpyHtoDAsync` of the same byte count
//! between the pool and the same pinned staging. Prints a table; writes it (and JSON lines) to
//! `$OUT/cuda_bench.txt` / `$OUT/cuda_bench.jsonl` when `OUT` is set. Without a GPU it prints
//! `SKIPPED: no CUDA driver` and exits 0.
//!
//! Run: `cargo run --release -p kvferry-pool-cuda --features cuda --example cuda_bench`.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys;
use kvferry_pool::{Extent, MemoryBackend, Staging};
use kvferry_pool_cuda::{
    CopyPath, CudaBackend, CudaBackendConfig, EnginePool, PathChoice, unavailable_reason,
};

const REPS: usize = 10;

fn gib_s(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / secs / (1u64 << 30) as f64
}

/// Best-of-`REPS` seconds (after one warm-up) of `f`.
fn best(mut f: impl FnMut()) -> f64 {
    f();
    (0..REPS)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// One contiguous copy of `bytes` between `dev` and the staging buffer, synchronously.
fn plain_copy(
    ctx: &Arc<cudarc::driver::CudaContext>,
    dev: u64,
    st: &mut Staging,
    bytes: usize,
    to_host: bool,
) {
    ctx.bind_to_thread().expect("bind");
    let host = st.as_mut_ptr();
    // SAFETY: `dev .. dev + bytes` is inside the pool's first region (the caller sized it) and
    // `host` is the registered staging buffer of at least `bytes` bytes; the copy is complete
    // when cuCtxSynchronize returns, before the borrow of `st` ends.
    let r = unsafe {
        if to_host {
            sys::cuMemcpyDtoHAsync_v2(host.cast(), dev, bytes, std::ptr::null_mut())
        } else {
            sys::cuMemcpyHtoDAsync_v2(dev, host.cast(), bytes, std::ptr::null_mut())
        }
    };
    r.result().expect("plain copy");
    ctx.synchronize().expect("sync");
}

struct Row {
    shape: String,
    path: &'static str,
    gather: f64,
    scatter: f64,
    plain_dtoh: f64,
    plain_htod: f64,
}

fn main() {
    if let Some(reason) = unavailable_reason() {
        println!("SKIPPED: no CUDA driver ({reason})");
        return;
    }
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let shapes: [(u64, u64); 2] = [(64, 2 << 20), (4096, 32 << 10)];
    let mut rows = Vec::new();
    let mut calib = String::new();
    for (count, block) in shapes {
        let bytes = count * block;
        // Every other block: 2 * bytes of pool.
        let pool = Arc::new(EnginePool::allocate(0, &[2 * bytes]).expect("allocate"));
        let extents: Vec<Extent> =
            (0..count).map(|i| Extent { region: 0, offset: 2 * i * block, len: block }).collect();
        let mut backend: CudaBackend = pool
            .in_process_backend(CudaBackendConfig {
                gather: PathChoice::Fixed(CopyPath::Memcpy),
                scatter: PathChoice::Fixed(CopyPath::Memcpy),
                ..CudaBackendConfig::default()
            })
            .expect("backend");
        let mut st = backend.staging(bytes as usize).expect("staging");
        let ctx = backend.context().clone();
        let plain_dtoh =
            gib_s(bytes, best(|| plain_copy(&ctx, pool.region_ptr(0), &mut st, bytes as usize, true)));
        let plain_htod =
            gib_s(bytes, best(|| plain_copy(&ctx, pool.region_ptr(0), &mut st, bytes as usize, false)));
        for path in [CopyPath::Memcpy, CopyPath::Kernel] {
            if let Err(e) = backend.set_paths(path, path) {
                println!("{path:?} path unavailable: {e}");
                continue;
            }
            let gather = gib_s(bytes, best(|| rt.block_on(backend.read(&extents, &mut st)).expect("gather")));
            let scatter = gib_s(bytes, best(|| rt.block_on(backend.write(&extents, &st)).expect("scatter")));
            let path = if path == CopyPath::Memcpy { "memcpy" } else { "kernel" };
            rows.push(Row {
                shape: format!("{count} x {} KiB", block >> 10),
                path,
                gather,
                scatter,
                plain_dtoh,
                plain_htod,
            });
        }
        match backend.calibrate(block, count.min(128) as usize, 3) {
            Ok(t) => writeln!(calib, "calibration {count} x {} KiB: {t:?}", block >> 10).expect("string"),
            Err(e) => {
                writeln!(calib, "calibration {count} x {} KiB failed: {e}", block >> 10).expect("string")
            }
        }
    }
    let dev = backend_device_name();
    let mut table = format!("device: {dev}\n");
    writeln!(
        table,
        "{:<16} {:<7} {:>14} {:>14} {:>16} {:>16}",
        "shape", "path", "gather GiB/s", "scatter GiB/s", "plain DtoH GiB/s", "plain HtoD GiB/s"
    )
    .expect("string");
    let mut jsonl = String::new();
    for r in &rows {
        writeln!(
            table,
            "{:<16} {:<7} {:>14.2} {:>14.2} {:>16.2} {:>16.2}",
            r.shape, r.path, r.gather, r.scatter, r.plain_dtoh, r.plain_htod
        )
        .expect("string");
        writeln!(
            jsonl,
            "{{\"shape\":\"{}\",\"path\":\"{}\",\"gather_gib_s\":{:.3},\"scatter_gib_s\":{:.3},\"plain_dtoh_gib_s\":{:.3},\"plain_htod_gib_s\":{:.3}}}",
            r.shape, r.path, r.gather, r.scatter, r.plain_dtoh, r.plain_htod
        )
        .expect("string");
    }
    table.push_str(&calib);
    print!("{table}");
    if let Some(out) = std::env::var_os("OUT") {
        let out = std::path::PathBuf::from(out);
        std::fs::write(out.join("cuda_bench.txt"), &table).expect("write cuda_bench.txt");
        std::fs::write(out.join("cuda_bench.jsonl"), &jsonl).expect("write cuda_bench.jsonl");
    }
}

fn backend_device_name() -> String {
    cudarc::driver::CudaContext::new(0).and_then(|c| c.name()).unwrap_or_else(|e| format!("? ({e})"))
}

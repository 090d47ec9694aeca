//! Benchmark (plain bin, `harness = false`): shm backend read (gather) and write (scatter) of
//! 64 blocks × 2 MiB, against a plain `memcpy` of the same bytes between private buffers in
//! the same run. Prints GiB/s (best and median of N iterations) as a Markdown table.
//!
//! Run: `cargo bench -p kvferry-pool-shm --bench shm_copy`

use std::time::Instant;

use kvferry_pool::{Extent, MemoryBackend};
use kvferry_pool_shm::{Mapping, RegionTable, ShmBackend, create_memfd};

const BLOCK: u64 = 2 << 20;
const BLOCKS: u64 = 64;
const ITERS: usize = 30;

fn gib_s(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / secs / f64::from(1u32 << 30)
}

fn stats(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    (v[v.len() - 1], v[v.len() / 2])
}

fn main() {
    let total = BLOCK * BLOCKS;
    // Pool of 2x the batch so blocks are scattered (every other block), like a real block set.
    let table = RegionTable::packed(&[2 * total]).expect("table");
    let fd = create_memfd("bench", table.file_len()).expect("memfd");
    // A second, independent mapping of the same file: raw copies without the backend.
    let raw = Mapping::map(fd.try_clone().expect("dup"), table.file_len()).expect("map raw");
    let backend = ShmBackend::new(fd, table).expect("map");
    let extents: Vec<Extent> =
        (0..BLOCKS).map(|b| Extent { region: 0, offset: 2 * b * BLOCK, len: BLOCK }).collect();
    let mut staging = backend.staging(total as usize).expect("staging");
    staging.as_mut_slice().iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
    let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");

    // Touch every page first (page faults are a one-off cost of a fresh pool).
    rt.block_on(backend.write(&extents, &staging)).expect("warm write");
    rt.block_on(backend.read(&extents, &mut staging)).expect("warm read");
    let src = vec![7u8; total as usize];
    let mut dst = vec![0u8; total as usize];
    dst.copy_from_slice(&src);

    let (mut w, mut r, mut m, mut x) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ITERS {
        let t = Instant::now();
        rt.block_on(backend.write(&extents, &staging)).expect("write");
        w.push(gib_s(total, t.elapsed().as_secs_f64()));
        let t = Instant::now();
        rt.block_on(backend.read(&extents, &mut staging)).expect("read");
        r.push(gib_s(total, t.elapsed().as_secs_f64()));
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        m.push(gib_s(total, t.elapsed().as_secs_f64()));
        let t = Instant::now();
        for (i, e) in extents.iter().enumerate() {
            let at = i * BLOCK as usize;
            raw.write_at(e.offset, &src[at..at + BLOCK as usize]).expect("raw write");
        }
        x.push(gib_s(total, t.elapsed().as_secs_f64()));
    }
    println!("64 x 2 MiB = {} MiB per batch, {ITERS} iterations, after one warm-up pass\n", total >> 20);
    println!("| operation | best GiB/s | median GiB/s |");
    println!("| --- | ---: | ---: |");
    for (name, v) in [
        ("shm write (scatter into pool)", w),
        ("shm read (gather from pool)", r),
        ("plain memcpy of the same bytes, private to private", m),
        ("raw memcpy into the shm mapping, same extents, no backend", x),
    ] {
        let (best, med) = stats(v);
        println!("| {name} | {best:.2} | {med:.2} |");
    }
}

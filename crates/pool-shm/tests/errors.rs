//! Bad input across a real Unix socket gets a typed error and maps nothing: a peer that closes
//! before offering, a frame without an fd, a bad magic, a table larger than the file, an
//! unsealed file, a layout that disagrees with the table; and a backend closed after the
//! engine went away refuses further batches.

use std::io::Write;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;

use kvferry_layout::{AttnSpec, Dtype, PoolLayout, StrideOrder};
use kvferry_pool::{Extent, MemoryBackend, PoolError};
use kvferry_pool_shm::{
    MAGIC, Offer, RegionTable, ShmBackend, ShmRegion, accept_pool, create_memfd, send_frame, send_offer,
};

fn offer(table: RegionTable) -> Offer {
    Offer { model_id: "m".into(), layout: None, table }
}

#[test]
fn peer_closing_before_offer_is_closed() {
    let (a, b) = UnixStream::pair().unwrap();
    drop(a);
    assert!(matches!(accept_pool(&b), Err(PoolError::Closed)));
    // closed half-way through a frame
    let (a, b) = UnixStream::pair().unwrap();
    (&a).write_all(&MAGIC[..5]).unwrap();
    drop(a);
    assert!(matches!(accept_pool(&b), Err(PoolError::Closed)));
}

#[test]
fn frame_without_fd_or_bad_magic_is_bad_metadata() {
    let (a, b) = UnixStream::pair().unwrap();
    let body = serde_json::to_vec(&offer(RegionTable::packed(&[4096]).unwrap())).unwrap();
    let mut frame = MAGIC.to_vec();
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(&body);
    (&a).write_all(&frame).unwrap();
    assert!(matches!(accept_pool(&b), Err(PoolError::BadMetadata(m)) if m.contains("0 fds")));

    let (a, b) = UnixStream::pair().unwrap();
    (&a).write_all(b"HTTP/1.1 200 OK\r\n").unwrap();
    assert!(matches!(accept_pool(&b), Err(PoolError::BadMetadata(m)) if m.contains("magic")));

    let (a, b) = UnixStream::pair().unwrap();
    let mut frame = MAGIC.to_vec();
    frame.extend_from_slice(&u32::MAX.to_le_bytes());
    (&a).write_all(&frame).unwrap();
    assert!(matches!(accept_pool(&b), Err(PoolError::BadMetadata(m)) if m.contains("exceeds")));
}

#[test]
fn table_past_the_file_end_is_refused() {
    // The engine claims 64 KiB but the file has 4 KiB: mapping it could SIGBUS.
    let fd = create_memfd("short", 4096).unwrap();
    let table = RegionTable::packed(&[65_536]).unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    send_offer(&a, &offer(table), fd.as_fd()).unwrap();
    assert!(matches!(accept_pool(&b), Err(PoolError::BadMetadata(m)) if m.contains("truncated")));
}

#[test]
fn unsealed_file_is_refused() {
    let fd = rustix::fs::memfd_create("unsealed", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&fd, 8192).unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    send_offer(&a, &offer(RegionTable::packed(&[8192]).unwrap()), fd.as_fd()).unwrap();
    assert!(matches!(accept_pool(&b), Err(PoolError::BadMetadata(m)) if m.contains("seal")));
}

#[test]
fn forged_table_is_refused_on_receipt() {
    // Overlapping regions, written as raw JSON (the sender's types cannot build it), sent with
    // a real fd through the real framing.
    let fd = create_memfd("forged", 8192).unwrap();
    let good = offer(RegionTable::new(vec![ShmRegion { offset: 0, len: 4096 }], 8192).unwrap());
    let good_body = serde_json::to_string(&good).unwrap();
    let forged = good_body.replace(
        r#""regions":[{"offset":0,"len":4096}]"#,
        r#""regions":[{"offset":0,"len":8192},{"offset":4096,"len":10}]"#,
    );
    assert_ne!(forged, good_body);
    let (a, b) = UnixStream::pair().unwrap();
    send_frame(&a, good_body.as_bytes(), fd.as_fd()).unwrap();
    assert!(accept_pool(&b).is_ok(), "the unforged frame is accepted");
    send_frame(&a, forged.as_bytes(), fd.as_fd()).unwrap();
    assert!(matches!(accept_pool(&b), Err(PoolError::BadMetadata(m)) if m.contains("overlap")));
}

#[test]
fn layout_disagreeing_with_table_is_refused() {
    let spec = AttnSpec { layers: 2, kv_heads: 1, head_dim: 8, block_size: 4, dtype: Dtype::F16 };
    let layout = PoolLayout::vllm_flash_attn(spec, 4, StrideOrder::Nhd).unwrap();
    let table = RegionTable::packed(&[512, 100]).unwrap();
    let fd = create_memfd("mismatch", table.file_len()).unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    send_offer(&a, &Offer { model_id: "m".into(), layout: Some(layout), table }, fd.as_fd()).unwrap();
    assert!(matches!(accept_pool(&b), Err(PoolError::BadMetadata(m)) if m.contains("region lengths")));
}

#[test]
fn engine_gone_then_closed() {
    let table = RegionTable::packed(&[8192]).unwrap();
    let fd = create_memfd("gone", table.file_len()).unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    send_offer(&a, &offer(table), fd.as_fd()).unwrap();
    let (_, backend): (Offer, ShmBackend) = accept_pool(&b).unwrap();
    drop((a, fd)); // the engine exits: its fd and socket close
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let ext = [Extent { region: 0, offset: 0, len: 4096 }];
    let mut st = backend.staging(4096).unwrap();
    // The mapping keeps the memory alive: still safe to use until the daemon closes it.
    rt.block_on(backend.read(&ext, &mut st)).unwrap();
    // The daemon notices EOF on the engine's socket and closes the pool.
    let mut buf = [0u8; 1];
    assert_eq!(std::io::Read::read(&mut &b, &mut buf).unwrap(), 0);
    backend.close_handle().close();
    assert!(matches!(rt.block_on(backend.read(&ext, &mut st)), Err(PoolError::Closed)));
    assert!(matches!(rt.block_on(backend.write(&ext, &st)), Err(PoolError::Closed)));
}

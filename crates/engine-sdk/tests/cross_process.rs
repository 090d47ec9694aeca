//! An engine in ANOTHER PROCESS (this test binary re-run as a child, selected by an env var)
//! creates a `ShmPool` for a vLLM HND layout, fills blocks with bytes derived from their block
//! hashes, and shares the pool over a Unix socket in a temp dir. The daemon side (this process)
//! accepts it, checks the fingerprint, gathers the blocks through the shm backend and compares
//! them with what it computes itself from the same tokens; then it scatters new bytes, and the
//! engine verifies them through its own mapping. Also: a mismatched fingerprint is refused,
//! and an engine that exits leaves a pool the daemon closes.

use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::process::{Command, Stdio};

use kvferry_engine_sdk::{AttnSpec, Dtype, PoolLayout, ShmPool, StrideOrder, block_hashes};
use kvferry_pool::{MemoryBackend, PoolError};
use kvferry_pool_shm::accept_pool;

const CHILD_ENV: &str = "KVFERRY_SDK_ENGINE_SOCKET";
const MODEL: &str = "ref-llama-tiny";
const BLOCK_TOKENS: u32 = 16;

fn layout() -> PoolLayout {
    let spec =
        AttnSpec { layers: 4, kv_heads: 2, head_dim: 64, block_size: BLOCK_TOKENS, dtype: Dtype::Bf16 };
    PoolLayout::vllm_flash_attn(spec, 64, StrideOrder::Hnd).unwrap()
}

fn tokens() -> Vec<u32> {
    (0..5 * BLOCK_TOKENS).map(|i| (i * 7919) % 32_000).collect()
}

/// Engine-chosen block ids for the prompt's 5 blocks.
const BLOCKS: [u32; 5] = [40, 3, 17, 18, 63];

/// Bytes a block holds: a stream seeded by its hash (so both sides can compute them).
fn block_bytes(hash: &[u8; 32], len: usize, salt: u8) -> Vec<u8> {
    (0..len).map(|i| hash[i % 32] ^ (i / 32) as u8 ^ salt).collect()
}

fn expected(layout: &PoolLayout, salt: u8) -> Vec<u8> {
    // Staging order: layer, plane, block. One block's bytes per (layer, plane).
    let hashes = block_hashes(b"tenant-1", &tokens(), BLOCK_TOKENS);
    let per_plane = layout.planes(0).unwrap()[0].block_bytes as usize;
    let mut out = Vec::new();
    for layer in 0..layout.num_layers() {
        for plane in 0..layout.planes(layer).unwrap().len() {
            for h in &hashes {
                out.extend(block_bytes(h, per_plane, salt ^ (layer * 2 + plane as u32) as u8));
            }
        }
    }
    out
}

/// The child: an engine.
#[test]
fn engine_process() {
    let Ok(path) = std::env::var(CHILD_ENV) else { return };
    let mode = std::env::var("KVFERRY_SDK_MODE").unwrap_or_default();
    let pool = ShmPool::create(layout()).unwrap();
    let l = pool.layout().clone();
    pool.write_blocks(&BLOCKS, 0..l.num_layers(), &expected(&l, 0)).unwrap();
    let model = if mode == "wrong-model" { "another-model" } else { MODEL };
    let mut s = pool.connect_and_share(&path, model).unwrap();
    if mode == "exit" {
        return; // engine exits right after sharing
    }
    // Wait for the daemon's scatter, then verify it in our own mapping.
    let mut go = [0u8; 1];
    if s.read_exact(&mut go).is_err() {
        return;
    }
    let mut got = vec![0u8; l.staging_len(BLOCKS.len() as u64, 0..l.num_layers()).unwrap() as usize];
    pool.read_blocks(&BLOCKS, 0..l.num_layers(), &mut got).unwrap();
    let ok = got == expected(&l, 0xA5);
    s.write_all(&[u8::from(ok)]).unwrap();
}

fn spawn_engine(mode: &str) -> (tempfile::TempDir, UnixListener, std::process::Child) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("daemon.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "engine_process", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, &path)
        .env("KVFERRY_SDK_MODE", mode)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    (dir, listener, child)
}

#[test]
fn daemon_reads_and_writes_an_engine_pool_in_another_process() {
    let (_dir, listener, mut child) = spawn_engine("");
    let (mut stream, _) = listener.accept().unwrap();
    let (offer, backend) = accept_pool(&stream).unwrap();
    let theirs = offer.layout.as_ref().expect("layout sent").fingerprint(&offer.model_id);
    let ours = layout().fingerprint(MODEL);
    ours.check_compatible(&theirs).unwrap();
    assert_eq!(ours.digest(), theirs.digest());
    let l = offer.layout.unwrap();

    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let extents = l.extents(&BLOCKS, 0..l.num_layers()).unwrap();
    let want = expected(&l, 0);
    let mut st = backend.staging(want.len()).unwrap();
    rt.block_on(backend.read(&extents, &mut st)).unwrap();
    assert!(st.as_slice() == want.as_slice(), "gathered bytes differ from the engine's blocks");

    st.as_mut_slice().copy_from_slice(&expected(&l, 0xA5));
    rt.block_on(backend.write(&extents, &st)).unwrap();
    stream.write_all(&[1]).unwrap();
    let mut verdict = [0u8; 1];
    stream.read_exact(&mut verdict).unwrap();
    assert_eq!(verdict[0], 1, "engine saw different bytes after the daemon's scatter");
    assert!(child.wait().unwrap().success());
}

#[test]
fn mismatched_fingerprint_is_refused_naming_the_field() {
    let (_dir, listener, mut child) = spawn_engine("wrong-model");
    let (stream, _) = listener.accept().unwrap();
    let (offer, _backend) = accept_pool(&stream).unwrap();
    let theirs = offer.layout.as_ref().unwrap().fingerprint(&offer.model_id);
    let err = layout().fingerprint(MODEL).check_compatible(&theirs).unwrap_err();
    assert_eq!(err.field, "model_id");
    assert_eq!(err.theirs, "another-model");
    drop(stream);
    assert!(child.wait().unwrap().success());
}

#[test]
fn engine_exit_closes_the_pool() {
    let (_dir, listener, mut child) = spawn_engine("exit");
    let (mut stream, _) = listener.accept().unwrap();
    let (offer, backend) = accept_pool(&stream).unwrap();
    assert!(child.wait().unwrap().success());
    let l = offer.layout.unwrap();
    let extents = l.extents(&BLOCKS, 0..1).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let mut st = backend.staging(l.staging_len(BLOCKS.len() as u64, 0..1).unwrap() as usize).unwrap();
    // The memory outlives the engine process (our mapping holds it) ...
    rt.block_on(backend.read(&extents, &mut st)).unwrap();
    assert_eq!(st.as_slice(), &expected(&l, 0)[..st.len()]);
    // ... and the daemon closes the pool once it sees the socket's EOF.
    let mut b = [0u8; 1];
    assert_eq!(stream.read(&mut b).unwrap(), 0);
    backend.close();
    assert!(matches!(rt.block_on(backend.read(&extents, &mut st)), Err(PoolError::Closed)));
}

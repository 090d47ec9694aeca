//! Test support: engine processes (the `kvferry-nixl-engine` binary or a NIXL-Python script)
//! exporting memfd-backed regions, the parent's own mapping of the same memfd as the
//! independent "engine side", and the conformance fixture built from them.
//!
//! The engine runs in a separate process with its own NIXL agent; the backend under test
//! moves bytes with real NIXL transfers between the two processes. The parent never goes
//! through NIXL to check results: it reads the memfd pages the engine registered.

#![allow(dead_code)] // each test binary uses a different subset

use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use kvferry_pool::MemoryBackend;
use kvferry_pool::conformance::{EngineSide, Fixture, FixtureError};
use kvferry_pool_nixl::{DESCRIPTOR_LINE_PREFIX, NixlBackend, NixlOptions, NixlPoolDescriptor, ensure_nixl};

/// True when NIXL is usable; fails the test with instructions otherwise (a test that cannot
/// reach NIXL is a failure, never a silent pass).
pub fn nixl_available() -> bool {
    if let Err(e) = ensure_nixl() {
        panic!("NIXL is not usable: {e}\nRun `source deploy/install-nixl.sh` first.");
    }
    true
}

/// Options with this crate's `kvferry-nixl-engine --nixl-helper` as the helper process (what
/// the daemon does with `kvferry nixl-helper`) and the given transfer timeout.
pub fn helper_opts(timeout: Duration) -> NixlOptions {
    NixlOptions {
        timeout,
        helper: Some(kvferry_pool_nixl::HelperCommand::nixl_engine(env!(
            "CARGO_BIN_EXE_kvferry-nixl-engine"
        ))),
        ..NixlOptions::default()
    }
}

/// Serialize the tests of one binary: each one starts processes and UCX contexts, and the
/// machine has two cores.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// A memfd of `len` bytes mapped shared into this process.
pub struct Memfd {
    fd: OwnedFd,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory owned by this value; all access goes through
// `read`/`write`, which copy bytes and never hand out references.
unsafe impl Send for Memfd {}
// SAFETY: as above; concurrent copies race only in the way shared memory does (the suite
// never reads a range while it is being transferred).
unsafe impl Sync for Memfd {}

impl Memfd {
    pub fn new(len: usize) -> Self {
        assert!(len > 0);
        // SAFETY: a NUL-terminated name and valid flags.
        let raw = unsafe { libc::memfd_create(c"kvferry-nixl-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        // SAFETY: `raw` is a fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: plain syscall on our fd.
        let rc = unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) };
        assert_eq!(rc, 0, "ftruncate: {}", std::io::Error::last_os_error());
        // SAFETY: mapping our memfd read-write at a kernel-chosen address.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED, "mmap: {}", std::io::Error::last_os_error());
        Self { fd, ptr: ptr.cast(), len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// A path another process can open to map the same pages.
    pub fn proc_path(&self) -> String {
        format!("/proc/{}/fd/{}", std::process::id(), self.fd.as_raw_fd())
    }

    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), FixtureError> {
        self.check(offset, out.len())?;
        // SAFETY: bounds checked; the mapping lives as long as `self`; a byte copy from shared
        // memory (another process may write it, which is why no reference is formed).
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset), out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), FixtureError> {
        self.check(offset, data.len())?;
        // SAFETY: as in `read`, copying into the shared mapping.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(offset), data.len()) };
        Ok(())
    }

    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0; self.len];
        self.read(0, &mut v).expect("whole map");
        v
    }

    fn check(&self, offset: usize, n: usize) -> Result<(), FixtureError> {
        match offset.checked_add(n) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(format!("engine access {offset}+{n} outside region of {}", self.len).into()),
        }
    }
}

impl Drop for Memfd {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Which program plays the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineKind {
    /// This crate's `kvferry-nixl-engine` binary (Rust, nixl-sys).
    Rust,
    /// `tests/py_engine.py` on NIXL's own Python API (`nixl_cu12`), as vLLM uses it.
    Python,
}

/// A running engine process; closing its stdin (drop) ends it.
pub struct EngineProcess {
    child: Child,
    stdin: Option<ChildStdin>,
    pub descriptor: NixlPoolDescriptor,
}

static NEXT_ENGINE: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

impl EngineProcess {
    /// Start an engine exporting `maps` (in order) and wait for its descriptor.
    pub fn spawn(kind: EngineKind, maps: &[Memfd]) -> Self {
        let n = NEXT_ENGINE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("test-engine-{}-{n}", std::process::id());
        let mut cmd = match kind {
            EngineKind::Rust => Command::new(env!("CARGO_BIN_EXE_kvferry-nixl-engine")),
            EngineKind::Python => {
                let py = std::env::var("KVFERRY_PYTHON").unwrap_or_else(|_| "python3".into());
                let mut c = Command::new(py);
                c.arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/py_engine.py"));
                c
            }
        };
        cmd.arg("--name").arg(&name);
        for m in maps {
            cmd.arg("--region").arg(format!("{}:{}", m.proc_path(), m.len()));
        }
        Self::start(cmd)
    }

    /// Start `cmd` (which must print the descriptor line) and wait up to 60 s for it.
    pub fn start(mut cmd: Command) -> Self {
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("cannot start engine {cmd:?}: {e}"));
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = mpsc::channel();
        // Reads the descriptor line, then keeps draining (the Python API logs to stdout).
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                match line.strip_prefix(DESCRIPTOR_LINE_PREFIX) {
                    Some(json) => {
                        if let Some(tx) = tx.take() {
                            let _ = tx.send(json.to_owned());
                        }
                    }
                    None => eprintln!("[engine] {line}"),
                }
            }
        });
        let json = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(j) => j,
            Err(e) => {
                let _ = child.kill();
                let status = child.wait();
                panic!("engine {cmd:?} printed no descriptor ({e}); exit status {status:?}");
            }
        };
        let descriptor = NixlPoolDescriptor::from_json(&json).expect("engine printed a valid descriptor");
        let stdin = child.stdin.take();
        Self { child, stdin, descriptor }
    }

    /// SIGKILL the engine and reap it (simulates an engine crash).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for EngineProcess {
    fn drop(&mut self) {
        if let Some(mut stdin) = self.stdin.take() {
            let _ = stdin.write_all(b"quit\n");
        }
        for _ in 0..200 {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The engine side of a pool: the parent's own mapping of the memfds the engine registered.
/// Owns the engine process, which lives as long as this value.
pub struct MemfdEngine {
    pub maps: Vec<Memfd>,
    pub process: EngineProcess,
}

impl EngineSide for MemfdEngine {
    fn read(&self, region: u32, offset: u64, out: &mut [u8]) -> Result<(), FixtureError> {
        let m = self.maps.get(region as usize).ok_or("no such region")?;
        m.read(usize::try_from(offset)?, out)
    }

    fn write(&self, region: u32, offset: u64, data: &[u8]) -> Result<(), FixtureError> {
        let m = self.maps.get(region as usize).ok_or("no such region")?;
        m.write(usize::try_from(offset)?, data)
    }
}

/// Start an engine of `kind` over fresh memfds of `lens` bytes.
pub fn start_engine(kind: EngineKind, lens: &[u64]) -> MemfdEngine {
    let maps: Vec<Memfd> = lens.iter().map(|&l| Memfd::new(l as usize)).collect();
    let process = EngineProcess::spawn(kind, &maps);
    MemfdEngine { maps, process }
}

/// The conformance fixture: every pool is a fresh engine process plus a backend attached to it.
pub struct NixlFixture {
    pub kind: EngineKind,
    pub large_pool_bytes: u64,
}

impl Fixture for NixlFixture {
    fn create(
        &self,
        region_lens: &[u64],
    ) -> Result<(Box<dyn MemoryBackend>, Box<dyn EngineSide>), FixtureError> {
        let engine = start_engine(self.kind, region_lens);
        let opts = helper_opts(Duration::from_secs(60));
        let backend = NixlBackend::attach_with(&engine.process.descriptor, opts)?;
        Ok((Box::new(backend), Box::new(engine)))
    }

    fn large_pool_bytes(&self) -> u64 {
        self.large_pool_bytes
    }
}

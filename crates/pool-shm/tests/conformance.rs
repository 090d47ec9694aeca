//! The shared conformance suite against `ShmBackend`, twice: with the engine side in this
//! process (a second, independent mapping of the memfd), and with the engine in ANOTHER
//! PROCESS (this test binary re-run as a child, selected by `KVFERRY_SHM_ENGINE_SOCKET`) that
//! creates the memfd, sends it over a Unix socket in a temp dir, and then serves engine-side
//! reads and writes from its own mapping over the same socket.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvferry_pool::conformance::{self, Created, EngineSide, Fixture, FixtureError};
use kvferry_pool_shm::{Mapping, Offer, RegionTable, ShmBackend, accept_pool, create_memfd, send_offer};

const CHILD_ENV: &str = "KVFERRY_SHM_ENGINE_SOCKET";

/// Engine-side access through a mapping of its own, bounded per region.
struct LocalEngine {
    map: Mapping,
    table: RegionTable,
}

impl LocalEngine {
    fn at(&self, region: u32, offset: u64, len: usize) -> Result<u64, FixtureError> {
        let r = self.table.regions().get(region as usize).ok_or("no such region")?;
        if offset + len as u64 > r.len {
            return Err(format!("engine access past region {region}").into());
        }
        Ok(r.offset + offset)
    }
}

impl EngineSide for LocalEngine {
    fn read(&self, region: u32, offset: u64, out: &mut [u8]) -> Result<(), FixtureError> {
        Ok(self.map.read_at(self.at(region, offset, out.len())?, out)?)
    }
    fn write(&self, region: u32, offset: u64, data: &[u8]) -> Result<(), FixtureError> {
        Ok(self.map.write_at(self.at(region, offset, data.len())?, data)?)
    }
}

struct InProcess;

impl Fixture for InProcess {
    fn create(&self, region_lens: &[u64]) -> Result<Created, FixtureError> {
        let table = RegionTable::packed(region_lens)?;
        let fd = create_memfd("kvferry-test", table.file_len())?;
        let engine =
            LocalEngine { map: Mapping::map(fd.try_clone()?, table.file_len())?, table: table.clone() };
        let backend = ShmBackend::new(fd, table)?;
        Ok((Box::new(backend), Box::new(engine)))
    }
}

#[test]
fn conformance_in_process() {
    conformance::run_all(&InProcess);
}

// ---- cross-process ----

/// Engine side served by the child process over the socket.
struct RemoteEngine {
    stream: Mutex<UnixStream>,
    child: Mutex<Child>,
    _dir: tempfile::TempDir,
}

fn put_u64(v: &mut Vec<u8>, x: u64) {
    v.extend_from_slice(&x.to_le_bytes());
}

impl RemoteEngine {
    fn call(
        &self,
        op: u8,
        region: u32,
        offset: u64,
        len: u64,
        data: &[u8],
        out: &mut [u8],
    ) -> Result<(), FixtureError> {
        let mut s = self.stream.lock().map_err(|_| "poisoned")?;
        let mut req = vec![op];
        req.extend_from_slice(&region.to_le_bytes());
        put_u64(&mut req, offset);
        put_u64(&mut req, len);
        req.extend_from_slice(data);
        s.write_all(&req)?;
        let mut status = [0u8; 1];
        s.read_exact(&mut status)?;
        if status[0] != 0 {
            return Err(
                format!("engine process refused op {op} region {region} offset {offset} len {len}").into()
            );
        }
        s.read_exact(out)?;
        Ok(())
    }
}

impl EngineSide for RemoteEngine {
    fn read(&self, region: u32, offset: u64, out: &mut [u8]) -> Result<(), FixtureError> {
        self.call(1, region, offset, out.len() as u64, &[], out)
    }
    fn write(&self, region: u32, offset: u64, data: &[u8]) -> Result<(), FixtureError> {
        self.call(2, region, offset, data.len() as u64, data, &mut [])
    }
}

impl Drop for RemoteEngine {
    fn drop(&mut self) {
        if let Ok(s) = self.stream.get_mut() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        if let Ok(c) = self.child.get_mut() {
            let _ = c.wait();
        }
    }
}

struct CrossProcess;

impl Fixture for CrossProcess {
    fn create(&self, region_lens: &[u64]) -> Result<Created, FixtureError> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("engine.sock");
        let listener = UnixListener::bind(&path)?;
        listener.set_nonblocking(true)?;
        let mut child = Command::new(std::env::current_exe()?)
            .args(["--exact", "engine_process", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, &path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()?;
        let deadline = Instant::now() + Duration::from_secs(60);
        let stream = loop {
            match listener.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if let Some(st) = child.try_wait()? {
                        return Err(format!("engine process exited early: {st}").into());
                    }
                    if Instant::now() > deadline {
                        let _ = child.kill();
                        return Err("engine process never connected".into());
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(e.into()),
            }
        };
        stream.set_nonblocking(false)?;
        let mut req = Vec::new();
        req.extend_from_slice(&(region_lens.len() as u32).to_le_bytes());
        for &l in region_lens {
            put_u64(&mut req, l);
        }
        (&stream).write_all(&req)?;
        let (offer, backend) = accept_pool(&stream)?;
        if offer.table.lens() != region_lens {
            return Err(format!("engine offered {:?}", offer.table.lens()).into());
        }
        assert_ne!(child.id(), std::process::id());
        let engine = RemoteEngine { stream: Mutex::new(stream), child: Mutex::new(child), _dir: dir };
        Ok((Box::new(backend), Box::new(engine)))
    }
}

/// The child's entry point: a no-op unless started by `CrossProcess` with `CHILD_ENV` set.
#[test]
fn engine_process() {
    let Ok(path) = std::env::var(CHILD_ENV) else { return };
    let mut s = UnixStream::connect(path).expect("child: connect");
    let mut n = [0u8; 4];
    s.read_exact(&mut n).unwrap();
    let lens: Vec<u64> = (0..u32::from_le_bytes(n))
        .map(|_| {
            let mut b = [0u8; 8];
            s.read_exact(&mut b).unwrap();
            u64::from_le_bytes(b)
        })
        .collect();
    let table = RegionTable::packed(&lens).unwrap();
    let fd = create_memfd("kvferry-engine", table.file_len()).unwrap();
    send_offer(
        &s,
        &Offer { model_id: "test".into(), layout: None, table: table.clone() },
        std::os::fd::AsFd::as_fd(&fd),
    )
    .unwrap();
    let engine = LocalEngine { map: Mapping::map(fd, table.file_len()).unwrap(), table };
    loop {
        let mut head = [0u8; 21];
        if s.read_exact(&mut head).is_err() {
            return; // parent done
        }
        let region = u32::from_le_bytes(head[1..5].try_into().unwrap());
        let offset = u64::from_le_bytes(head[5..13].try_into().unwrap());
        let len = u64::from_le_bytes(head[13..21].try_into().unwrap()) as usize;
        let mut buf = vec![0u8; len];
        let res = match head[0] {
            1 => engine.read(region, offset, &mut buf),
            2 => {
                s.read_exact(&mut buf).unwrap();
                let res = engine.write(region, offset, &buf);
                buf.clear(); // a write replies with the status only
                res
            }
            _ => Err("bad op".into()),
        };
        let mut reply = vec![u8::from(res.is_err())];
        if res.is_ok() {
            reply.extend_from_slice(&buf);
        }
        s.write_all(&reply).unwrap();
    }
}

#[test]
fn conformance_cross_process() {
    conformance::run_all(&CrossProcess);
}

//! Thin, safe wrappers over the few Linux calls the emulator needs: TUN devices, `setns`,
//! `ppoll`, timer slack and raw reads and writes.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::time::Duration;

use crate::error::{Result, WanemError};

/// Whether the effective user is root.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Moves the **calling thread** into the network namespace bound at `path`
/// (for example `/var/run/netns/<name>`). Other threads are unaffected.
pub fn enter_netns(path: &Path) -> Result<()> {
    let file = File::open(path).map_err(|source| WanemError::Sys { what: "open netns", source })?;
    // SAFETY: the fd is valid for the duration of the call (owned by `file`); setns only
    // changes the calling thread's namespace.
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    if rc != 0 {
        return Err(WanemError::last_os("setns(CLONE_NEWNET)"));
    }
    Ok(())
}

/// Bytes of the `virtio_net_hdr` that precedes every packet read from or written to the TUN
/// (`IFF_VNET_HDR`, the kernel's default header size).
pub const VNET_HDR_LEN: usize = 10;

/// The largest packet a TUN with segmentation offload hands over: 64 KiB of IP packet (the
/// kernel's legacy GSO limit) behind its virtio header.
pub const MAX_GSO_READ: usize = VNET_HDR_LEN + 65_536;

/// Opens a TUN device named `name` (IP packets, no packet-info header) in the calling thread's
/// network namespace. The fd is non-blocking and close-on-exec; the device disappears when
/// the fd is closed.
///
/// The device offloads checksums as a real NIC does (`IFF_VNET_HDR` + `TUN_F_CSUM`): every
/// packet read carries a [`VNET_HDR_LEN`]-byte header, and a UDP or TCP packet the stack left
/// for the device to checksum says so there (`VIRTIO_NET_HDR_F_NEEDS_CSUM`). The forwarder
/// passes that header through unchanged, so the receiving stack takes the packet as checked
/// instead of summing every payload byte in software — which is what a NIC's transmit and
/// receive checksum offload saves on a real path.
///
/// It also takes segmentation off the sending stack as a NIC does (`TUN_F_TSO4` for TCP,
/// `TUN_F_USO4`/`6` for UDP GSO sends such as QUIC's): a send of up to 64 KiB arrives as one
/// packet whose virtio header gives the segment size, and the forwarder cuts it into the
/// MTU-sized packets the wire carries ([`crate::gso`]) before shaping, for QUIC and TCP alike.
/// `segmentation_offload = false`: checksum offload only, the sending kernel segments. Writes
/// may carry GSO packets either way (the forwarder's receive coalescing): the kernel takes
/// them from any TUN with a virtio header.
pub fn open_tun(name: &str, segmentation_offload: bool) -> Result<OwnedFd> {
    let cname = CString::new(name).map_err(|_| WanemError::Profile("NUL in device name".into()))?;
    if cname.as_bytes().len() >= libc::IFNAMSIZ {
        return Err(WanemError::Profile(format!("device name {name:?} too long")));
    }
    // SAFETY: the path is a valid NUL-terminated string; open has no other preconditions.
    let raw =
        unsafe { libc::open(c"/dev/net/tun".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC | libc::O_NONBLOCK) };
    if raw < 0 {
        return Err(WanemError::last_os("open /dev/net/tun"));
    }
    // SAFETY: `raw` is a freshly opened fd that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: ifreq is plain old data; all-zeroes is a valid value.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in ifr.ifr_name.iter_mut().zip(cname.as_bytes()) {
        *dst = *src as libc::c_char;
    }
    ifr.ifr_ifru.ifru_flags = (libc::IFF_TUN | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short;
    // SAFETY: TUNSETIFF takes a pointer to an ifreq, which lives across the call.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETIFF, &mut ifr) };
    if rc < 0 {
        return Err(WanemError::last_os("ioctl(TUNSETIFF)"));
    }
    // USO is only accepted for both IP versions at once.
    let segmentation = libc::TUN_F_TSO4 | libc::TUN_F_USO4 | libc::TUN_F_USO6;
    let offloads = libc::TUN_F_CSUM | if segmentation_offload { segmentation } else { 0 };
    // SAFETY: TUNSETOFFLOAD takes its flags by value (an unsigned long); the fd is the TUN
    // device configured above.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETOFFLOAD, offloads as libc::c_ulong) };
    if rc < 0 {
        return Err(WanemError::last_os("ioctl(TUNSETOFFLOAD)"));
    }
    Ok(fd)
}

/// Outcome of a non-blocking read.
#[derive(Debug, PartialEq, Eq)]
pub enum ReadOutcome {
    /// A packet of this many bytes.
    Packet(usize),
    /// Nothing to read now.
    WouldBlock,
}

/// Reads one packet from a non-blocking fd.
pub fn read_packet(fd: BorrowedFd<'_>, buf: &mut [u8]) -> std::io::Result<ReadOutcome> {
    loop {
        // SAFETY: `buf` is valid for writes of `buf.len()` bytes; the fd is open.
        let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n >= 0 {
            return Ok(ReadOutcome::Packet(n as usize));
        }
        let err = std::io::Error::last_os_error();
        match err.kind() {
            std::io::ErrorKind::Interrupted => continue,
            std::io::ErrorKind::WouldBlock => return Ok(ReadOutcome::WouldBlock),
            _ => return Err(err),
        }
    }
}

/// Writes one packet; TUN writes inject the packet into the namespace's stack at once.
pub fn write_packet(fd: BorrowedFd<'_>, pkt: &[u8]) -> std::io::Result<()> {
    loop {
        // SAFETY: `pkt` is valid for reads of `pkt.len()` bytes; the fd is open.
        let n = unsafe { libc::write(fd.as_raw_fd(), pkt.as_ptr().cast(), pkt.len()) };
        if n >= 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        if err.kind() != std::io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// Waits until `fd` is readable or `timeout` passes (nanosecond resolution). Returns whether
/// it became readable. EINTR counts as a timeout.
pub fn wait_readable(fd: BorrowedFd<'_>, timeout: Duration) -> bool {
    let mut pfd = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
    };
    // SAFETY: one valid pollfd, a valid timespec and no signal mask (null).
    let rc = unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) };
    rc > 0 && (pfd.revents & libc::POLLIN) != 0
}

/// Asks for precise timer wake-ups on the calling thread (timer slack 1 ns instead of 50 µs).
pub fn precise_timers() {
    // SAFETY: PR_SET_TIMERSLACK takes an unsigned long and affects only the calling thread.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong);
    }
}

/// Sets a socket's receive buffer to `bytes` past `net.core.rmem_max` (SO_RCVBUFFORCE, root),
/// falling back to SO_RCVBUF. Best effort: errors are ignored.
pub fn force_rcvbuf(sock: &impl AsRawFd, bytes: usize) {
    let val = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    for opt in [libc::SO_RCVBUFFORCE, libc::SO_RCVBUF] {
        // SAFETY: a valid socket fd and a pointer to a c_int that outlives the call.
        let rc = unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                (&val as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc == 0 {
            return;
        }
    }
}

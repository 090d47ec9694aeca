//! Enqueueing copies on a stream and waiting for them without blocking the async runtime.
//!
//! Memory-safety rule of this module: device work that touches a staging buffer must be
//! finished before the borrow of that buffer ends. [`StreamFence`] synchronizes the stream when
//! enqueueing fails half way; [`Pending`] synchronizes its event when the waiting future is
//! dropped (cancelled) or the deadline passes, before it lets go.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaStream, sys};

use crate::CudaError;
use crate::driver::{check, describe};
use crate::kernel::{Kernel, ListBuf};
use crate::plan::{Direction, PlannedCopy};

/// Enqueues one `cuMemcpy{DtoH,HtoD}Async` per planned copy.
///
/// # Safety
/// `host_base` must point to registered (pinned) host memory covering every copy's staging
/// range, and `region_bases[c.region] + c.region_offset .. + c.len` must be device memory valid
/// for the direction; both must stay valid until the stream has passed these copies.
pub(crate) unsafe fn enqueue_memcpy(
    stream: &CudaStream,
    copies: &[PlannedCopy],
    region_bases: &[u64],
    host_base: *mut u8,
    dir: Direction,
) -> Result<(), CudaError> {
    let s = stream.cu_stream();
    for c in copies {
        let dev = region_bases[c.region as usize] + c.region_offset;
        let len = usize::try_from(c.len).expect("validated against a staging buffer length");
        let off = usize::try_from(c.staging_offset).expect("validated against a staging buffer length");
        // SAFETY: `off + len` lies inside the staging buffer (caller's contract, from
        // `check_batch`), so the pointer arithmetic stays inside one allocation.
        let host = unsafe { host_base.add(off) };
        let r = match dir {
            // SAFETY: ranges valid per the caller's contract; the stream belongs to the current
            // context (callers bind it first).
            Direction::Gather => unsafe { sys::cuMemcpyDtoHAsync_v2(host.cast(), dev, len, s) },
            // SAFETY: as above, with the host range as the source.
            Direction::Scatter => unsafe { sys::cuMemcpyHtoDAsync_v2(dev, host.cast(), len, s) },
        };
        check(if dir == Direction::Gather { "cuMemcpyDtoHAsync" } else { "cuMemcpyHtoDAsync" }, r)?;
    }
    Ok(())
}

/// Synchronizes a stream on drop unless disarmed: covers the window between the first enqueued
/// copy and the event that [`Pending`] waits on.
pub(crate) struct StreamFence<'s> {
    stream: &'s CudaStream,
    armed: bool,
}

impl<'s> StreamFence<'s> {
    pub(crate) fn new(stream: &'s CudaStream) -> Self {
        Self { stream, armed: true }
    }

    pub(crate) fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for StreamFence<'_> {
    fn drop(&mut self) {
        if self.armed {
            // Errors cannot be reported from here; a failed sync means a broken context, in
            // which the device no longer runs our copies either.
            let _ = self.stream.synchronize();
        }
    }
}

/// Completion of a batch: an event recorded after its copies, plus the copy list the kernel
/// reads (returned to the kernel's pool once complete).
pub(crate) struct Pending<'k> {
    ctx: Arc<CudaContext>,
    event: sys::CUevent,
    done: bool,
    list: Option<(ListBuf, &'k Kernel)>,
}

// SAFETY: a CUevent handle may be used from any thread (driver API objects are thread safe);
// the other fields are `Send`, and `&Kernel` is shared immutably (`Kernel: Sync`).
unsafe impl Send for Pending<'_> {}

impl<'k> Pending<'k> {
    /// Records a completion event on `stream` after everything enqueued so far.
    pub(crate) fn record(
        stream: &CudaStream,
        list: Option<(ListBuf, &'k Kernel)>,
    ) -> Result<Self, CudaError> {
        let ctx = stream.context().clone();
        let mut event: sys::CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: valid out-pointer; the stream's context is current (callers bind it).
        check("cuEventCreate", unsafe { sys::cuEventCreate(&mut event, flags) })?;
        let mut p = Self { ctx, event, done: false, list };
        // SAFETY: `event` and the stream belong to the same, current context.
        check("cuEventRecord", unsafe { sys::cuEventRecord(p.event, stream.cu_stream()) }).inspect_err(
            |_| {
                // Not recorded: nothing to wait for on the event, but copies may be queued.
                let _ = stream.synchronize();
                p.done = true;
            },
        )?;
        Ok(p)
    }

    /// Waits for the event: polls `cuEventQuery`, yielding to the runtime in between (a few
    /// immediate yields, then timer sleeps when a tokio timer is available). After `deadline`
    /// it blocks until the device is done (staging must not be released under a running copy)
    /// and reports [`CudaError::Deadline`].
    pub(crate) async fn wait(mut self, deadline: Duration, bytes: u64) -> Result<(), CudaError> {
        let start = Instant::now();
        // ~25 GB/s: sleep through most of a long copy instead of polling it.
        let expected = Duration::from_nanos(bytes / 25);
        let mut polls = 0u32;
        loop {
            let _ = self.ctx.bind_to_thread();
            // SAFETY: `event` is a live event of this context.
            match unsafe { sys::cuEventQuery(self.event) } {
                sys::CUresult::CUDA_SUCCESS => {
                    self.done = true;
                    return Ok(());
                }
                sys::CUresult::CUDA_ERROR_NOT_READY => {}
                err => {
                    // The context is broken (sticky error): its work is abandoned.
                    self.done = true;
                    return Err(CudaError::Driver {
                        op: "cuEventQuery",
                        detail: describe(cudarc::driver::result::DriverError(err)),
                    });
                }
            }
            let elapsed = start.elapsed();
            if elapsed >= deadline {
                self.block();
                return Err(CudaError::Deadline(deadline));
            }
            polls += 1;
            pause(polls, elapsed, expected, deadline - elapsed).await;
        }
    }

    /// Blocks the calling thread until the batch completed; reports a broken context.
    pub(crate) fn finish(mut self) -> Result<(), CudaError> {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `event` is a live event of this context.
        let r = unsafe { sys::cuEventSynchronize(self.event) };
        self.done = true;
        check("cuEventSynchronize", r)
    }

    /// Blocks the calling thread until the event completed (or the context broke).
    fn block(&mut self) {
        if !self.done {
            let _ = self.ctx.bind_to_thread();
            // SAFETY: `event` is a live event of this context.
            let _ = unsafe { sys::cuEventSynchronize(self.event) };
            self.done = true;
        }
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        // A cancelled wait: the copies may still be writing into (or reading from) staging
        // whose borrow ends with this drop.
        self.block();
        if let Some((list, kernel)) = self.list.take() {
            kernel.recycle(list);
        }
        // SAFETY: the event is complete and destroyed exactly once.
        unsafe { sys::cuEventDestroy_v2(self.event) };
    }
}

/// One pause between polls: immediate yields first (short copies finish within microseconds),
/// then sleeps of about the remaining expected time, 1 ms at least (tokio's timer resolution),
/// never past the deadline. Outside a tokio runtime it only yields.
async fn pause(polls: u32, elapsed: Duration, expected: Duration, left: Duration) {
    const YIELDS: u32 = 64;
    if polls <= YIELDS || tokio::runtime::Handle::try_current().is_err() {
        tokio::task::yield_now().await;
        return;
    }
    let nap = expected.saturating_sub(elapsed).max(Duration::from_millis(1)).min(left);
    tokio::time::sleep(nap).await;
}

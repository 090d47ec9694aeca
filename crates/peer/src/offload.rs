//! The per-chunk work that touches every byte, off the runtime's workers.
//!
//! A 4 MiB chunk costs a side about a millisecond of copying and hashing: the owner gathers it
//! out of the pool (a memcpy) and checksums it, the requester checksums it and scatters it
//! into its landing buffers (a memcpy). Run inline, that millisecond holds the worker that
//! also reads the socket, paces packets and sends ACKs; a daemon then needs a second worker at
//! 1 Gbit/s, and two workers on a busy link spend much of their CPU waking each other (the
//! measurements are in `bench/results/offload-2026-12-05/`). Here the work runs on the
//! runtime's blocking pool instead: one hop out and back per chunk, ~30 a second at 1 Gbit/s,
//! while the workers keep to the network.
//!
//! Chunks below [`OFFLOAD_MIN_BYTES`] stay inline (a hop costs more than their work). The
//! futures driven here (a pool read, a sink's landing) run on a blocking thread inside the
//! runtime's context; they are cancel-safe as before: a dropped caller leaves the blocking
//! task to finish and its result, buffers included, is dropped whole.

use std::sync::Arc;

use kvferry_wire::{ChunkSpec, LocalError, Summed, WireError};

use crate::io::{ChunkBytes, ChunkError, ChunkSink, ChunkSource};

/// Chunks at least this long are read, hashed and landed on the blocking pool.
pub const OFFLOAD_MIN_BYTES: u64 = 1 << 20;

fn joined(e: tokio::task::JoinError) -> WireError {
    LocalError::Setup(format!("a chunk's blocking task failed: {e}")).into()
}

/// The owner's half: reads chunk `spec` from `source` and hashes it as chunk `spec.id` of
/// `transfer_id`.
pub async fn read_and_sum(
    source: &Arc<dyn ChunkSource>,
    spec: ChunkSpec,
    transfer_id: u128,
) -> Result<(ChunkBytes, Summed), WireError> {
    let work = move |bytes: ChunkBytes| {
        let summed = Summed::of(transfer_id, spec.id, (*bytes).as_ref());
        (bytes, summed)
    };
    if spec.len < OFFLOAD_MIN_BYTES {
        return Ok(work(source.read(spec).await?));
    }
    let (source, rt) = (source.clone(), tokio::runtime::Handle::current());
    tokio::task::spawn_blocking(move || rt.block_on(source.read(spec)).map(work))
        .await
        .map_err(joined)?
        .map_err(WireError::from)
}

/// The requester's first half: hashes `payload` as the header's chunk and gives it back.
pub async fn sum<P>(transfer_id: u128, chunk_id: u32, payload: P) -> Result<(P, Summed), WireError>
where
    P: AsRef<[u8]> + Send + 'static,
{
    if (payload.as_ref().len() as u64) < OFFLOAD_MIN_BYTES {
        let summed = Summed::of(transfer_id, chunk_id, payload.as_ref());
        return Ok((payload, summed));
    }
    tokio::task::spawn_blocking(move || {
        let summed = Summed::of(transfer_id, chunk_id, payload.as_ref());
        (payload, summed)
    })
    .await
    .map_err(joined)
}

/// The requester's second half: lands a verified chunk through `sink` and gives the payload
/// back (its buffer is recycled when the caller drops it).
pub async fn land<P>(sink: &Arc<dyn ChunkSink>, spec: ChunkSpec, payload: P) -> Result<P, ChunkError>
where
    P: AsRef<[u8]> + Send + 'static,
{
    if spec.len < OFFLOAD_MIN_BYTES {
        sink.land(spec, payload.as_ref()).await?;
        return Ok(payload);
    }
    let (sink, rt) = (sink.clone(), tokio::runtime::Handle::current());
    tokio::task::spawn_blocking(move || rt.block_on(sink.land(spec, payload.as_ref())).map(|()| payload))
        .await
        .map_err(|e| ChunkError::Task { chunk: spec.id, detail: format!("landing: {e}") })?
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::BoxFut;
    use std::sync::Mutex;

    struct Pattern;
    impl ChunkSource for Pattern {
        fn read(&self, spec: ChunkSpec) -> BoxFut<'_, Result<ChunkBytes, ChunkError>> {
            Box::pin(async move {
                // Something of the runtime's, as a real backend's read may use it.
                tokio::task::yield_now().await;
                let v: Vec<u8> = (0..spec.len).map(|i| (i % 251) as u8 ^ spec.id as u8).collect();
                Ok(Box::new(v) as ChunkBytes)
            })
        }
    }

    #[derive(Default)]
    struct Keep(Mutex<Vec<(u32, Vec<u8>)>>);
    impl ChunkSink for Keep {
        fn land<'a>(&'a self, spec: ChunkSpec, payload: &'a [u8]) -> BoxFut<'a, Result<(), ChunkError>> {
            Box::pin(async move {
                if payload.first() == Some(&0xff) {
                    return Err(ChunkError::Mismatch { chunk: spec.id, detail: "refused".into() });
                }
                self.0.lock().unwrap().push((spec.id, payload.to_vec()));
                Ok(())
            })
        }
    }

    fn spec(id: u32, len: u64) -> ChunkSpec {
        ChunkSpec { id, blocks: (0, 1), layers: (0, 1), len }
    }

    async fn round_trip() {
        let source: Arc<dyn ChunkSource> = Arc::new(Pattern);
        let keep = Arc::new(Keep::default());
        let sink: Arc<dyn ChunkSink> = keep.clone();
        // Below and above the offload threshold: the same sums, the same landed bytes.
        for (id, len) in [(3, 4096), (4, OFFLOAD_MIN_BYTES), (5, 3 * OFFLOAD_MIN_BYTES + 17)] {
            let (bytes, summed) = read_and_sum(&source, spec(id, len), 9).await.unwrap();
            let v = (*bytes).as_ref().to_vec();
            assert_eq!(v.len() as u64, len);
            assert_eq!(summed, Summed::of(9, id, &v));
            let (v, again) = sum(9, id, v).await.unwrap();
            assert_eq!(again, summed);
            let back = land(&sink, spec(id, len), v).await.unwrap();
            assert_eq!(back.len() as u64, len, "the payload comes back for recycling");
        }
        let ids: Vec<u32> = keep.0.lock().unwrap().iter().map(|(id, _)| *id).collect();
        assert_eq!(ids, vec![3, 4, 5]);
        // A sink's refusal comes back typed, from either path.
        for len in [4096, OFFLOAD_MIN_BYTES] {
            let e = land(&sink, spec(6, len), vec![0xffu8; len as usize]).await.unwrap_err();
            assert!(matches!(e, ChunkError::Mismatch { chunk: 6, .. }), "{e:?}");
        }
    }

    #[tokio::test]
    async fn offloaded_chunks_sum_and_land_as_inline_ones_on_a_current_thread_runtime() {
        round_trip().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn offloaded_chunks_sum_and_land_as_inline_ones_on_one_worker() {
        round_trip().await;
    }
}

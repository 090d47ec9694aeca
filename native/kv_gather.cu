// kv_gather.cu: gather/scatter of KV-cache extents between an engine's paged device pool
// and pinned, device-mapped host staging. Compiled at run time by NVRTC
// (crate kvferry-pool-cuda, feature `cuda`); no CUDA headers are included, so NVRTC needs
// no include paths.
//
// The copy list is a device array of `n_copies` triples (src, dst, len) of 64-bit values:
// src and dst are byte offsets in the unified virtual address space, that is, offsets
// from address 0 (the device pointers of the pool's regions, the device pointers of the
// mapped staging buffer returned by cuMemHostGetDevicePointer), and len is a byte count.
// Gather and scatter are the same kernel with the roles of src and dst swapped.
//
// Launch: grid (ctas_per_copy, min(n_copies, 65535)), any block size that is a multiple
// of 32. CTA (x, y) copies slice x of copies y, y + gridDim.y, ... Slices are multiples of
// 16 bytes so that the wide path keeps its alignment. Copies must not overlap (the host
// side guarantees it: staging and the pool are distinct allocations, and the extents of a
// batch are validated before launch).

typedef unsigned long long u64;
typedef unsigned int u32;

// 16-byte value for the wide path (no CUDA headers: NVRTC compiles this file alone).
struct alignas(16) Wide {
    u64 lo;
    u64 hi;
};

// Copy `n` elements of T with four independent loads in flight per thread (the host side
// of a scatter is read across PCIe: latency, not bandwidth, bounds a single load).
template <typename T>
__device__ __forceinline__ void copy_elems(const T* __restrict__ src, T* __restrict__ dst, u64 n)
{
    const u64 stride = blockDim.x;
    u64 i = threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        const T a = src[i];
        const T b = src[i + stride];
        const T c = src[i + 2 * stride];
        const T d = src[i + 3 * stride];
        dst[i] = a;
        dst[i + stride] = b;
        dst[i + 2 * stride] = c;
        dst[i + 3 * stride] = d;
    }
    for (; i < n; i += stride) {
        dst[i] = src[i];
    }
}

// Copy `len` bytes with the widest access that both pointers' alignment allows, then the
// tail bytes.
__device__ __forceinline__ void copy_range(const unsigned char* src, unsigned char* dst, u64 len)
{
    const u64 misalign = ((u64)src | (u64)dst);
    u64 done = 0;
    if ((misalign & 15) == 0) {
        const u64 n = len / 16;
        copy_elems<Wide>((const Wide*)src, (Wide*)dst, n);
        done = n * 16;
    } else if ((misalign & 7) == 0) {
        const u64 n = len / 8;
        copy_elems<u64>((const u64*)src, (u64*)dst, n);
        done = n * 8;
    } else if ((misalign & 3) == 0) {
        const u64 n = len / 4;
        copy_elems<u32>((const u32*)src, (u32*)dst, n);
        done = n * 4;
    }
    for (u64 i = done + threadIdx.x; i < len; i += blockDim.x) {
        dst[i] = src[i];
    }
}

extern "C" __global__ void kv_copy_extents(const u64* __restrict__ triples, u32 n_copies)
{
    for (u64 copy = blockIdx.y; copy < n_copies; copy += gridDim.y) {
        const u64 src = triples[3 * copy];
        const u64 dst = triples[3 * copy + 1];
        const u64 len = triples[3 * copy + 2];
        // Slice of this CTA, rounded up to 16 bytes so that every slice starts with the
        // alignment of the copy itself.
        const u64 per_cta = (((len + gridDim.x - 1) / gridDim.x) + 15) & ~(u64)15;
        const u64 begin = per_cta * blockIdx.x;
        if (begin >= len) {
            continue;
        }
        const u64 end = (begin + per_cta < len) ? begin + per_cta : len;
        copy_range((const unsigned char*)src + begin, (unsigned char*)dst + begin, end - begin);
    }
}

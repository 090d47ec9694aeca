"""Folds `perf script -F tid,ip,sym` of one daemon into cost categories.

Usage: perf script -i source.data -F tid,ip,sym | python3 cat.py SECONDS GIB
Each sample is charged by its leaf symbol; a user-space memmove is charged to the copy its
first project or quinn caller names. SECONDS and GIB (the bytes moved while perf ran) turn
shares into CPU s/GiB (samples at 499 Hz: CPU seconds = samples / 499)."""
import re
import sys
from collections import Counter

HZ = 499.0
LEAF = [
    ("crypto (AES-GCM seal/open, header protection)", r"aes|gcm|aead|HeaderProtection|protect_header|CRYPTO_memcmp|skip_iv"),
    ("checksum (XXH3-128)", r"xxh"),
    ("kernel copies (user<->kernel)", r"copy_from_iter|copy_to_iter|copy_user|copy_from_user|copy_to_user|__check_object_size"),
    ("page faults and page clearing", r"clear_page|page_fault|handle_mm_fault|do_anonymous|folio|lru|alloc_pages|__alloc|get_page_from"),
    ("wake-ups (TUN/socket readers, futex)", r"raw_spin_unlock|try_to_wake|futex|wake_up|sock_def_readable"),
    ("context switches and epoll", r"finish_task_switch|__schedule|schedule|epoll|pick_next|switch_to|native_write_msr|hrtimer"),
    ("kernel UDP/IP and TUN path", r"udp|ip_|skb|sock|tun_|net_|dev_|__netif|inet|csum|nf_|qdisc|neigh|fib|dst_"),
    ("syscall entry/exit", r"do_syscall|entry_SYSCALL|syscall|irqentry|x64_sys|fdget|fput|ksys|__libc_|exit_to_user"),
    ("allocator (malloc/free)", r"malloc|_int_free|cfree|realloc|unlink_chunk|sysmalloc|memset"),
    ("quinn (packets, frames, ACKs, streams, CC)", r"quinn|btree|BTree|binary_heap|BinaryHeap|Chain<A,B>|VarInt|bytes::"),
    ("tokio runtime", r"tokio"),
]
COPY = [
    ("copy: pool gather into staging (source)", r"ShmBackend.*read"),
    ("copy: landing scatter into block buffers (target)", r"BlockShape::scatter|LandingSink"),
    ("copy: quinn stream data into packets (source)", r"write_stream_frames|Send::write"),
    ("copy: quinn stream read into chunk buffer (target)", r"poll_read_buf|read_chunk|read_exact|Assembler"),
    ("copy: quinn datagram into BytesMut (target)", r"BytesMut as core::convert::From|poll_socket"),
]


def main() -> None:
    seconds, gib = float(sys.argv[1]), float(sys.argv[2])
    samples, cur = [], None
    for line in sys.stdin:
        if not line.strip():
            if cur:
                samples.append(cur)
            cur = None
            continue
        if not line.startswith((" ", "\t")):
            cur = []
            continue
        parts = line.strip().split(None, 1)
        if cur is not None and len(parts) > 1:
            cur.append(parts[1])
    if cur:
        samples.append(cur)
    tally: Counter[str] = Counter()
    for frames in samples:
        leaf = frames[0] if frames else "?"
        if "memmove" in leaf or "memcpy" in leaf and "kernel" not in leaf:
            name = "copy: other"
            for f in frames[1:]:
                hit = next((n for n, p in COPY if re.search(p, f)), None)
                if hit:
                    name = hit
                    break
            tally[name] += 1
            continue
        tally[next((n for n, p in LEAF if re.search(p, leaf, re.I)), "other")] += 1
    n = sum(tally.values())
    cpu = n / HZ
    print(f"{n} samples = {cpu:.2f} CPU s over {seconds:.1f} s ({cpu / seconds:.2f} cores), {gib:.2f} GiB moved: {cpu / gib:.2f} CPU s/GiB")
    print("| category | share | CPU s/GiB |")
    print("|---|---:|---:|")
    for k, v in tally.most_common():
        print(f"| {k} | {100 * v / n:.1f} % | {v / HZ / gib:.3f} |")


if __name__ == "__main__":
    main()

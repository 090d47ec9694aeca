import re,sys,subprocess
cats=[("crypto (AES-GCM, header protection)",r"aes|gcm|aead|ghash|protect_header|unprotect|chacha"),
("checksum (XXH3)",r"xxh|xxhash"),
("copies (memmove, user<->kernel)",r"memmove|memcpy|copy_to_iter|copy_from_iter|copy_user"),
("page faults and page clearing",r"clear_page|page_fault|do_anonymous|handle_mm_fault|alloc_.*pages|memcg|mas_walk|folio|lru|pte|zap|__alloc"),
("context switches",r"finish_task_switch|__schedule|schedule|switch_to|pick_next|dequeue|enqueue"),
("locks and wake-ups",r"raw_spin|futex|try_to_wake|wake_up"),
("quinn (packets, frames, ACKs, CC)",r"quinn"),
("kernel UDP/IP path",r"udp|ip_|skb|sock|tun_|net_|dev_|nf_|__netif|inet|csum"),
("syscall entry/exit",r"do_syscall|entry_SYSCALL|syscall|irqentry|x64_sys|fdget|fput|ksys"),
("allocator",r"malloc|_int_free|cfree|realloc|memset"),
("tokio runtime",r"tokio"),
]
out=subprocess.run(["perf","report","-i",sys.argv[1],"--sort","sym","--stdio","--no-children","-g","none"],capture_output=True,text=True).stdout
tot={c[0]:0.0 for c in cats}; other=0.0
for line in out.splitlines():
    m=re.match(r"\s*([0-9.]+)%\s+\[(.)\]\s+(.*)",line)
    if not m: continue
    p=float(m.group(1)); sym=m.group(3)
    for name,pat in cats:
        if re.search(pat,sym,re.I): tot[name]+=p; break
    else: other+=p
for k,v in sorted(tot.items(),key=lambda x:-x[1]): print(f"{v:6.1f} %  {k}")
print(f"{other:6.1f} %  other")

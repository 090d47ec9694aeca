import sys,collections
# perf script -F tid,ip,sym output: per sample a header line "tid" then stack lines, leaf first.
c=collections.Counter(); t=collections.Counter(); tid=None; first=False
for line in sys.stdin:
    s=line.rstrip('\n')
    if not s.strip(): tid=None; continue
    if not s[0].isspace():
        tid=s.split()[0]; first=True; t[tid]+=1; continue
    if first and tid:
        parts=s.split(None,1); c[(tid,parts[1] if len(parts)>1 else '?')]+=1; first=False
# the receiver: the busiest thread named like the pair's side threads is not known; take the
# thread with the most samples outside the emulator (its two busiest threads are 'wanem').
tid=sys.argv[1]
n=t[tid]
print(f"thread {tid}: {n} samples at 1999 Hz over 2.0 s")
for (k,sym),m in c.most_common():
    if k==tid and m*100/n>=1.5: print(f"  {m*100/n:5.1f} %  {sym[:90]}")

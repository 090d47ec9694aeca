import time, mmap, sys
n = 256 << 20
m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE|mmap.MAP_ANONYMOUS)
if sys.argv[1] == "huge":
    m.madvise(mmap.MADV_HUGEPAGE)
def touch():
    t = time.perf_counter()
    for i in range(0, n, 4096):
        m[i] = (m[i] + 1) & 255
    return round(time.perf_counter() - t, 3)
print(sys.argv[1], "first", touch(), "again", touch(), flush=True)
time.sleep(10); print(sys.argv[1], "after 10s", touch(), flush=True)

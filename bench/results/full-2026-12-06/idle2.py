import time, resource
n = 256 << 20
b = bytearray(n)
def touch():
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t = time.perf_counter()
    for i in range(0, n, 4096):
        b[i] = (b[i] + 1) & 255
    dt = time.perf_counter() - t
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return round(dt,3), r1.ru_minflt - r0.ru_minflt, r1.ru_majflt - r0.ru_majflt
print("first", touch()); print("again", touch())
time.sleep(10); print("after 10s", touch(), flush=True)

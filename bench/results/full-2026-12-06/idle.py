import time, sys
n = 256 << 20
b = bytearray(n)
def touch():
    t = time.perf_counter()
    s = 0
    for i in range(0, n, 4096):
        b[i] = (b[i] + 1) & 255
    return time.perf_counter() - t
print("first", touch())
print("again", touch())
for idle in (10, 60, 120):
    time.sleep(idle)
    print(f"after {idle}s idle", touch(), flush=True)

import re, sys
TEN = "10\\+"
print("| run | profiles | accuracy % | mean regret % | worst regret % | fetch median error, 10+ samples % (n) | recompute, 10+ (n) | recompute within 1 sd % |")
print("|---|---|---:|---:|---:|---:|---:|---:|")
for run in sys.argv[1:]:
    log = open(run + ".log").read()
    m = re.search(r"^decisions all: n (\d+) accuracy ([\d.]+)% mean regret ([\d.]+)% worst ([\d.]+)%", log, re.M)
    rep = open(run + "/report.md").read()
    def med(action):
        mm = re.search(rf"^\| {action} \| {TEN} \| (\d+) \| ([\d.]+) \|$", rep, re.M)
        return f"{mm.group(2)} ({mm.group(1)})" if mm else "-"
    sd = re.search(r"^\| recompute \| \d+ \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", rep, re.M)
    slow = "slow" if "100mbit" in log.split("decisions all")[0] else "defaults"
    print(f"| {run.split('/')[-1]} | {slow} | {m.group(2)} | {m.group(3)} | {m.group(4)} | {med('fetch')} | {med('recompute')} | {sd.group(1) if sd else '-'} |")

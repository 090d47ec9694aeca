import json,sys
for lab in sys.argv[1:]:
    try: r=json.load(open(f"{lab}/report.json"))
    except Exception as e: print(lab, e); continue
    for b in r["baselines"]:
        if b["name"] in ("kvferry-tcp","tcp-tls","kvferry-quic"):
            gib=b["bytes"]/2**30
            print(lab, b["link"]["profile"][:30].ljust(30), b["name"].ljust(13), f"{b['goodput_bps']/1e6:6.1f} Mbit/s  {100*b['goodput_bps']/b['link']['rate_bps']:5.1f} %  cpu s/GiB snd {b['cpu_s_sender']/gib:.2f} rcv {b['cpu_s_receiver']/gib:.2f}")

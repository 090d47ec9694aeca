import json,sys,statistics as st
for d in sys.argv[1:]:
  for run in ['run1','run2','run3']:
    try: r=json.load(open(f'{d}/{run}/report.json'))
    except Exception: continue
    rows=[]
    for s in r['splits']:
        p=s['link']['profile']
        sh=s.get('predicted_overlap_s',0)/s['predicted_split_s']
        e=s['measured_split_s']/s['predicted_split_s']-1
        rows.append((p.startswith('1gbit'),sh,e,p,s['prefix_tokens']))
    for g in [True,False]:
      for lo,hi in [(0,.25),(.25,.5),(.5,.75),(.75,1.01)]:
        b=[x for x in rows if x[0]==g and lo<=x[1]<hi]
        if b: print(d.split('/')[-1],run,'1gbit' if g else '100mbit',f'overlap {lo}-{hi}: n={len(b)} err mean {st.mean(x[2] for x in b)*100:+.1f}% max {max(x[2] for x in b)*100:+.1f} min {min(x[2] for x in b)*100:+.1f}')

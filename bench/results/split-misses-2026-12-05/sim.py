import json,statistics,sys
from collections import defaultdict, OrderedDict
rows=json.load(open('./rows2.json'))
OV=0.005; MING=0.05
seqs=OrderedDict()
for r in rows: seqs.setdefault((r['run'],r['profile']),[]).append(r)
def med(v): return statistics.median(v)
def q75(v):
    if len(v)<2: return v[0]
    return statistics.quantiles(v,n=4,method='inclusive')[2]
EST={
 'median (now)':lambda w: med(w),
 'mean':lambda w: statistics.mean(w),
 'p75':q75,
 'max':lambda w: max(w),
 'last':lambda w: w[-1],
}
def sim(name, plan_est, pred_est=None, bp_mode='pred', evening_only=False):
    pred_est=pred_est or plan_est
    tot=defaultdict(int); lost=[]; fixed=[]; newmiss=[]
    for (run,prof),rs in seqs.items():
        if evening_only and 'evening' not in run: continue
        w=[]
        for r in rs:
            ip=0.0 if not w else min(max(plan_est(w)-1,0),4)
            ir=0.0 if not w else min(max(pred_est(w)-1,0),4)
            scale=lambda i: (r['pred']-OV)*(1+i)/(1+r['used_i'])+OV
            pplan=scale(ip); ppred=scale(ir)
            bp=min(r['pf'],r['pr']) if bp_mode=='pred' else min(r['mf'],r['mr'])
            gain=1-pplan/bp
            best=r['meas']/min(r['mf'],r['mr'])
            oldmiss=abs(r['meas']/r['pred']-1)>0.15 or best>1
            tot['real_splits']+=1
            if gain<MING:
                tot['declined']+=1
                if best<=0.8: lost.append(r)
                if oldmiss: fixed.append(r)
                continue
            err=r['meas']/ppred-1
            tot['executed']+=1
            tot['within15']+=abs(err)<=0.15
            tot['slower']+=best>1
            tot['faster20']+=best<=0.8
            tot['miss15']+=abs(err)>0.15
            if oldmiss and abs(err)<=0.15 and best<=1: fixed.append(r)
            if not oldmiss and abs(err)>0.15: newmiss.append(r)
            w.append(min(max((1+r['used_i'])*r['meas']/r['pred'],1),5)); w=w[-16:]
    return tot,lost,fixed,newmiss
def fmt(rs): return ', '.join(f"{r['run'].split('/')[-2][-7:]}/{r['run'][-4:]} {r['profile'].replace('1gbit-50ms','1g50')} {r['n']}" for r in rs)
for evening in (False,True):
  print('== evening only' if evening else '== all 9 runs')
  for bp in ('pred','meas'):
    print(' best-pure proxy:',bp)
    for name,f in EST.items():
        t,lost,fixed,new=sim(name,f,bp_mode=bp,evening_only=evening)
        print(f"  plan+predict with {name:13}: exec {t['executed']:3} decl {t['declined']:2} | within15 {t['within15']:3} miss15 {t['miss15']:2} slower {t['slower']:2} >=20%faster {t['faster20']:3} | good splits lost {len(lost)} | old misses fixed {len(fixed)} | new misses {len(new)}")
    for name,f in EST.items():
        if name.startswith('median'): continue
        t,lost,fixed,new=sim(name,f,pred_est=EST['median (now)'],bp_mode=bp,evening_only=evening)
        print(f"  plan {name:5} / predict median : exec {t['executed']:3} decl {t['declined']:2} | within15 {t['within15']:3} miss15 {t['miss15']:2} slower {t['slower']:2} >=20%faster {t['faster20']:3} | good splits lost {len(lost)} | old misses fixed {len(fixed)} | new misses {len(new)}")

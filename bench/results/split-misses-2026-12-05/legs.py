import json, re, glob, statistics, math
BASE='..'
ANSI=re.compile(r'\x1b\[[0-9;]*m')
rows=json.load(open('./rows.json'))
KV=65536
cache={}
def prof_data(run,prof):
    key=(run,prof)
    if key in cache: return cache[key]
    rd=f'{BASE}/{run}/runs/{prof}'
    el=[ANSI.sub('',l) for l in open(f'{rd}/region-b-engine.log')]
    dl=[ANSI.sub('',l) for l in open(f'{rd}/region-b-daemon.log')]
    a=b=None; pr=[]; pf=[]
    for l in el:
        m=re.search(r'a_s_per_token=([\d.e-]+) b_s_per_pair=([\d.e-]+)',l)
        if m: a,b=float(m.group(1)),float(m.group(2))
        m=re.search(r'recompute done session="bench-(?:dq|warm)-recompute-\d+#\w+" ready=(\d+) seconds=([\d.e-]+)',l)
        if m: pr.append((int(m.group(1)),float(m.group(2))))
    for l in dl:
        m=re.search(r'session="bench-(?:dq|warm)-fetch-\d+".*wall_s=([\d.e-]+) action=fetch bytes=(\d+)',l)
        if m: pf.append((int(m.group(2))//KV,float(m.group(1))))
    cache[key]=(a,b,pr,pf); return cache[key]
def profile(a,b,n): return a*n+b*n*(n+1)/2
out=[]
for r in rows:
    a,b,pr,pf=prof_data(r['run'],r['profile'])
    k=r['k']; f=r['fetch_tok']
    # recompute alone estimate: ratio eng/profile of the 2 pure recomputes nearest in size to k
    near=sorted(pr,key=lambda x:abs(math.log(x[0]/k)))[:2]
    ratio=statistics.mean(s/profile(a,b,n) for n,s in near)
    R=ratio*profile(a,b,k)
    # fetch alone: LSQ fit fixed+per token over pure fetches up to 1024 tokens
    xs=[n for n,_ in pf]; ys=[s for _,s in pf]
    mx=statistics.mean(xs); my=statistics.mean(ys)
    sl=sum((x-mx)*(y-my) for x,y in zip(xs,ys))/sum((x-mx)**2 for x in xs)
    c=(my-sl*mx,sl)
    F=c[0]+c[1]*f
    r.update(R_alone=R,F_alone=F,fit_fixed=c[0],fit_per_tok=c[1],rec_ratio=ratio,a=a,b=b)
    out.append(r)
json.dump(out,open('./rows2.json','w'),indent=1)
print(f"{'run':14} {'profile':18} {'n':>5} {'k':>4} {'o':>2} {'i':>5} {'pred':>6} {'meas':>6} {'err%':>6} {'legP':>6} {'R_al':>6} {'recl':>6} {'r_sd':>5} {'F_al':>6} {'fleg':>6} {'f_sd':>5} {'best':>5} crit")
for r in out:
    err=r['meas']/r['pred']-1; best=r['meas']/min(r['mf'],r['mr'])
    legP=(r['pred']-0.005)/(1+r['used_i'])
    tail=r['meas']-r['rec_end']
    crit='F' if tail>0.005 else 'R'
    fleg=r['meas'] if crit=='F' else float('nan')
    flag=('M' if abs(err)>0.15 else ' ')+('S' if best>1 else ' ')
    r.update(err=err,best=best,legP=legP,crit=crit,tail=tail)
    run=r['run'].replace('full-2026-12-03','m').replace('m-evening','e')
    print(f"{run:14} {r['profile']:18} {r['n']:5} {r['k']:4} {r['order']:2} {r['used_i']:5.3f} {r['pred']:6.3f} {r['meas']:6.3f} {100*err:+6.1f} {legP:6.3f} {r['R_alone']:6.3f} {r['rec_leg']:6.3f} {r['rec_leg']/r['R_alone']:5.2f} {r['F_alone']:6.3f} {fleg:6.3f} {fleg/r['F_alone']:5.2f} {best:5.2f} {crit} {flag}")
json.dump(out,open('./rows2.json','w'),indent=1)

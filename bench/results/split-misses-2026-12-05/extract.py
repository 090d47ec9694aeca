import json, re, glob, os, datetime, statistics
BASE='..'
RUNS=[f'full-2026-12-03/run{i}' for i in range(1,7)]+[f'full-2026-12-03-evening/run{i}' for i in range(1,4)]
ANSI=re.compile(r'\x1b\[[0-9;]*m')
def ts(s): 
    # 2026-12-03T20:15:10.064772Z
    return datetime.datetime.strptime(s[:26],'%Y-%m-%dT%H:%M:%S.%f').timestamp()
def clampi(x): return min(max(x,1.0),5.0)
rows=[]
for run in RUNS:
    d=json.load(open(f'{BASE}/{run}/report.json'))
    decs={(x['link']['profile'],x['prefix_tokens']):x for x in d['decisions']}
    # log.txt prefix lines -> list per profile in order
    prof=None; order={}
    for line in open(f'{BASE}/{run}/log.txt'):
        line=ANSI.sub('',line)
        m=re.match(r'== profile (\S+):',line)
        if m: prof=m.group(1); order[prof]=[]; continue
        m=re.match(r'\s+(\d+) tokens: chose (\S+).*?; (split (\d+) recomputed.*|with split allowed: (\S+))',line)
        if m and prof: order[prof].append((int(m.group(1)),m.group(2),m.group(5) or 'split'))
    for prof in order:
        rd=f'{BASE}/{run}/runs/{prof}'
        dl=[ANSI.sub('',l) for l in open(f'{rd}/region-b-daemon.log')]
        el=[ANSI.sub('',l) for l in open(f'{rd}/region-b-engine.log')]
        # executed migrations of split sessions
        mig={}
        for l in dl:
            m=re.search(r'session="(bench-dq-split-\d+)".*migration done wall_s=([\d.e-]+) action=(\w+) bytes=(\d+)',l)
            if m: mig[m.group(1)]=dict(done=ts(l),wall=float(m.group(2)),action=m.group(3),bytes=int(m.group(4)))
        eng={}
        for l in el:
            m=re.search(r'recompute done session="(bench-dq-split-\d+)#\w+" ready=(\d+) seconds=([\d.e-]+)',l)
            if m: eng[m.group(1)]=dict(done=ts(l),ready=int(m.group(2)),secs=float(m.group(3)))
        # pure fetch/recompute walls by session seed from daemon log
        pure={}
        for l in dl:
            m=re.search(r'session="bench-dq-(fetch|recompute)-(\d+)".*wall_s=([\d.e-]+) action=\w+ bytes=(\d+)',l)
            if m: pure[(m.group(1),int(m.group(2)))]=(float(m.group(3)),int(m.group(4)))
        splits=[s for s in d['splits'] if s['link']['profile']==prof]
        sp_sessions=[k for k,v in sorted(mig.items(),key=lambda kv:kv[1]['done']) if v['action']=='split']
        # replay interference
        window=[]; est=0.0; idx=0
        sp_iter=iter(splits)
        for sess in sp_sessions:
            s=next(sp_iter)
            mg=mig[sess]; e=eng.get(sess)
            used=est
            samp=clampi((1+used)*s['measured_split_s']/s['predicted_split_s'])
            n=s['prefix_tokens']; k=s['split_recompute_tokens']
            dec=decs[(prof,n)]
            start=mg['done']-mg['wall']
            rec_end=(e['done']-start) if e else None
            row=dict(run=run,profile=prof,n=n,k=k,fetch_tok=n-k,bytes=mg['bytes'],order=idx,used_i=used,
                     pred=s['predicted_split_s'],meas=s['measured_split_s'],
                     pf=dec['predicted_fetch_s'],pr=dec['predicted_recompute_s'],mf=s['measured_fetch_s'],mr=s['measured_recompute_s'],
                     rec_leg=e['secs'] if e else None, rec_end=rec_end, chosen=dec['chosen'], sample=samp)
            rows.append(row)
            window.append(samp); window=window[-16:]
            est=min(max(statistics.median(window)-1,0),4)
            idx+=1
        assert next(sp_iter,None) is None, (run,prof)
json.dump(rows,open('./rows.json','w'),indent=1)
print(len(rows))

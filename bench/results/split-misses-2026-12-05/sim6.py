import json,statistics
from collections import OrderedDict
B='../'
rows=json.load(open('./rows2.json'))
cf={}
for run in set(r['run'] for r in rows):
    for t in json.load(open(B+run+'/report.json'))['transfers']:
        if t['session_bytes']==64<<20:
            cf[(run,t['link']['profile'])]=(t['cpu_s_per_gib_source']+t['cpu_s_per_gib_target'])*t['goodput_bps']/8/2**30
OV=0.005; MING=0.05; C=2.0
def i_cpu(r):
    busy=1.0 if r['profile'].endswith('cpu-load') else 0.0
    return max(0.0,(busy+1.0)/(C-cf[(r['run'],r['profile'])])-1.0)
seqs=OrderedDict()
for r in rows: seqs.setdefault((r['run'],r['profile']),[]).append(r)
def sim(evening_only, anchor=False, cpu=False, minsamples=1, bpm='pred', show=False):
    T=dict(exec=0,decl=0,w15=0,miss15=0,slower=0,f20=0,lost=0,fixed=0,new=0)
    per=OrderedDict()
    for (rn,prof),rs in seqs.items():
        if evening_only and 'evening' not in rn: continue
        w=[]
        for r in rs:
            prior=i_cpu(r) if cpu else 0.0
            if len(w)<minsamples: i=prior
            else:
                v=w+([1+prior] if anchor else [])
                i=min(max(statistics.median(v)-1,0),4)
            if cpu: i=max(i,prior)
            legP=(r['pred']-OV)/(1+r['used_i'])
            pred2=(1+i)*legP+OV
            bp=min(r['pf'],r['pr']) if bpm=='pred' else min(r['mf'],r['mr'])
            best=r['meas']/min(r['mf'],r['mr'])
            old=abs(r['meas']/r['pred']-1)>0.15 or best>1
            good=best<=0.8
            p=per.setdefault(rn,[0,0,0,0])
            if 1-pred2/bp<MING:
                T['decl']+=1; T['lost']+=good; continue
            e=r['meas']/pred2-1
            T['exec']+=1; T['w15']+=abs(e)<=0.15; T['miss15']+=abs(e)>0.15; T['slower']+=best>1; T['f20']+=good
            T['fixed']+= old and abs(e)<=0.15 and best<=1
            T['new']+= (not old) and (abs(e)>0.15 or best>1)
            p[0]+=1; p[1]+=abs(e)<=0.15; p[2]+=best<=0.8; p[3]+=best>1
            if show and (abs(e)>0.15 or best>1): print('   miss:',rn[-18:],prof,r['n'],r['k'],'%+.0f%%'%(100*e),'best %.2f'%best)
            w.append(min(max((1+r['used_i'])*r['meas']/r['pred'],1),5)); w=w[-16:]
    return T,per
for label,kw in [('now',{}),('anchor prior as sample',dict(anchor=True)),('median needs >=3 samples',dict(minsamples=3)),
                 ('cpu-predicted floor',dict(cpu=True)),('cpu floor + anchor',dict(cpu=True,anchor=True)),('cpu floor + >=3',dict(cpu=True,minsamples=3))]:
    for ev in (True,False):
        T,per=sim(ev,**kw)
        print(f"{label:26} {'evening' if ev else 'all9 '} {T}")
        if ev: print('      per run (splits, within15, >=20% faster, slower):',{k[-4:]:v for k,v in per.items()})
print('remaining misses, cpu floor + anchor, evening:')
sim(True,cpu=True,anchor=True,show=True)
print('remaining misses, cpu floor + anchor, morning+evening:')
sim(False,cpu=True,anchor=True,show=True)

print('\nsensitivity of the cpu floor to the fetch-CPU figure and the formula')
base_cf=dict(cf)
import math
for formula in ('cfs','demand'):
    for mult in (0.5,1.0,1.5,2.0):
        for k in base_cf: cf[k]=base_cf[k]*mult
        if formula=='demand':
            def f(r):
                busy=1.0 if r['profile'].endswith('cpu-load') else 0.0
                return max(0.0,(busy+1.0+cf[(r['run'],r['profile'])])/C-1.0)
        else:
            def f(r):
                busy=1.0 if r['profile'].endswith('cpu-load') else 0.0
                return min(4.0,max(0.0,(busy+1.0)/max(C-cf[(r['run'],r['profile'])],0.25)-1.0))
        globals()['i_cpu']=f
        for ev in (True,False):
            T,per=sim(ev,cpu=True,anchor=True)
            print(f"  {formula:6} c_f x{mult}: {'evening' if ev else 'all9 '} exec {T['exec']} decl {T['decl']} within15 {T['w15']} slower {T['slower']} >=20% {T['f20']} good lost {T['lost']}")

import json,statistics
from collections import OrderedDict
rows=json.load(open('./rows2.json'))
OV=0.005; MING=0.05
seqs=OrderedDict()
for r in rows: seqs.setdefault((r['run'],r['profile']),[]).append(r)
def run(evening_only, est='median', prior=0.0, bpm='pred', verbose=False, fixed_override=None, rp='legP', clamp=False):
    T=dict(exec=0,decl=0,w15=0,slower=0,f20=0,lost=0,fixed=0,new=0,declined_miss=0)
    det=[]
    for (rn,prof),rs in seqs.items():
        if evening_only and 'evening' not in rn: continue
        S=[]
        for r in rs:
            legP=(r['pred']-OV)/(1+r['used_i'])   # model's alone leg (balanced)
            ff=max(r['fit_fixed'],0.0) if fixed_override is None else fixed_override
            ov=max(legP-ff,0.0)
            s=prior if not S else max(0.0,(statistics.median(S) if est=='median' else max(S)))
            pred2=legP+s*ov+OV
            bp=min(r['pf'],r['pr']) if bpm=='pred' else min(r['mf'],r['mr'])
            best=r['meas']/min(r['mf'],r['mr'])
            old=abs(r['meas']/r['pred']-1)>0.15 or best>1
            good=best<=0.8
            if 1-pred2/bp<MING:
                T['decl']+=1; T['lost']+=good; T['declined_miss']+=old
                det.append((rn,prof,r['n'],r['k'],'DECLINE',s,pred2,r['meas'],old,good))
                continue
            T['exec']+=1
            e=r['meas']/pred2-1
            T['w15']+=abs(e)<=0.15; T['slower']+=best>1; T['f20']+=good
            T['fixed']+= old and abs(e)<=0.15 and best<=1
            T['new']+= (not old) and abs(e)>0.15
            det.append((rn,prof,r['n'],r['k'],'exec %+.0f%%'%(100*e),s,pred2,r['meas'],old,good))
            if rp=='legP': smp=(r['rec_end']-legP)/max(ov,0.01)
            else:
                Ra=r['R_alone']; smp=(r['rec_leg']-Ra)/max(min(max(Ra-ff,0), r['fit_per_tok']*r['fetch_tok']),0.01)
            S.append(max(smp,0) if clamp else smp)
    return T,det

for rp in ('legP','Ralone'):
  for clamp in (False,True):
    for ev in (True,False):
      for est in ('median','max'):
        T,det=run(ev,est,rp=rp,clamp=clamp)
        print(rp,'clamp' if clamp else 'noclamp','evening' if ev else 'all9', est, T)
T,det=run(True,'median',rp='Ralone',clamp=True)
for d in det:
    if 'cpu' in d[1] or d[8] or d[4]=='DECLINE': print(d[0][-15:],d[1],d[2],d[3],d[4],'s=%.2f pred=%.3f meas=%.3f'%d[5:8],'oldmiss' if d[8] else '','good' if d[9] else '')

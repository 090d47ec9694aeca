import json
from collections import OrderedDict
B='../'
rows=json.load(open('./rows2.json'))
cf={}
for run in set(r['run'] for r in rows):
    for t in json.load(open(B+run+'/report.json'))['transfers']:
        if t['session_bytes']==64<<20:
            gibps=t['goodput_bps']/8/2**30
            cf[(run,t['link']['profile'])]=(t['cpu_s_per_gib_source']+t['cpu_s_per_gib_target'])*gibps
OV=0.005; MING=0.05; C=2.0
def i_pred(r):
    busy=1.0 if r['profile'].endswith('cpu-load') else 0.0
    c=cf[(r['run'],r['profile'])]
    return max(0.0,(busy+1.0)/(C-c)-1.0)
def sim(form, evening_only, bpm='pred', show=False):
    T=dict(exec=0,decl=0,w15=0,miss15=0,slower=0,f20=0,lost=0,fixed=0,new=0,declined_miss=0)
    for r in rows:
        if evening_only and 'evening' not in r['run']: continue
        legP=(r['pred']-OV)/(1+r['used_i'])
        ip=i_pred(r)
        if form=='sym': pred2=(1+max(ip,r['used_i']))*legP+OV
        else:
            fb=r['fit_per_tok']*r['fetch_tok']
            pred2=max((1+r['used_i'])*legP + ip*min(fb,legP), (1+r['used_i'])*legP)+OV
        bp=min(r['pf'],r['pr']) if bpm=='pred' else min(r['mf'],r['mr'])
        best=r['meas']/min(r['mf'],r['mr'])
        old=abs(r['meas']/r['pred']-1)>0.15 or best>1
        good=best<=0.8
        tag=''
        if 1-pred2/bp<MING:
            T['decl']+=1; T['lost']+=good; T['declined_miss']+=old; tag='DECLINE'
        else:
            e=r['meas']/pred2-1
            T['exec']+=1; T['w15']+=abs(e)<=0.15; T['miss15']+=abs(e)>0.15; T['slower']+=best>1; T['f20']+=good
            T['fixed']+= old and abs(e)<=0.15 and best<=1
            T['new']+= (not old) and abs(e)>0.15
            tag='exec %+.0f%%'%(100*e)
        if show and r['profile'].endswith('load'):
            print('  ',r['run'][-14:],r['n'],r['k'],'i_pred=%.2f'%ip,tag,'pred2=%.3f meas=%.3f gain_pred=%.2f best=%.2f'%(pred2,r['meas'],1-pred2/bp,best),'oldmiss' if old else '','good' if good else '')
    return T
for form in ('sym','overlap'):
    for ev in (True,False):
        for bpm in ('pred','meas'):
            print(form,'evening' if ev else 'all9',bpm,sim(form,ev,bpm))
print('overlap form, cpu-load detail:')
sim('overlap',False,show=True)

import json
rows=json.load(open('./rows.json'))
print(f"{'run':28} {'profile':20} {'n':>5} {'k':>4} {'ord':>3} {'i':>5} {'pred':>6} {'meas':>6} {'err%':>6} {'pf':>6} {'pr':>6} {'mf':>6} {'mr':>6} {'best':>5} {'recleg':>6} {'recend':>6} {'tail':>6} ")
for r in rows:
    err=r['meas']/r['pred']-1; best=r['meas']/min(r['mf'],r['mr'])
    flag=('M' if abs(err)>0.15 else ' ')+('S' if best>1 else ' ')
    tail=r['meas']-r['rec_end'] if r['rec_end'] is not None else float('nan')
    print(f"{r['run'][-18:]:28} {r['profile']:20} {r['n']:5} {r['k']:4} {r['order']:3} {r['used_i']:5.3f} {r['pred']:6.3f} {r['meas']:6.3f} {100*err:+6.1f} {r['pf']:6.3f} {r['pr']:6.3f} {r['mf']:6.3f} {r['mr']:6.3f} {best:5.2f} {r['rec_leg'] or 0:6.3f} {r['rec_end'] or 0:6.3f} {tail:6.3f} {flag}")

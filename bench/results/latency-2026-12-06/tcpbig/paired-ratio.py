import sys, re, statistics as st, collections
# per-round ratio of side A's time over side B's time (>1: B faster), per size
a, b = sys.argv[2], sys.argv[3]
rounds = collections.defaultdict(dict)
for line in open(sys.argv[1]):
    m = re.match(r'round (\d+) (\S+) (.*)', line)
    if not m: continue
    for kv in m[3].split():
        s, t = kv.split(':'); rounds[(int(m[1]), int(s))][m[2].split('/')[-1]] = float(t)
for size in sorted({k[1] for k in rounds}):
    per = sorted(rounds[k][a] / rounds[k][b] for k in rounds if k[1] == size and a in rounds[k] and b in rounds[k])
    print(f"{size:>9} {a}/{b} per-round median {st.median(per):.3f}  quartiles {per[len(per)//4]:.3f}..{per[3*len(per)//4]:.3f}  n={len(per)} wins {sum(p>1 for p in per)}")

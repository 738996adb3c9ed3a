import sys, re, statistics as st, collections
d = collections.defaultdict(lambda: collections.defaultdict(list))
rounds = collections.defaultdict(dict)
for line in open(sys.argv[1]):
    m = re.match(r'round (\d+) (\S+) (.*)', line)
    if not m: continue
    r, side = int(m[1]), m[2].split('/')[-1]
    for kv in m[3].split():
        s, t = kv.split(':'); d[side][int(s)].append(float(t)); rounds[(r, int(s))][side] = float(t)
sides = list(d)
print("size  " + "  ".join(f"{s:>12}" for s in sides) + "   (median us)")
for size in sorted(d[sides[0]]):
    print(f"{size:>8} " + "  ".join(f"{st.median(d[s][size]):12.1f}" for s in sides))
print("ratio ompi/oxccl (speed ratio; >1 = oxccl faster): median of times, best, rounds >= 1.0")
for s in sides[1:]:
    for size in sorted(d[s]):
        o, x = d['ompi'][size], d[s][size]
        per = [rounds[k]['ompi'] / rounds[k][s] for k in rounds if k[1] == size and s in rounds[k]]
        print(f"{s:>14} {size:>8} median {st.median(o)/st.median(x):.3f} best {min(o)/min(x):.3f} per-round-median {st.median(per):.3f} rounds>=1: {sum(p >= 1 for p in per)}/{len(per)}")

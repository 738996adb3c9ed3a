# Summarizes a file of interleaved bench/kv.sh passes (before/after): medians per run and binary, and
# the script's paired engine/raw ratios per pass. Usage: python3 summarize.py kv-interleaved.txt
import re,statistics,sys
t=open(sys.argv[1]).read()
passes=re.split(r'######## pass (\d): (\w+)\n', t)[1:]
data={}
paired={}
for i in range(0,len(passes),3):
    p,w,body=passes[i],passes[i+1],passes[i+2]
    for m in re.finditer(r'^  (\S+)\s+([0-9.]+) GB/s', body, re.M):
        data.setdefault((w,m.group(1)),[]).append(float(m.group(2)))
    for m in re.finditer(r'^(tcp (?:WRITE|READ) \S+ / raw 2 streams)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)', body, re.M):
        paired.setdefault((w,m.group(1)),[]).append(float(m.group(4)))
keys=['tcp.write.1M','tcp.write.4M','tcp.write.16M','tcp.read.1M','tcp.read.4M','tcp.read.16M','raw.1M','raw.4M','raw.16M','tcp1.write.4M','wait.tcp.256M','shm.write.4M','shm.read.4M']
print(f"{'run':16} {'before median':>13} {'after median':>12} {'after/before':>12}   (4 samples each: 2 passes x 2 rounds, GB/s)")
for k in keys:
    b=data.get(('before',k),[]); a=data.get(('after',k),[])
    if not b or not a: continue
    print(f"{k:16} {statistics.median(b):13.3f} {statistics.median(a):12.3f} {statistics.median(a)/statistics.median(b):12.3f}   {b} / {a}")
print()
print("engine / 2 raw streams, paired median of each pass (the script's verdict figure):")
for k in sorted({k for _,k in paired}):
    print(f"  {k:34} before {paired.get(('before',k))}  after {paired.get(('after',k))}")

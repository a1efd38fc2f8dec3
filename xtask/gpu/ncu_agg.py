#!/usr/bin/env python3
"""Aggregate an `ncu --csv --metrics gpu__time_duration.sum` log by kernel name.
usage: ncu_agg.py FILE.csv [DIVISOR]   (DIVISOR: blocks profiled, to print per-block totals)"""
import csv, sys, collections
path = sys.argv[1]; div = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
rows = []
with open(path, newline='') as f:
    lines = [l for l in f if l.startswith('"')]
for r in csv.DictReader(lines):
    if r.get('Metric Name') != 'gpu__time_duration.sum':
        continue
    v = float(r['Metric Value'].replace(',', ''))
    u = r.get('Metric Unit', '')
    us = v / 1000.0 if u.startswith('n') else (v * 1000.0 if u.startswith('m') else v)
    rows.append((r['Kernel Name'], us, r.get('Grid Size', ''), r.get('Block Size', '')))
agg = collections.OrderedDict()
for name, us, g, b in rows:
    a = agg.setdefault(name[:90], [0, 0.0, g, b]); a[0] += 1; a[1] += us
tot = sum(a[1] for a in agg.values())
print(f"{path}: {len(rows)} kernels, total {tot/div:.1f} us per block (divisor {div})")
print(f"{'kernel':90} {'calls':>6} {'us/blk':>9} {'us/call':>9}  grid / block")
for name, (n, us, g, b) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
    print(f"{name:90} {n/div:6.1f} {us/div:9.1f} {us/n:9.2f}  {g} / {b}")

#!/usr/bin/env python3
"""Per-tile timeline of one launch of the fused head GEMM (sm_90a driver), from a diagnostic build.

Never part of a main build. Use (from the repository root, on a scratch clone):
  git apply xtask/gpu/head-trace.patch      # PH_TRACE 3: the 4th launch of each head module
  cargo build --release -p xtask --features cuda
  # on the H200, through `device`; --shape so that the traced launch is the shape wanted:
  PH_TRACE_OUT=$OUT/t ./dflash-bench --only head --shape 8,15,4096
  python3 xtask/gpu/head-trace.py $OUT/t unary_topk.sm_90a      # or proposal_argmax.sm_90a
The patch records, per block and consumer warpgroup and tile (at most 16 tiles a warpgroup,
160 blocks, grid.y = 0), the %globaltimer at the start of the tile's K loop, after its first
chunk, at its end and after the epilogue, and for the top-16 epilogue its floor, scan and
insertion time and passes; per block the producer's start, end and time waiting for free
stages. It stores them in module globals that the bench copies out after its runs. The times
are relative to the earliest producer start. Prints one line per tile index: medians over
the blocks. `consume` includes the wait for the stream (a warpgroup's tile starts after the
other one's).
"""
import statistics as st
import struct
import sys


def main():
    d, m = sys.argv[1], sys.argv[2]
    buf = open(f"{d}/{m}.ph_trace_buf.bin", "rb").read()
    prod = open(f"{d}/{m}.ph_trace_prod.bin", "rb").read()
    B = struct.unpack(f"{len(buf) // 8}Q", buf)
    P = struct.unpack(f"{len(prod) // 8}Q", prod)
    blocks = [b for b in range(160) if P[b * 4]]
    t00 = min(P[b * 4] for b in blocks)
    recs = []
    for b in blocks:
        for wg in range(2):
            for i in range(16):
                o = ((b * 2 + wg) * 16 + i) * 8
                if B[o + 1] == 0:
                    continue
                us = lambda x: (x - t00) / 1e3
                recs.append(dict(b=b, t=B[o] & 0xffffffff, start=us(B[o + 1]), first=us(B[o + 2]),
                                 kend=us(B[o + 3]), end=us(B[o + 4]), fill=B[o + 5] / 1e3,
                                 scan=B[o + 6] / 1e3, ins=(B[o + 7] & ((1 << 48) - 1)) / 1e3,
                                 passes=B[o + 7] >> 48))
    print(f"blocks {len(blocks)}, tiles traced {len(recs)}, chunks per block {sorted({P[b * 4 + 3] & 0xffffffff for b in blocks})}")
    ends = [(P[b * 4 + 1] - t00) / 1e3 for b in blocks]
    waits = [P[b * 4 + 2] / 1e3 for b in blocks]
    print(f"producer end median {st.median(ends):.1f} us, max {max(ends):.1f}; waiting for free stages median {st.median(waits):.1f} us")
    for t in range(32):
        rs = [r for r in recs if r["t"] == t]
        if not rs:
            continue
        med = lambda k: st.median(r[k] for r in rs)
        print(f"tile {t:2d} n={len(rs):3d} start {med('start'):6.1f} consume {st.median(r['kend'] - r['start'] for r in rs):5.1f}"
              f" epilogue {st.median(r['end'] - r['kend'] for r in rs):5.1f} (max {max(r['end'] - r['kend'] for r in rs):5.1f})"
              f" end {med('end'):6.1f} | floor {med('fill'):4.1f} scan {med('scan'):4.1f} insert {med('ins'):4.1f}"
              f" passes {med('passes')}/{max(r['passes'] for r in rs)}")
    last = [max(r["end"] for r in recs if r["b"] == b) for b in {r["b"] for r in recs}]
    print(f"last epilogue end median {st.median(last):.1f} us, max {max(last):.1f}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Merge two parts of one conformance run into docs/conformance.{md,json}.

A full `dflash-conformance` run does not fit one device call on a fresh machine, so it runs as
two calls of the same binaries: `--skip-heavy` (its report printed to stdout, kept in a log)
and `--heavy-only --out DIR` (conformance.md + conformance.json). This script takes
  LIGHT_LOG  the stdout of the --skip-heavy call (holds its markdown report)
  HEAVY_DIR  the --out folder of the --heavy-only call
  COMMIT     the commit the binaries were built from
  OUT_DIR    where conformance.md and conformance.json are written
and writes one report: the header of the heavy call (date, GPU, driver), both commands, every
row of both calls (light rows in the JSON carry only what their markdown table holds), and the
CUDA-graph replay and host-engine sections of the heavy call (both calls run them).
"""
import json
import re
import sys


def table_rows(md):
    rows = []
    for line in md.splitlines():
        if not line.startswith("| ") or line.startswith("| op |") or line.startswith("|---"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 10:
            continue
        rows.append(cells)
    return rows


def main():
    light_log, heavy_dir, commit, out_dir = sys.argv[1:5]
    light = open(light_log).read()
    light_md = light[light.index("# Conformance report"):]
    heavy_md = open(f"{heavy_dir}/conformance.md").read()
    heavy = json.load(open(f"{heavy_dir}/conformance.json"))
    light_cmd = re.search(r"^- command: `(.*)`$", light_md, re.M).group(1)
    lrows = table_rows(light_md.split("## CUDA-graph replay")[0])
    hrows = table_rows(heavy_md.split("## CUDA-graph replay")[0])
    failed = sum(1 for r in lrows + hrows if r[9] != "pass")
    sections = "## CUDA-graph replay" + heavy_md.split("## CUDA-graph replay", 1)[1]
    verdicts = re.findall(r"Verdict: (\w+)", sections) + re.findall(r"\| (pass|FAIL) \|\n", sections.split("## host_engine_zero_copy")[-1])
    failed += sum(1 for v in verdicts if v != "pass")
    head = heavy_md.split("Criteria:")[0]
    head = re.sub(r"^- command: .*$", f"- commit: {commit}\n- commands: `{light_cmd}` (every case but the heavy ones) and `{heavy['command']}` (the heavy ones), the same binaries, two device calls", head, flags=re.M)
    head = re.sub(r"^- result: .*$", f"- result: {len(lrows) + len(hrows)} rows, {failed} failed", head, flags=re.M)
    criteria = "Criteria:" + heavy_md.split("Criteria:", 1)[1].split("| op |")[0]
    table = "| op | case | output | criterion | elements | max abs | max rel | footprint | inputs unchanged | pass |\n|---|---|---|---|---|---|---|---|---|---|\n"
    for r in lrows + hrows:
        table += "| " + " | ".join(r) + " |\n"
    md = head + criteria + table + "\n" + sections
    open(f"{out_dir}/conformance.md", "w").write(md)
    jrows = []
    for r in lrows:
        jrows.append({
            "op": r[0], "case": r[1], "output": r[2], "criterion": r[3], "elements": int(r[4]),
            "max_abs": float(r[5]), "max_rel": float(r[6]), "footprint_ok": r[7] == "ok",
            "inputs_unchanged": r[8] == "ok", "pass": r[9] == "pass", "part": "light",
        })
    for r in heavy["rows"]:
        jrows.append(dict(r, part="heavy"))
    doc = {k: heavy[k] for k in ("date", "gpu", "arch", "driver", "driver_cuda_version", "nvrtc_version")}
    doc.update({"commit": commit, "commands": [light_cmd, heavy["command"]], "rows": jrows})
    open(f"{out_dir}/conformance.json", "w").write(json.dumps(doc, indent=2) + "\n")
    print(f"{len(jrows)} rows, {failed} failed")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Print the SASS lines of a kernel where its warps stall most, from an ncu source-page export:

    ncu --section SourceCounters --section WarpStateStats -o rep ... python dev/profile_case.py fwd 64 0
    ncu --import rep.ncu-rep --page source --csv --print-source sass > rep.csv
    python dev/ncu_hot_lines.py rep.csv [N]

For the N lines with the most warp-stall samples it prints the share of all samples, the address,
the instruction and the stall reasons ncu attributes to it (the columns that hold per-reason
samples, where the export has them). Use it to tell which wait of a pipeline (an mbarrier, a
named barrier, a global load, a wgmma wait) a latency-bound kernel spends its time in.
"""
import csv
import sys


def _number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header_at = next((i for i, r in enumerate(rows) if "Source" in r), None)
    if header_at is None:  # not a source-page export: show what it is
        print("\n".join(",".join(r)[:200] for r in rows[:8]))
        raise SystemExit(f"{path}: no 'Source' column")
    header = rows[header_at]
    body = [r for r in rows[header_at + 1:] if len(r) == len(header)]
    col = {name: i for i, name in enumerate(header)}
    addr = next((n for n in header if "Address" in n), header[0])
    sampling = [n for n in header if "Sampling" in n]
    total_col = next((n for n in sampling if "All" in n), sampling[0] if sampling else None)
    if total_col is None:
        raise SystemExit(f"{path}: no stall-sampling column in {header}")
    reason_cols = [n for n in header if "stall" in n.lower() and "Sampling" not in n]
    total = sum(_number(r[col[total_col]]) for r in body) or 1.0
    print(f"{path}: {len(body)} SASS lines, {total:.0f} stall samples ({total_col})")
    body.sort(key=lambda r: -_number(r[col[total_col]]))
    for r in body[:top]:
        samples = _number(r[col[total_col]])
        reasons = sorted(((_number(r[col[n]]), n) for n in reason_cols), reverse=True)[:3]
        why = ", ".join(f"{n} {v:.0f}" for v, n in reasons if v > 0)
        print(f"{100 * samples / total:5.1f}%  {r[col[addr]]:>8}  {r[col['Source']][:70]:70s}  {why}")


if __name__ == "__main__":
    main()

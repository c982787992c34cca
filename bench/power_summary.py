"""Summaries of `nvidia-smi --query-gpu=power.draw,power.limit,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader,nounits
-lms 50` samples taken while one workload repeated (`make gpu-power`): per file the median and range of power and SM
clock over the samples whose power is above half the largest (the workload's steady part). Prints one line a file and
writes OUT/power.json. Usage: python bench/power_summary.py OUT FILE..."""
import json
import os
import statistics
import sys


def summary(path):
    rows = []
    with open(path) as f:
        for line in f:
            parts = [x.strip() for x in line.split(",")]
            try:
                rows.append([float(x) for x in parts[:5]])
            except ValueError:
                continue
    if not rows:
        return {"samples": 0}
    top = max(r[0] for r in rows)
    busy = [r for r in rows if r[0] > top / 2]
    col = lambda i: [r[i] for r in busy]
    return {"samples": len(rows), "busy_samples": len(busy), "power_w_median": statistics.median(col(0)),
            "power_w_range": [min(col(0)), max(col(0))], "power_limit_w": busy[0][1],
            "sm_mhz_median": statistics.median(col(2)), "sm_mhz_range": [min(col(2)), max(col(2))],
            "mem_mhz_median": statistics.median(col(3)), "temperature_c_max": max(col(4))}


def main():
    out, files = sys.argv[1], sys.argv[2:]
    res = {}
    for p in files:
        name = os.path.basename(p).rsplit(".", 1)[0]
        res[name] = s = summary(p)
        if s["samples"]:
            print(f"{name:>16}: power {s['power_w_median']:.0f} W (limit {s['power_limit_w']:.0f}), SM clock "
                  f"{s['sm_mhz_median']:.0f} MHz ({s['sm_mhz_range'][0]:.0f}-{s['sm_mhz_range'][1]:.0f}), "
                  f"{s['busy_samples']} samples")
        else:
            print(f"{name:>16}: no samples")
    with open(os.path.join(out, "power.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

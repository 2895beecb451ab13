"""Turn compare.py's results into results.json, a markdown report and a PNG chart."""

from __future__ import annotations

import json
import os

TARGET_VS_FSDP2 = 0.90  # flexshard step time / FSDP2's at world size 2 (wall)
TARGET_CPU_VS_FSDP2 = 0.95  # the same in CPU time
TARGET_VS_PLAIN = 1.02  # flexshard step time / the plain model's at world size 1, no cast
TARGET_MEMORY = 1.00  # flexshard peak memory per rank / FSDP2's, every configuration
_SHORT = {"allgather_base": "AG", "all_gather_into_tensor": "AG", "allgather": "AG",
          "reduce_scatter_base": "RS", "reduce_scatter_tensor": "RS", "reduce_scatter": "RS",
          "allreduce": "AR", "all_reduce": "AR", "broadcast": "BC"}


def _ok(results) -> list:
    return [r for r in results if r["status"] == "ok"]


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f}"


def _kb(n: float) -> str:
    return f"{n / 1e3:.0f}"


def _spread(s: dict, fmt="{:.2f}") -> str:
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}–{fmt.format(s['max'])})"


def _ws(r: dict) -> str:
    return f"{r['config']['world_size']}{'*' if r['oversubscribed'] else ''}"


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _table(header, rows) -> str:
    return "\n".join([_row(header), _row(["---"] * len(header)), *map(_row, rows)])


def _collective_counts(colls: dict) -> str:
    if not colls:
        return "0"
    return " + ".join(f"{c['count']} {_SHORT.get(k, k)}" for k, c in colls.items())


def _wire(run: dict) -> tuple:
    wire = sum(d["wire_bytes"] for d in run["wire"].values())
    ideal = sum(d["ideal_bytes"] for d in run["wire"].values())
    return wire, ideal


def _wire_cell(run: dict) -> str:
    wire, ideal = _wire(run)
    return f"{_mb(wire)} (pad {_kb(wire - ideal)} kB)" if wire else "0"


def copies_over_plain(result: dict, kind: str) -> dict:
    """A runner's copy bytes per kind, less the unwrapped model's own copies."""
    own = result["runners"][kind]["copies"]
    return {k: own[k] - result["plain_copies"].get(k, 0) for k in own}


def _copies_cell(result: dict, kind: str) -> str:
    c = copies_over_plain(result, kind)
    return f"{_kb(c['copy_in'])} / {_kb(c['copy_out'])} / {_kb(c['cast'])} / {_kb(c['clone'])}"


def zero_copy_out_bytes(result: dict):
    """flexshard's copy-out bytes in buckets holding only Owned and RaggedShard
    parameters (None when there is no such bucket)."""
    counters = result["runners"]["flexshard"]["flexshard_counters"] or {}
    by = counters.get("copy_out_by_placements", {})
    zero_copy = [v for k, v in by.items() if k and set(k.split("+")) <= {"Owned", "RaggedShard"}]
    return sum(zero_copy) if zero_copy else None


def _owned_ragged_copy_out(result: dict) -> str:
    n = zero_copy_out_bytes(result)
    return "–" if n is None else _kb(n)


def time_table(results) -> str:
    rows = []
    for r in _ok(results):
        st, ratio = r["step_time_s"], r["ratio"]
        plain = "–"
        if "flexshard/plain" in ratio:
            plain = (f"{_spread(ratio['flexshard/plain'])}; CPU "
                     f"{ratio['cpu flexshard/plain']['median']:.2f}")
        rows.append([_ws(r), r["name"], _spread(ratio["flexshard/fsdp2"]), plain,
                     _spread(ratio["cpu flexshard/fsdp2"]),
                     f"{st['fsdp2']['median'] * 1e3:.0f}", f"{st['flexshard']['median'] * 1e3:.0f}",
                     f"{r['loss_gap_flexshard_fsdp2']:.1e}"])
    return _table(["ws", "configuration", "step time flexshard/FSDP2 median (min–max)",
                   "flexshard/plain", "CPU time flexshard/FSDP2", "FSDP2 ms", "flexshard ms",
                   "loss gap"], rows)


def traffic_table(results) -> str:
    rows = []
    for r in _ok(results):
        f, s = r["runners"]["fsdp2"], r["runners"]["flexshard"]
        rows.append([_ws(r), r["name"], _collective_counts(f["collectives"]),
                     _collective_counts(s["collectives"]), _wire_cell(f), _wire_cell(s),
                     _copies_cell(r, "fsdp2"), _copies_cell(r, "flexshard"),
                     _owned_ragged_copy_out(r)])
    return _table(["ws", "configuration", "collectives FSDP2", "collectives flexshard",
                   "wire MB FSDP2", "wire MB flexshard",
                   "copies kB FSDP2 in/out/cast/clone", "copies kB flexshard in/out/cast/clone",
                   "copy-out kB, Owned/Ragged buckets"], rows)


def _mem_cells(run: dict) -> list:
    m = run["memory"]
    peak = max(m["peak_bytes_per_rank"])
    by = m["peak_by_kind"]
    return [_mb(peak), _mb(m["param_bytes"]), _mb(m["grad_bytes"]), _mb(m["opt_state_bytes"]),
            _mb(by.get("unsharded", 0)), _mb(by.get("other", 0) + by.get("grad", 0))]


def memory_table(results) -> str:
    rows = []
    for r in _ok(results):
        f, s = r["runners"]["fsdp2"], r["runners"]["flexshard"]
        ratio = memory_ratio(r)
        cells = [f"{a} / {b}" for a, b in zip(_mem_cells(f), _mem_cells(s))]
        rows.append([_ws(r), r["name"], cells[0], f"{ratio:.3f}", *cells[1:]])
    return _table(["ws", "configuration", "peak MB FSDP2 / flexshard", "peak ratio",
                   "params MB", "grads MB (after backward)", "optimizer state MB",
                   "unsharded at peak MB", "grads+activations+buffers at peak MB"], rows)


def muon_table(results) -> str:
    rows = []
    for r in _ok(results):
        if r["config"]["optimizer"] != "muon":
            continue
        f, s = r["runners"]["fsdp2"], r["runners"]["flexshard"]
        opt_bytes = [sum(c["wire_bytes"] for c in x["optimizer_collectives"].values())
                     for x in (f, s)]
        ot = r["optim_time_s"]
        rows.append([_ws(r), r["name"], _collective_counts(f["optimizer_collectives"]),
                     _collective_counts(s["optimizer_collectives"]),
                     f"{_mb(opt_bytes[0])} / {_mb(opt_bytes[1])}",
                     _spread(r["ratio"]["optim flexshard/fsdp2"]),
                     f"{ot['fsdp2']['median'] * 1e3:.1f} / {ot['flexshard']['median'] * 1e3:.1f}"])
    return _table(["ws", "configuration", "optimizer.step collectives FSDP2",
                   "flexshard", "optimizer wire MB FSDP2 / flexshard",
                   "optimizer.step time flexshard/FSDP2", "optimizer.step ms FSDP2 / flexshard"],
                  rows)


def unavailable(results) -> str:
    gone = [r for r in results if r["status"] != "ok"]
    return "\n".join(f"- ws {r['config']['world_size']} {r['name']}: {r['reason']}" for r in gone)


def _find(results, ws: int, **cfg) -> list:
    return [r for r in _ok(results) if r["config"]["world_size"] == ws
            and all(r["config"][k] == v for k, v in cfg.items())]


def memory_ratio(r: dict) -> float:
    """flexshard's peak memory over FSDP2's, each at its largest rank."""
    f, s = r["runners"]["fsdp2"], r["runners"]["flexshard"]
    return max(s["memory"]["peak_bytes_per_rank"]) / max(f["memory"]["peak_bytes_per_rank"])


def target_checks(r: dict) -> list:
    """(what, value, target) for each of issue 12's targets that applies to `r`."""
    checks = [("memory/FSDP2", memory_ratio(r), TARGET_MEMORY)]
    ratio, ws = r["ratio"], r["config"]["world_size"]
    if ws == 2 and r["config"]["reshard"]:  # the time targets: 2 ranks, reshard on
        checks += [("wall/FSDP2", ratio["flexshard/fsdp2"]["median"], TARGET_VS_FSDP2),
                   ("CPU/FSDP2", ratio["cpu flexshard/fsdp2"]["median"], TARGET_CPU_VS_FSDP2)]
    if "flexshard/plain" in ratio:
        checks += [("wall/plain", ratio["flexshard/plain"]["median"], TARGET_VS_PLAIN),
                   ("CPU/plain", ratio["cpu flexshard/plain"]["median"], TARGET_VS_PLAIN)]
    return checks


def target_line(r: dict) -> str:
    """One configuration's ratios against the targets, each PASS or MISS."""
    cells = [f"{what} {value:.3f}x (<= {target:.2f} {'PASS' if value <= target else 'MISS'})"
             for what, value, target in target_checks(r)]
    return f"ws={_ws(r)} {r['name']}: " + ", ".join(cells)


def targets_table(results) -> str:
    rows = []
    for r in _ok(results):
        checks = target_checks(r)
        rows.append([_ws(r), r["name"],
                     "; ".join(f"{w} {v:.3f}x {'PASS' if v <= t else 'MISS'} (<= {t:.2f})"
                               for w, v, t in checks),
                     "PASS" if all(v <= t for _, v, t in checks) else "MISS"])
    return _table(["ws", "configuration", "ratios against the targets", "all"], rows)


def _verdict(value: float, target: float) -> str:
    if value <= target:
        return f"target <= {target:.2f}: met"
    return f"target <= {target:.2f}: missed by {100 * (value / target - 1):.0f}%"


def _time_lines(results) -> list:
    lines = []
    base = _find(results, 2, placement="shard", param_dtype="fp32", reshard=True,
                 model="odd", optimizer="adamw")
    if base:
        q, cpu = base[0]["ratio"]["flexshard/fsdp2"], base[0]["ratio"]["cpu flexshard/fsdp2"]
        all2 = [r["ratio"]["flexshard/fsdp2"]["median"] for r in _find(results, 2)]
        lines.append(f"- Step time at world size 2 (Shard(0), fp32, reshard, odd shapes): flexshard "
                     f"{_spread(q)}x FSDP2 in wall time ({_verdict(q['median'], TARGET_VS_FSDP2)}), "
                     f"{_spread(cpu)}x in CPU time ({_verdict(cpu['median'], TARGET_VS_FSDP2)}); "
                     f"medians over all {len(all2)} world-size-2 configurations "
                     f"{min(all2):.2f}–{max(all2):.2f}x.")
    plain = [r for r in _find(results, 1) if "flexshard/plain" in r["ratio"]]
    if plain:
        fs = [r["ratio"]["flexshard/plain"]["median"] for r in plain]
        cpu = [r["ratio"]["cpu flexshard/plain"]["median"] for r in plain]
        fsdp = [r["ratio"]["fsdp2/plain"]["median"] for r in plain]
        lines.append(f"- World size 1 against the plain model (medians of the {len(plain)} fp32 "
                     f"configurations): flexshard {min(fs):.2f}–{max(fs):.2f}x wall "
                     f"({_verdict(max(fs), TARGET_VS_PLAIN)}), {min(cpu):.2f}–{max(cpu):.2f}x "
                     f"CPU time ({_verdict(max(cpu), TARGET_VS_PLAIN)}); FSDP2 "
                     f"{min(fsdp):.2f}–{max(fsdp):.2f}x wall.")
    return lines


def _byte_lines(results) -> list:
    multi = [r for r in _ok(results) if r["config"]["world_size"] > 1]
    lines = []
    if multi:
        ratios = [_wire(r["runners"]["flexshard"])[0] / _wire(r["runners"]["fsdp2"])[0] for r in multi]
        over = sum(x > 1 for x in ratios)
        lines.append(f"- Bytes on the wire, flexshard/FSDP2: {min(ratios):.3f}–{max(ratios):.3f} "
                     f"({over} of {len(multi)} configurations above FSDP2).")
        for r in [r for r in multi if r["config"]["placement"] == "ragged"]:
            w, i = _wire(r["runners"]["flexshard"])
            fw, fi = _wire(r["runners"]["fsdp2"])
            lines.append(f"- RaggedShard padding at world size {r['config']['world_size']} "
                         f"({r['name']}): {w - i} bytes (FSDP2 Shard(0): {fw - fi} bytes).")
    zero_copy = [r for r in _ok(results) if r["config"]["placement"] in ("owned", "ragged")]
    if zero_copy:
        total = sum(zero_copy_out_bytes(r) or 0 for r in zero_copy)
        lines.append(f"- Copy-out in Owned and RaggedShard buckets: {total} bytes per step over "
                     f"{len(zero_copy)} configurations (target 0).")
    return lines


def _memory_muon_lines(results) -> list:
    lines = []
    ok = _ok(results)
    if ok:
        ratios = [max(r["runners"]["flexshard"]["memory"]["peak_bytes_per_rank"])
                  / max(r["runners"]["fsdp2"]["memory"]["peak_bytes_per_rank"]) for r in ok]
        lines.append(f"- Peak memory per rank, flexshard/FSDP2: {min(ratios):.3f}–{max(ratios):.3f} "
                     f"({sum(x > 1 for x in ratios)} of {len(ok)} configurations above FSDP2).")
    for r in [r for r in ok if r["config"]["optimizer"] == "muon" and r["config"]["world_size"] > 1]:
        f, s = r["runners"]["fsdp2"], r["runners"]["flexshard"]
        lines.append(f"- Muon at world size {r['config']['world_size']}: optimizer.step issues "
                     f"{_collective_counts(s['optimizer_collectives'])} collectives with flexshard "
                     f"(Owned matrices) against {_collective_counts(f['optimizer_collectives'])} "
                     f"with FSDP2; its time {_spread(r['ratio']['optim flexshard/fsdp2'])}x FSDP2's.")
    return lines


def headline(results) -> str:
    return "\n".join(_time_lines(results) + _byte_lines(results) + _memory_muon_lines(results))


def _chart_series(results, metric) -> dict:
    """world size -> (configuration names, values, (low, high) error or None)."""
    series: dict = {}
    for r in _ok(results):
        ws = _ws(r)
        names, values, errs = series.setdefault(ws, ([], [], []))
        value, err = metric(r)
        names.append(r["name"])
        values.append(value)
        errs.append(err)
    return series


def _time_metric(r):
    q = r["ratio"]["cpu flexshard/fsdp2"]
    return q["median"], (q["median"] - q["min"], q["max"] - q["median"])


def _wall_metric(r):
    return r["ratio"]["flexshard/fsdp2"]["median"], None


def _wire_metric(r):
    f, s = _wire(r["runners"]["fsdp2"])[0], _wire(r["runners"]["flexshard"])[0]
    return (s / f if f else 1.0), None


def _memory_metric(r):
    f = max(r["runners"]["fsdp2"]["memory"]["peak_bytes_per_rank"])
    s = max(r["runners"]["flexshard"]["memory"]["peak_bytes_per_rank"])
    return s / f, None


def _copies_metric(r):
    f = sum(max(v, 0) for v in copies_over_plain(r, "fsdp2").values())
    s = sum(max(v, 0) for v in copies_over_plain(r, "flexshard").values())
    return (s / f if f else 1.0), None


def chart(results, path: str) -> None:
    """Four panels of flexshard/FSDP2 ratios per configuration, one bar colour per world size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("step time: CPU time (bars: median, min–max, cut at 2), wall time (dots: median)",
               _time_metric, TARGET_VS_FSDP2),
              ("bytes on the wire", _wire_metric, None),
              ("peak memory per rank", _memory_metric, None),
              ("local copy bytes over the plain model", _copies_metric, None)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3.2 * len(panels)), sharex=True)
    names = list(dict.fromkeys(r["name"] for r in _ok(results)))
    for ax, (title, metric, target) in zip(axes, panels):
        series = _chart_series(results, metric)
        width = 0.8 / max(len(series), 1)
        for i, (ws, (cfgs, values, errs)) in enumerate(series.items()):
            xs = [names.index(c) + (i - (len(series) - 1) / 2) * width for c in cfgs]
            yerr = None if errs[0] is None else list(zip(*errs))
            ax.bar(xs, values, width, yerr=yerr, capsize=2, label=f"world size {ws}")
            if metric is _time_metric:
                walls = _chart_series(results, _wall_metric)[ws][1]
                ax.plot(xs, walls, "k.", markersize=5)
        ax.axhline(1.0, color="black", linewidth=0.8)
        if target:
            ax.axhline(target, color="green", linestyle="--", linewidth=0.8, label="target")
            ax.set_ylim(0, 2.0)  # a stray slow step (shared machine) would squash the bars
        ax.set_ylabel("flexshard / FSDP2")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7, ncol=4)
    axes[-1].set_xticks(range(len(names)))
    axes[-1].set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    fig.text(0.01, 0.005, "* world size 4 runs 4 processes on 2 cores (oversubscribed)", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(results, meta: dict) -> str:
    """The whole report: where it ran, the headline, the tables."""
    where = (f"{meta['date']}, torch {meta['torch']}, {meta['backend']}, {meta['cpu_cores']} CPU "
             f"cores, 1 thread per rank, load average at start {meta['load_average_start'][0]:.1f}"
             + (f", at end {meta['load_average_end'][0]:.1f}" if "load_average_end" in meta else ""))
    parts = [f"Measured {where}. `*`: world size 4 oversubscribes the cores.",
             "### Targets (issue 12): peak memory <= 1.00x FSDP2; at 2 ranks median step "
             "<= 0.90x FSDP2 wall, <= 0.95x CPU; at 1 rank without a cast <= 1.02x plain",
             targets_table(results),
             "### Headline", headline(results),
             "### Step time", time_table(results),
             "### Collectives, bytes on the wire and local copies (one step, rank 0)",
             traffic_table(results),
             "### Peak memory per rank (largest rank)", memory_table(results)]
    if any(r["config"]["optimizer"] == "muon" for r in _ok(results)):
        parts += ["### Muon: optimizer.step", muon_table(results)]
    if unavailable(results):
        parts += ["### Not run", unavailable(results)]
    return "\n\n".join(parts) + "\n"


def write_outputs(results, meta: dict, out_dir: str, chart_png: bool = True) -> None:
    """results.json, results.md and (with matplotlib) results.png in `out_dir`
    (a run's outputs: RESULTS.md quotes what it keeps, by hand, with the command)."""
    os.makedirs(out_dir, exist_ok=True)
    text = markdown(results, meta)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(text)
    if chart_png and _ok(results):
        chart(results, os.path.join(out_dir, "results.png"))
    print(text)

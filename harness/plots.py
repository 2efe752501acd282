"""PNG plots of benchmark and evaluation results, for docs/ and for operators who would rather look
than read. Each function takes the JSON a script already writes and returns the paths it wrote.

    latency_by_concurrency(report, out)  bench/bench_engines.py --json: QPS, p50 and p99 per engine
    recall_vs_qps(report, out)           the same report's knob sweeps: recall@k against serial QPS
    ndcg_by_slice(summary, out)          index-builder eval's summary.json: nDCG@10 per mode and slice

matplotlib is in the `bench` extra; without it the scripts say so instead of failing late.
"""
from __future__ import annotations

from pathlib import Path


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit("plots need matplotlib: pip install -e '.[bench]'") from exc
    matplotlib.use("Agg")  # files only; no display
    import matplotlib.pyplot as plt

    return plt


def _engine_runs(report: dict):
    """(label, runs by concurrency) for every engine and client variant that ran."""
    for name, rec in report.get("engines", {}).items():
        if rec.get("runs"):
            yield name, rec["runs"]
        for variant, v in rec.get("variants", {}).items():
            if v.get("runs"):
                yield f"{name} [{variant}]", v["runs"]


def _styles(plt):
    """Distinct colour and marker per line (the default cycle repeats after 10 colours)."""
    colours = plt.get_cmap("tab20").colors
    markers = "osD^v<>phX*"
    i = 0
    while True:
        yield {"color": colours[(2 * i) % 20 + (i // 10) % 2], "marker": markers[i % len(markers)]}
        i += 1


def latency_by_concurrency(report: dict, out: Path) -> list[Path]:
    plt = _pyplot()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    for (label, runs), style in zip(_engine_runs(report), _styles(plt)):
        concs = sorted(int(c) for c in runs)
        ms = [runs[str(c)] for c in concs]
        axes[0].plot(concs, [m["qps"] for m in ms], label=label, **style)
        axes[1].plot(concs, [m["p50_ms"] for m in ms], label=label, **style)
        axes[2].plot(concs, [m["p99_ms"] for m in ms], label=label, **style)
    for ax, title in zip(axes, ("queries per second", "p50 latency (ms)", "p99 latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=8)
    shape = report.get("shape", ["?", "?"])
    fig.suptitle(f"top-{report.get('k')} over {report.get('n_indexed')} x {shape[1]}-d vectors, "
                 f"recall@{report.get('k')} >= {report.get('target_recall')}, {report.get('cpus')} CPUs")
    fig.tight_layout()
    path = out / "latency_by_concurrency.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def recall_vs_qps(report: dict, out: Path) -> list[Path]:
    plt = _pyplot()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    n = report.get("n_queries") or 1
    fig, ax = plt.subplots(figsize=(8, 5.5))
    styles = _styles(plt)
    for name, rec in report.get("engines", {}).items():
        sweep = [s for s in rec.get("sweep", []) if s.get("sweep_s")]
        if not sweep:
            continue
        ax.plot([n / s["sweep_s"] for s in sweep], [s["recall"] for s in sweep], label=name,
                **next(styles))
        for s in sweep:
            ax.annotate(str(s["knob"]), (n / s["sweep_s"], s["recall"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
    ax.axhline(report.get("target_recall", 0.95), color="grey", linestyle="--", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("queries per second (one client, serial; the knob sweep)")
    ax.set_ylabel(f"recall@{report.get('k')}")
    ax.set_title("recall against speed; labels are each engine's knob value")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "recall_vs_qps.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def ndcg_by_slice(summary: dict, out: Path, metric: str = "ndcg@10") -> list[Path]:
    """One panel per dataset: grouped bars of `metric` for each mode over each query slice."""
    plt = _pyplot()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    datasets = [(name, d["summary"]) for name, d in summary.items() if d.get("summary")]
    if not datasets:
        return []
    fig, axes = plt.subplots(1, len(datasets), figsize=(7 * len(datasets), 5), squeeze=False)
    for ax, (name, modes) in zip(axes[0], datasets):
        slices = list(next(iter(modes.values())))
        width = 0.8 / len(modes)
        for i, (mode, by_slice) in enumerate(modes.items()):
            xs = [j + i * width for j in range(len(slices))]
            ax.bar(xs, [by_slice.get(s, {}).get(metric, 0.0) for s in slices], width, label=mode)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(slices))])
        ax.set_xticklabels([f"{s}\n(n={next(iter(modes.values()))[s]['n']})" for s in slices],
                           fontsize=8)
        ax.set_title(name)
        ax.set_ylabel(metric)
        ax.grid(True, axis="y", alpha=0.3)
    # one legend under the panels: inside them it covers the bars
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 9), fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path = out / f"{metric.replace('@', '_at_')}_by_slice.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def main(argv=None) -> int:
    """python -m harness.plots engines REPORT.json OUT_DIR | eval SUMMARY.json OUT_DIR"""
    import argparse
    import json

    ap = argparse.ArgumentParser(description="PNG plots from a benchmark or evaluation JSON")
    ap.add_argument("kind", choices=["engines", "eval"])
    ap.add_argument("json", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    data = json.loads(args.json.read_text())
    if args.kind == "engines":
        paths = latency_by_concurrency(data, args.out) + recall_vs_qps(data, args.out)
    else:
        paths = ndcg_by_slice(data, args.out)
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`fp8engine bench --plot F.png`: speedup and preemptions per mode, side by side."""


from fp8engine.bench.throughput import machine_words, shape_words


def plot_report(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["results"] if "preemptions_total" in r]
    modes = [r["mode"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    bars = ax1.bar(modes, [r["ratio_vs_first"] for r in rows], color="#4C72B0")
    ax1.bar_label(bars, fmt="%.2fx")
    ax1.axhline(1.0, color="gray", lw=0.8)
    ax1.set_title(f"rollout throughput vs {modes[0]}")
    ax1.set_ylabel("speedup (output tokens/s)")
    bars = ax2.bar(modes, [r["preemptions_total"] for r in rows], color="#DD8452")
    ax2.bar_label(bars)
    ax2.set_title("preemptions (total)")
    fig.suptitle(f"{report['workload']['name']}: {shape_words(report['shape'])}, {machine_words(report['machine'])}, "
                 f"torch {report['machine']['torch']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

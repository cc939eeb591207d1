"""PNG of one ``bench serve`` run: latency percentiles (left) and throughput (right)."""

from __future__ import annotations

from ringserve.bench.metrics import RequestResult, percentile

PERCENTILES = (50, 90, 95, 99)


def plot_run(path: str, summary: dict, results: list[RequestResult]) -> None:
    """Write ``path``: TTFT, TPOT, ITL and E2E at p50/p90/p95/p99 (ms, log scale) and
    request (req/s) and token (tok/s) throughput. Needs matplotlib (a dev dependency)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.success]
    samples = {
        "TTFT": [r.ttft * 1000 for r in ok if r.chunk_times],
        "TPOT": [r.tpot * 1000 for r in ok if r.output_tokens > 1],
        "ITL": [g * 1000 for r in ok for g in r.itl],
        "E2E": [r.e2e_latency * 1000 for r in ok],
    }
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(PERCENTILES)
    for k, q in enumerate(PERCENTILES):
        xs = [i + k * width for i in range(len(samples))]
        lat.bar(xs, [percentile(v, q) for v in samples.values()], width, label=f"p{q}")
    lat.set_xticks([i + 0.4 - width / 2 for i in range(len(samples))], list(samples))
    lat.set_yscale("log")
    lat.set_ylabel("ms")
    lat.set_title("latency percentiles")
    lat.legend()
    names = ["requests/s", "input tok/s", "output tok/s"]
    values = [summary["request_throughput"], summary["input_throughput"], summary["output_throughput"]]
    bars = thr.bar(names, values, color=["#777", "#59c", "#e83"])
    thr.bar_label(bars, fmt="%.1f")
    thr.set_title("throughput")
    fig.suptitle(
        f"{summary['model']} @ {summary['base_url']}: {summary['completed']} ok / {summary['failed']} failed, "
        f"concurrency {summary['max_concurrency']}, in {summary['input_len']} out {summary['output_len']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

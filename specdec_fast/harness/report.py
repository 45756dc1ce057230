"""Writing a benchmark report: `report.json` (everything), `report.md` (the summary), PNG plots.

The summary names the best configuration per task type and concurrency (by TPOT speed-up over the
same prompts decoded plainly at the same batch size; plain decoding where no cell beats it by
more than the measured noise of that batch size), lists where speculation loses (speed-up
below 1 by more than the measured noise), shows adaptive speculation against the baseline at
every concurrency, and lists every divergence from the baseline. Plots need matplotlib (the
`plot` extra); without it they are skipped and the summary says so.
"""

from __future__ import annotations

import json
from pathlib import Path

MAX_DIVERGENCES_SHOWN = 20


def _f(value, spec: str = ".2f", scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def _ms(percentiles: dict) -> str:
    return "/".join(_f(percentiles.get(q), ".1f", 1e3) for q in ("p50", "p95", "p99"))


def best_by_task(report: dict) -> dict[str, dict[str, dict]]:
    """task -> batch -> the cell with the highest TPOT speed-up on that task's prompts, with the
    batch's noise and whether the cell beats plain decoding by more than it (`recommended`: the
    best of many cells is the luckiest too, so a gain within the noise recommends nothing)."""
    best: dict[str, dict[str, dict]] = {}
    for cell in report["cells"]:
        noise = report["noise"][str(cell["batch"])]
        for task, figures in cell["splits"].get("task", {}).items():
            speedup = figures.get("speedup_tpot")
            slot = best.setdefault(task, {})
            current = slot.get(str(cell["batch"]))
            if speedup is not None and (current is None or speedup > current["speedup"]):
                slot[str(cell["batch"])] = {
                    "cell": cell["name"],
                    "speedup": speedup,
                    "noise": noise,
                    "recommended": speedup > 1.0 + noise,
                }
    return best


def losses(report: dict) -> list[dict]:
    """Cells slower than their baseline by more than the noise of that batch size."""
    out = []
    for cell in report["cells"]:
        noise = report["noise"][str(cell["batch"])]
        if cell["speedup"] is not None and cell["speedup"] < 1.0 - noise:
            out.append(
                {
                    "cell": cell["name"],
                    "batch": cell["batch"],
                    "speedup": cell["speedup"],
                    "noise": noise,
                }
            )
    return out


def adaptive_rows(report: dict) -> list[dict]:
    """Adaptive cells against the baseline: ratio, noise, and whether it is within noise."""
    rows = []
    for cell in report["cells"]:
        if not cell["adaptive"]:
            continue
        noise = report["noise"][str(cell["batch"])]
        ratio = cell["speedup"]
        rows.append(
            {
                "cell": cell["name"],
                "batch": cell["batch"],
                "ratio_to_baseline": ratio,
                "noise": noise,
                "plain_step_share": cell["adaptive_budgets"]["plain_steps"]
                / max(cell["adaptive_budgets"]["steps"], 1),
                "explorations": cell["adaptive_budgets"]["explorations"],
                "within_noise_or_faster": ratio is not None and ratio >= 1.0 - noise,
            }
        )
    return rows


def summarize(report: dict) -> None:
    """Add the derived sections (best, losses, adaptive) to `report` in place."""
    report["best_by_task_and_batch"] = best_by_task(report)
    report["losses"] = losses(report)
    report["adaptive_vs_baseline"] = adaptive_rows(report)


def axis(report: dict) -> str:
    """What the cells' `batch` is: a batch size (offline), or a QPS level (`bench --url`)."""
    return "QPS" if report["config"].get("axis") == "qps" else "batch"


def _grid(report: dict) -> str:
    config = report["config"]
    if axis(report) == "QPS":
        return (
            f"Served traffic at {config['url']}: routes {config['drafters']} against the "
            f"`{config['baseline_route']}` route (speculation off) at QPS {config['batches']}, "
            "Poisson arrivals (seed "
            f"{config['seed']}) for {config['duration_s']} s or {config['num_requests']} "
            "requests per level, one route after the other with the same arrivals and prompts. "
            "Speed-ups are TPOT p50 ratios to the baseline route at the same QPS; the noise is "
            f"the assumed floor ({config['noise_floor']:.0%})."
        )
    return (
        f"Grid: drafters {config['drafters']}, sizes {config['sizes']}, "
        f"trees {config['trees']}, batches {config['batches']}, adaptive "
        f"{config['adaptive']}. Speed-ups compare tokens/s with plain decoding of the "
        "same prompts at the same batch size, run in turns with each cell (paired); noise is how "
        "far plain decoding paired with itself strays from 1.0 "
        f"(at least {config['noise_floor']:.0%})."
    )


def _run_lines(report: dict) -> list[str]:
    """The batches each concurrency formed, the sweep's compile choice and time split, then
    every failed request (offline sweeps)."""
    lines = []
    formed = report.get("formed_batches") or {}
    short = {b: sizes for b, sizes in formed.items() if any(n < int(b) for n in sizes)}
    if short:
        calls = "; ".join(f"{b}: {', '.join(map(str, sizes))}" for b, sizes in short.items())
        lines += [
            "",
            "Prompts decode together only with others of the same max_new_tokens: the calls "
            f"made at each concurrency below it held {calls} prompts.",
        ]
    timing = report.get("timing")
    if timing is not None:
        lines += [
            "",
            f"Steps: {timing['compile_choice']['rule']}. The sweep took {timing['total_s']:.0f} s: "
            f"{timing['measured_s']:.0f} s measured, {timing['warmup_s']:.0f} s of warm-ups, "
            f"{timing['calibration_s']:.0f} s calibrating, {timing['compile_s']:.0f} s compiling.",
        ]
    failed = report.get("failed_requests") or []
    if failed:
        lines += ["", f"## FAILED REQUESTS: {len(failed)}", ""]
        lines += ["| cell | batch | side | prompt | error |", "|---|---|---|---|---|"]
        lines += [
            f"| {f['cell']} | {f['batch']} | {f['side']} | {f['prompt_id']} | {f['error']} |"
            for f in failed
        ]
    return lines


def markdown(report: dict) -> str:
    meta, lines = report.get("meta", {}), []
    level = axis(report)
    lines += [
        "# Speculative decoding benchmark",
        "",
        f"Model `{meta.get('model')}` on {meta.get('device')}, {len(report['prompts'])} prompts "
        f"({meta.get('prompts_file')}), {meta.get('date')}. Versions: {meta.get('versions')}.",
        _grid(report),
        "",
        f"Mode: {_mode(report['config'])}.",
        *_run_lines(report),
        "",
        "## Baseline (plain decoding)",
        "",
        "Its first run. Each cell's speed-up is against the plain runs paired with it (the "
        "cells' `plain tok/s`), which met the same machine conditions.",
        "",
        f"| {level} | tok/s | req/s | TTFT ms p50/p95/p99 | TPOT ms p50/p95/p99 "
        "| ITL ms p50/p95/p99 | device mem MB | error rate | cost/1K tok | noise |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for batch, m in report["baseline"].items():
        lines.append(
            f"| {batch} | {_f(m['tokens_per_second'], '.1f')} | {_f(m['requests_per_second'])} "
            f"| {_ms(m['ttft_s'])} | {_ms(m['tpot_s'])} | {_ms(m['itl_s'])} "
            f"| {_f(m['peak_memory_bytes'], '.0f', 1e-6)} | {_f(m['error_rate'], '.3f')} "
            f"| {_f(m['cost_per_1k_output_tokens'], '.5f')} | {report['noise'][batch]:.1%} |"
        )
    lines += [
        "",
        "## Cells",
        "",
        "N: tokens verified per step, root included (a chain of k drafted tokens has N = k + 1).",
        "",
        f"| cell | N | {level} | accept | tok/step | per-position accept | tok/s | plain tok/s "
        "| speed-up | TPOT ms p50/p95/p99 | ITL ms p50/p95/p99 | errors | cost/1K tok "
        "| greedy exact | quality regressions |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in report["cells"]:
        m, q = c["metrics"], c["quality"]
        positions = " ".join(_f(a) for a in m["per_position_acceptance"][:4])
        lines.append(
            f"| {c['name']} | {c['nodes']} | {c['batch']} | {_f(m['acceptance_rate'])} "
            f"| {_f(m['mean_accepted_tokens_per_step'])} | {positions or '-'} "
            f"| {_f(m['tokens_per_second'], '.1f')} "
            f"| {_f(c['paired_baseline_tokens_per_second'], '.1f')} "
            f"| {_f(c['speedup'])}x | {_ms(m['tpot_s'])} "
            f"| {_ms(m['itl_s'])} | {_f(m['error_rate'], '.3f')} "
            f"| {_f(m['cost_per_1k_output_tokens'], '.5f')} "
            f"| {q['greedy_exact_matches']}/{q['greedy_prompts']} | {q['quality_regressions']} |"
        )
    lines += ["", "## Best configuration per task type and concurrency", ""]
    batches = [str(b) for b in report["config"]["batches"]]
    lines += [
        "| task | " + " | ".join(f"{level} {b}" for b in batches) + " |",
        "|---|" + "---|" * len(batches),
    ]
    for task, by_batch in sorted(report["best_by_task_and_batch"].items()):
        cells = []
        for b in batches:
            best = by_batch.get(b)
            if best is None:
                cells.append("-")
            elif not best["recommended"]:
                cells.append(f"plain (best: {best['cell']} {best['speedup']:.2f}x)")
            else:
                cells.append(f"{best['cell']} {best['speedup']:.2f}x")
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "TPOT speed-up on that task's prompts (the tables above: tokens/s over all prompts); "
        "`plain` where no cell beats plain decoding by more than the noise of that batch size.",
        "",
    ]
    lines += ["## Where speculation loses", ""]
    if report["losses"]:
        for loss in report["losses"]:
            lines.append(
                f"- {loss['cell']} at {level} {loss['batch']}: {loss['speedup']:.2f}x "
                f"(noise {loss['noise']:.1%})"
            )
    else:
        lines.append("No cell is slower than its baseline by more than the noise.")
    lines += ["", "## Adaptive speculation against the baseline", ""]
    rows = report["adaptive_vs_baseline"]
    if rows:
        lines += [
            f"| cell | {level} | ratio to baseline | noise | plain steps | exploring requests "
            "| verdict |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            verdict = "ok" if r["within_noise_or_faster"] else "SLOWER beyond noise"
            lines.append(
                f"| {r['cell']} | {r['batch']} | {_f(r['ratio_to_baseline'])}x "
                f"| {r['noise']:.1%} | {r['plain_step_share']:.0%} | {r['explorations']} "
                f"| {verdict} |"
            )
        slower = [r for r in rows if not r["within_noise_or_faster"]]
        lines.append("")
        lines.append(
            "With adaptation on, no cell is slower than the baseline by more than noise."
            if not slower
            else f"{len(slower)} adaptive cells are slower than the baseline beyond noise."
        )
    else:
        lines.append("Adaptive cells were not run.")
    lines += _serving_tables(report)
    lines += _split_tables(report)
    lines += quality_section(report)
    if any("guardrails" in c for c in report["cells"]):
        lines += [
            "",
            "## Guardrail verdicts",
            "",
            f"| cell | {level} | route | verdict |",
            "|---|---|---|---|",
        ]
        for c in report["cells"]:
            for route, v in c.get("guardrails", {}).items():
                broken = "; ".join(v["broken"])
                if not v["speculate"]:
                    verdict = f"fall back: {broken}"
                else:
                    verdict = f"speculate (log only: {broken})" if broken else "speculate"
                lines.append(f"| {c['name']} | {c['batch']} | {route} | {verdict} |")
    lines += ["", "## Plots", ""]
    plots = report.get("plots") or []
    if plots:
        lines += [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    else:
        lines.append(report.get("plots_note", "No plots."))
    return "\n".join(lines) + "\n"


def _serving_tables(report: dict) -> list[str]:
    """Served traffic (`bench --url`): every route at every QPS level, and the integrity of
    the responses."""
    if "serving" not in report:
        return []
    lines = [
        "",
        "## Served traffic",
        "",
        "| QPS | route | requests | tok/s | req/s | goodput req/s | concurrency | TTFT ms "
        "p50/p95/p99 | TPOT ms p50/p95/p99 | ITL ms p50/p95/p99 | E2E ms p50/p95/p99 | accept "
        "| tok/step | errors | decoding / prefilling |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for level, routes in report["serving"].items():
        for route, m in routes.items():
            busy = m.get("scheduler", {})
            shares = (
                f"{_f(busy.get('decode_share'), '.0%')} / {_f(busy.get('prefill_share'), '.0%')}"
            )
            lines.append(
                f"| {level} | {route} | {m['requests']} | {_f(m['tokens_per_second'], '.1f')} "
                f"| {_f(m['requests_per_second'])} | {_f(m['goodput_requests_per_second'])} "
                f"| {_f(m['mean_concurrency'])} | {_ms(m['ttft_s'])} | {_ms(m['tpot_s'])} "
                f"| {_ms(m['itl_s'])} | {_ms(m['e2e_s'])} | {_f(m['acceptance_rate'])} "
                f"| {_f(m['mean_accepted_tokens_per_step'])} | {_f(m['error_rate'], '.3f')} "
                f"| {shares} |"
            )
    slo = report["config"].get("goodput_slo_s") or {}
    lines += [
        "",
        "Goodput counts completed requests meeting "
        + (", ".join(f"{k} <= {v * 1e3:g} ms" for k, v in slo.items()) or "no SLO (all of them)")
        + ". Acceptance comes from the server's spec-decode counters over the level; decoding "
        "/ prefilling: the share of the level's time the scheduler spent in decode steps and in "
        "feeding newcomers' prompts.",
        "",
        "| QPS | route | requests | completed | errors (refused) | lost | unaccounted | wrong ids "
        "| inconsistent greedy outputs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for level, routes in report.get("integrity", {}).items():
        for route, i in routes.items():
            lines.append(
                f"| {level} | {route} | {i['requests']} | {i['completed']} | {i['errors']} "
                f"({i['refused']}) | {i['lost']} | {i['unaccounted']} | {i['wrong_ids']} "
                f"| {i['inconsistent_outputs']} |"
            )
    return lines


def _split_tables(report: dict) -> list[str]:
    kinds = sorted({k for c in report["cells"] for k in c["splits"] if k != "task"} | {"task"})
    lines = ["", "## Splits (TPOT speed-up against the same prompts decoded plainly)"]
    for kind in kinds:
        values = sorted({v for c in report["cells"] for v in c["splits"].get(kind, {})})
        lines += [
            "",
            f"### by {kind.replace('_', ' ')}",
            "",
            f"| cell | {axis(report)} | " + " | ".join(values) + " |",
            "|---|---|" + "---|" * len(values),
        ]
        for c in report["cells"]:
            split = c["splits"].get(kind, {})
            row = [_f(split.get(v, {}).get("speedup_tpot")) for v in values]
            lines.append(f"| {c['name']} | {c['batch']} | " + " | ".join(row) + " |")
    return lines


def _mode(config: dict) -> str:
    if config.get("exact"):
        return (
            "exact (batch-invariant target forwards: every greedy output must equal the "
            "baseline's bit for bit)"
        )
    return (
        "default (reduction order depends on the tokens per call: low-precision near-ties may "
        "flip; `--exact` rules that out)"
    )


def quality_section(report: dict) -> list[str]:
    """The report's "Quality equivalence" lines: the mode, the checks passed, and every
    divergence from the baseline (near-ties and real ones counted apart)."""
    found = [(c, d) for c in report["cells"] for d in c["quality"]["divergences"]]
    lines = ["", "## Quality equivalence", "", f"Mode: {_mode(report['config'])}.", ""]
    qualities = [c["quality"] for c in report["cells"]]
    checked = sum(q.get("checked_prompts", 0) for q in qualities)
    if checked:
        plain = sum(q["baseline_check_passes"] for q in qualities)
        speculative = sum(q["speculative_check_passes"] for q in qualities)
        lines += [
            f"Checks passed over every cell's prompts: plain decoding {plain} of {checked}, "
            f"speculation {speculative} of {checked} (per cell in report.json).",
            "",
        ]
    if not found:
        lines.append("Every greedy output equals the baseline's, and no check regressed.")
        return lines
    near_ties = sum(d.get("near_tie", False) for _, d in found)
    gap = found[0][0]["quality"].get("near_tie_gap")
    if gap is None or all(d.get("logit_gap") is None for _, d in found):
        split = "logit gaps not measured"
    else:
        split = (
            f"{near_ties} at near-ties (the target's logits of the two tokens at the first "
            f"differing position, under the baseline's context, differ by less than {gap:g}), "
            f"{len(found) - near_ties} real"
        )
    lines.append(
        f"{len(found)} divergences (all in report.json): {split}; the first "
        f"{min(len(found), MAX_DIVERGENCES_SHOWN)}:"
    )
    for cell, d in found[:MAX_DIVERGENCES_SHOWN]:
        kind = "quality regression" if d["quality_regression"] else "greedy mismatch"
        tie = "" if d.get("logit_gap") is None else f", logit gap {d['logit_gap']:.3g}"
        tie += " (near-tie)" if d.get("near_tie") else ""
        lines += [
            "",
            f"- **{cell['name']} {axis(report)}={cell['batch']}**, prompt `{d['prompt_id']}` "
            f"({d['task']}), {kind}, first differing token {d['first_differing_token']}{tie}",
            f"  - baseline: `{json.dumps(d['baseline_output'])[:200]}`",
            f"  - speculative: `{json.dumps(d['speculative_output'])[:200]}`",
        ]
    return lines


def plot(report: dict, out_dir: Path) -> list[str]:
    """PNG plots into `out_dir`; returns their paths (empty and a note without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        report["plots_note"] = (
            "Plots skipped: matplotlib is not installed (`pip install specdec-fast[plot]`)."
        )
        return []
    cells = [c for c in report["cells"] if not c["adaptive"]]
    level = axis(report)
    paths = []

    def legend(ax, **options) -> None:
        # A plot whose cells measured nothing (every request failed) says so instead.
        if ax.get_legend_handles_labels()[0]:
            ax.legend(**options)
        else:
            ax.text(0.5, 0.5, "nothing measured", ha="center", va="center", transform=ax.transAxes)

    def save(fig, name: str) -> None:
        path = out_dir / f"{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(str(path))

    smallest = min(report["config"]["batches"])
    # A report without speculative cells (a served baseline alone) has no curves to draw.
    if report["cells"]:
        fig, ax = plt.subplots(figsize=(6, 4))
        for c in cells:
            if c["batch"] == smallest and c["metrics"]["per_position_acceptance"]:
                acc = c["metrics"]["per_position_acceptance"]
                ax.plot(range(1, len(acc) + 1), acc, marker="o", label=c["name"])
        ax.set(xlabel="draft position (depth)", ylabel="acceptance", title="Acceptance by position")
        legend(ax, fontsize=7)
        save(fig, "acceptance_by_position")

        fig, ax = plt.subplots(figsize=(6, 4))
        for drafter in sorted({c["drafter"] for c in cells}):
            for batch in report["config"]["batches"]:
                points = sorted(
                    (c["nodes"], c["speedup"] or 0)
                    for c in cells
                    if c["drafter"] == drafter and c["batch"] == batch
                )
                ax.plot(*zip(*points, strict=True), marker="o", label=f"{drafter} {level}={batch}")
        ax.axhline(1.0, color="grey", linestyle="--")
        ax.set(
            xlabel="N, tokens verified per step (a chain of k: N = k + 1)",
            ylabel="speed-up",
            title="Speed-up against the tree size",
        )
        legend(ax, fontsize=7)
        save(fig, "speedup_vs_k")

        fig, ax = plt.subplots(figsize=(6, 4))
        for name in sorted({c["name"] for c in report["cells"]}):
            points = sorted(
                (c["batch"], c["speedup"] or 0) for c in report["cells"] if c["name"] == name
            )
            adaptive = name.startswith("adaptive(")
            ax.plot(*zip(*points, strict=True), marker="o", ls=":" if adaptive else "-", label=name)
        ax.axhline(1.0, color="grey", linestyle="--")
        ax.set(
            xscale="log",
            xlabel="QPS" if level == "QPS" else "batch (concurrency)",
            ylabel="speed-up",
            title="Speed-up against concurrency",
        )
        legend(ax, fontsize=7)
        save(fig, "speedup_vs_concurrency")

    fig, ax = plt.subplots(figsize=(7, 4))
    rows = [("plain", report["baseline"][str(smallest)])] + [
        (c["name"], c["metrics"]) for c in report["cells"] if c["batch"] == smallest
    ]
    for offset, q in enumerate(("p50", "p95", "p99")):
        values = [(m["tpot_s"][q] or 0) * 1e3 for _, m in rows]
        ax.bar([i + 0.27 * offset for i in range(len(rows))], values, width=0.27, label=q)
    ax.set_xticks(
        [i + 0.27 for i in range(len(rows))],
        [n for n, _ in rows],
        rotation=45,
        ha="right",
        fontsize=7,
    )
    ax.set(ylabel="TPOT (ms)", title=f"Latency percentiles, {level} {smallest}")
    legend(ax)
    save(fig, "latency_percentiles")
    return paths


def write_report(report: dict, out_dir: str | Path) -> dict[str, str]:
    """Write report.json, report.md and the plots into `out_dir`; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summarize(report)
    report["plots"] = plot(report, out_dir)
    json_path, md_path = out_dir / "report.json", out_dir / "report.md"
    json_path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    md_path.write_text(markdown(report))
    return {"json": str(json_path), "markdown": str(md_path)}

"""Writing a benchmark's results: ``results.json``, ``results.md`` and ``pareto.png``."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from sglang_graft.engine.outputs import PROPOSAL_SOURCES


def write_results(results: dict[str, object], out_dir: str, plot: bool = True) -> list[str]:
    """Write ``results.json``, ``results.md`` and (``plot``) ``pareto.png`` into ``out_dir``
    (created if needed); returns their paths. Each file is written whole and then renamed
    into place, so a reader, or a run killed mid-write, never leaves a half-written one."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, name) for name in ("results.json", "results.md", "pareto.png")]
    _replace(paths[0], json.dumps(results, indent=2) + "\n")
    _replace(paths[1], markdown(results))
    if not plot:
        return paths[:2]
    pareto_plot(results, paths[2] + ".tmp.png")
    os.replace(paths[2] + ".tmp.png", paths[2])
    return paths


def _replace(path: str, text: str) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _sources(share: dict[str, float]) -> str:
    parts = [f"{k} {100 * share[k]:.0f}%" for k in PROPOSAL_SOURCES if share.get(k, 0.0) >= 0.005]
    return ", ".join(parts) or "-"


def _divergence_note(block: dict) -> str:
    divs = block["divergences"]
    if not divs:
        return "all identical"
    ties = sum(1 for d in divs if d["near_tie"])
    margins = ", ".join(f"{d['ar_top2_margin']:.3g}" if d["ar_top2_margin"] is not None else "n/a" for d in divs)
    return f"{len(divs)} differ ({ties} near-ties; margins {margins})"


def _interval(block: dict) -> str:
    span = block.get("speedup_interval")
    return "-" if span is None else f"{span[0]:.2f}-{span[1]:.2f}x"


def _decode(block: dict) -> str:
    speedup = block.get("decode_speedup_vs_ar")
    return "-" if speedup is None else f"{speedup:.2f}x"


def _modelled(block: dict) -> str:
    speedup = block.get("modelled_speedup")
    return "-" if speedup is None else f"{speedup:.3f}x"


def markdown(results: dict) -> str:
    """The overall table, then speedup per category, then divergences."""
    meta = results["meta"]
    pol = results["policies"]
    lines = [
        f"# Benchmark {meta['date']}",
        "",
        f"{meta['target']} ({meta['target_params'] / 1e9:.2f}B) + draft ({meta['draft_params'] / 1e9:.2f}B), "
        f"{meta['dtype']}, {meta['threads']} threads on {meta['device']}; {meta['max_new_tokens']} new tokens; "
        f"n={meta['num_nodes']}, draft depth {meta['draft_depth']}, topk {meta['draft_topk']}, "
        f"draft vocab {meta.get('draft_vocab') or 'full'}, draft window {meta.get('draft_window') or 'full'}, "
        f"gates {meta['gates']}; {_costs(meta)}; "
        f"near-tie bound {meta['tie_margin']} logits. Questions: `{os.path.basename(str(meta['questions']))}`.",
        "",
        *_partial(meta),
        "| policy | tau | draft fwd/round | verify tok/round | tokens/s | speedup vs ar | 90% interval | decode speedup | modelled speedup | identical to ar | accepted by source |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, p in pol.items():
        o = p["overall"]
        lines.append(
            f"| {name} | {o['tau']:.2f} | {o['draft_forwards_per_round']:.2f} | {o['verify_tokens_per_round']:.1f} | "
            f"{o['tokens_per_s']:.2f} | {o['speedup_vs_ar']:.2f}x | {_interval(o)} | {_decode(o)} | {_modelled(o)} | "
            f"{100 * o['identical_to_ar']:.0f}% | {_sources(o['accepted_share_by_source'])} |"
        )
    cats = list(next(iter(pol.values()))["categories"])
    lines += _category_table(
        pol, cats, "Speedup over `ar` (tau) per category:", lambda b: f"{b['speedup_vs_ar']:.2f}x ({b['tau']:.2f})"
    )
    if any(p["categories"][c].get("speedup_interval") is not None for p in pol.values() for c in cats):
        lines += _category_table(
            pol,
            cats,
            "90% intervals of the speedup over `ar` per category (paired bootstrap over the prompts: how much "
            "each number owes to which prompts were asked; where two methods' intervals overlap much, other "
            "prompts could order them otherwise):",
            _interval,
            with_ar=False,
        )
    if any(p["overall"].get("decode_speedup_vs_ar") is not None for p in pol.values()):
        lines += _category_table(
            pol,
            cats,
            "Decode speedup over `ar` per category (measured, the target's prefill excluded: what speculation "
            "changes; a draft model's prefill counts):",
            _decode,
        )
    if any(p["overall"].get("modelled_speedup") is not None for p in pol.values()):
        lines += _category_table(
            pol, cats, "Modelled speedup (decode time under the cost model, prefill excluded) per category:", _modelled
        )
    lines += ["", "Divergences from `ar` (first differing position, `ar`'s top-2 logit margin there):", ""]
    for name, p in pol.items():
        if name != "ar":
            lines.append(f"- {name}: {_divergence_note(p['overall'])}")
    if results.get("learned_costs"):
        lines += ["", "Costs learned online by the end of the run (the flags that would price rounds alike):", ""]
        lines += [f"- {name}: `{flags}`" for name, flags in results["learned_costs"].items()]
    return "\n".join(lines) + "\n"


def _category_table(
    pol: dict, cats: list[str], title: str, cell: Callable[[dict], str], with_ar: bool = True
) -> list[str]:
    """A titled table of one figure per policy (rows) and category (columns)."""
    lines = ["", title, "", "| policy | " + " | ".join(cats) + " |", "|---|" + "---|" * len(cats)]
    for name, p in pol.items():
        if with_ar or name != "ar":
            lines.append(f"| {name} | " + " | ".join(cell(p["categories"][c]) for c in cats) + " |")
    return lines


def _partial(meta: dict) -> list[str]:
    """A warning line for results written before the run finished every prompt."""
    if meta.get("complete", True):
        return []
    return [
        f"**Partial results**: {meta['prompts_done']} of {meta['prompts']} prompts, the ones every method "
        "finished before the run stopped (or so far, while it runs).",
        "",
    ]


def _costs(meta: dict) -> str:
    """The cost settings the run's trees were priced with, as a reader would pass them again."""
    curve = meta.get("verify_costs")
    if not curve:
        return "every round verifies all n"
    ratio = meta.get("draft_cost_ratio")
    return (
        f"verify costs `{','.join(f'{t}:{c:g}' for t, c in curve)}`, "
        f"draft cost ratio {'from the weights' if ratio is None else f'{ratio:g}'}, "
        f"read cost {meta.get('draft_read_cost'):g}" + (", learned online" if meta.get("online_costs") else "")
    )


def pareto_plot(results: dict, path: str) -> None:
    """Speedup over ``ar`` against tau: one marker per policy overall, small ones per category."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for i, (name, p) in enumerate(results["policies"].items()):
        color = f"C{i % 10}"
        cats = p["categories"].values()
        ax.scatter([c["tau"] for c in cats], [c["speedup_vs_ar"] for c in cats], s=12, alpha=0.35, color=color)
        o = p["overall"]
        ax.scatter([o["tau"]], [o["speedup_vs_ar"]], s=70, color=color, edgecolors="black", label=name)
        ax.annotate(name, (o["tau"], o["speedup_vs_ar"]), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("tau (tokens per target forward)")
    ax.set_ylabel("speedup over ar (tokens/s)")
    ax.set_title("Speed vs acceptance (large: overall, small: per category)")
    ax.legend(fontsize=8, loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

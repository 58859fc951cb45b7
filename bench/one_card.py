"""One 80 GB card: the table of ``bash bench/run_gpu.sh one-card`` from its gpu_bench outputs.

    python -m bench.one_card DIR [--json OUT]     # DIR/<size>/results.json, one per model size

For each size (``0.5b``, ``1.5b``, ``3b`` full fine-tune, ``7b-lora``), each run (ours async1,
TRL colocate beside it when it ran): trained samples/s, MFU, the card's measured peak (NVML, every
process on the GPU) against the memory plan's prediction of it, the learner's measured peak (the
allocator's reserved bytes, metric ``mem_peak_gb``) against the plan's learner figure, the OOM
retries, and ours / TRL. The plan's line says what it chose. Pure reading of results.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def rows(root: Path) -> list[dict[str, Any]]:
    """One row per run of every DIR/<size>/results.json, in the order the sizes ran."""
    out = []
    for res in sorted(root.glob("*/results.json"), key=lambda p: p.stat().st_mtime):
        data = json.loads(res.read_text())
        runs = data.get("results", [])
        card = next((r.get("card_gb") for r in runs if r.get("card_gb")), None)
        by = {r["name"]: r for r in runs}
        for r in runs:
            peak = max((r.get("gpu_mem_peak_gb") or {}).values(), default=None)
            other = by.get("trl-colocate") if r["name"] != "trl-colocate" else None
            ratio = (round(r["samples_per_s"] / other["samples_per_s"], 2)
                     if other and other.get("ok") and other.get("samples_per_s")
                     and r.get("samples_per_s") else None)
            out.append({"size": res.parent.name, "run": r["name"], "ok": r.get("ok"),
                        "samples_per_s": r.get("samples_per_s"), "mfu": r.get("mfu"),
                        "card_peak_gb": peak, "card_gb": card,
                        "card_peak_frac": round(peak / card, 3) if peak and card else None,
                        "plan_peak_gb": r.get("plan_peak_gb"),
                        "learner_peak_gb": r.get("learner_peak_gb"),
                        "plan_learner_gb": r.get("plan_learner_gb"),
                        "oom_retries": r.get("oom_retries", 0), "vs_trl": ratio,
                        "plan": r.get("plan", ""), "note": r.get("note", ""),
                        "device": data.get("device", "")})
    return out


def table(found: list[dict[str, Any]]) -> str:
    def f(v: Any, pct: bool = False) -> str:
        return "n/a" if v is None else (f"{100 * v:.1f}%" if pct else str(v))

    lines = ["| model | run | samples/s | MFU | card peak GB (of card) | plan's card peak GB | "
             "learner peak GB | plan's learner GB | OOM retries | ours / TRL | note |",
             "|" + "---|" * 11]
    for r in found:
        lines.append(
            f"| {r['size']} | {r['run']} | {f(r['samples_per_s'])} | {f(r['mfu'], True)} | "
            f"{f(r['card_peak_gb'])} ({f(r['card_peak_frac'], True)}) | {f(r['plan_peak_gb'])} | "
            f"{f(r['learner_peak_gb'])} | {f(r['plan_learner_gb'])} | {r['oom_retries']} | "
            f"{'' if r['vs_trl'] is None else str(r['vs_trl']) + 'x'} | "
            f"{'' if r['ok'] else 'FAILED '}{r['note'][:160]} |")
    plans = [f"- {r['size']}: {r['plan']}" for r in found if r["plan"]]
    device = next((r["device"] for r in found if r["device"]), "")
    return "\n".join([f"Device: {device}", "", *lines, "", "Plans:", *plans]) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    a = ap.parse_args(argv)
    found = rows(a.dir)
    print(table(found))
    if a.json:
        a.json.write_text(json.dumps(found, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

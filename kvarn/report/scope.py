"""What the report's ratios were measured against, in the words its tables, captions and figures use: the FP16 cell
of the same run (the default), the FP16 cell of another run (`cross-run`, asked for with `kvarn bench
--baseline-run`), or none (`unpaired`: no FP16 cell in the candidate's run, so no ratio). The labels themselves come
from kvarn.report.data.ratio_label."""
from __future__ import annotations

import math

from ..bench.ratios import CROSS_RUN, UNPAIRED

BYTES = "format bytes (no bench row)"


def is_cross(label) -> bool:
    return str(label or "").startswith(CROSS_RUN)


def _nan(v) -> bool:
    try:
        return math.isnan(float(v))
    except (TypeError, ValueError):
        return True


def ratio_text(v, label) -> str:
    """One ratio as shown: '2.41×', '0.83× (cross-run)', 'unpaired' where its cell has no FP16 cell to pair with."""
    if _nan(v):
        return UNPAIRED if label == UNPAIRED else "–"
    return f"{float(v):.2f}×" + (f" ({CROSS_RUN})" if is_cross(label) else "")


def ratios_sentence(labels) -> str:
    """The caption sentence on where the ratios of a table come from, true for the labels it shows."""
    labels = [str(x or "") for x in labels]
    if BYTES in labels and all(x in ("", BYTES) for x in labels):
        return "No bench rows: KV ÷ fp16 is what each format's bytes give the model's shape, not a measured ratio."
    text = ("Ratios are medians over valid repeats, each repeat against the fp16 row of the same setting measured in "
            "its own run (the newest row of each configuration and repeat)")
    if any(is_cross(x) for x in labels):
        text += ("; a ratio marked cross-run is against the FP16 cell of another run, the one “ratios vs” names "
                 "(asked for with kvarn bench --baseline-run)")
    if UNPAIRED in labels:
        text += "; an unpaired row has no FP16 cell in its own run, so no ratio"
    if BYTES in labels:
        text += "; a format without bench rows takes its KV ÷ fp16 from its bytes for the model's shape"
    return text + "."


def frontier_note(front) -> str:
    """What the frontier caption adds about its points' baselines (empty when every ratio is same-run)."""
    if front is None or front.empty or "ratio_vs" not in front:
        return ""
    parts = []
    if any(is_cross(x) for x in front["ratio_vs"]):
        parts.append("square markers labelled (cross-run) are ratios against another run's FP16 cell")
    unpaired = sorted(set(front.loc[front["ratio_vs"] == UNPAIRED, "kv_dtype"]))
    if unpaired:
        parts.append(f"unpaired cells (no FP16 cell in their run, so no ratio) are not plotted: {', '.join(unpaired)}")
    text = "; ".join(parts)
    return f" {text[0].upper()}{text[1:]}." if parts else ""

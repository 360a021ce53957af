"""Answer extraction and scoring, following lm-eval 0.4.13's rules for the same tasks so numbers compare with
published ones (re-implemented here from its documented behaviour):

* gsm8k: target = text after `#### `; "strict-match" takes the first `#### <number>` in the response,
  "flexible-extract" the last number-like span; both compared after dropping `,`, `$`, everything up to `#### `
  and a trailing `.`, case-insensitively. Unmatched responses become "[invalid]".
* aime24/aime25: candidate = text between the first and last `$` (if there are two), overridden by the content of
  the last `\\boxed{...}`; compared to the target after the MATH string normalisation (fracs, sqrt, units, ...).
* math500 (lm-eval `hendrycks_math500`): the same, without the `\\boxed{}` step (lm-eval reads only `$...$` there).
"""
from __future__ import annotations

import re

INVALID = "[invalid]"
GSM_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
GSM_FLEX = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
_GSM_IGNORE = [re.compile(p) for p in (r",", r"\$", r"(?s).*#### ", r"\.$")]


def strip_thinking(text: str, end_token: str = "</think>") -> str:
    """Reasoning models: score only what follows the last end-of-thinking marker."""
    return text.rsplit(end_token, 1)[-1] if end_token in text else text


# ---- gsm8k ----------------------------------------------------------------------------------------------------------
def gsm8k_target(answer: str) -> str:
    return answer.split("####")[-1].strip() if "####" in answer else answer.strip()


def _gsm_norm(s: str) -> str:
    for rx in _GSM_IGNORE:
        s = rx.sub("", s)
    return s.strip().lower()


def gsm8k_strict(response: str) -> str:
    m = GSM_STRICT.search(response)
    return m.group(1) if m else INVALID


def gsm8k_flexible(response: str) -> str:
    found = GSM_FLEX.findall(response)
    if not found:
        return INVALID
    last = found[-1]
    return next((g for g in last if g), INVALID)


def gsm8k_match(extracted: str, target: str) -> bool:
    return extracted != INVALID and _gsm_norm(extracted) == _gsm_norm(target)


# ---- MATH-style (aime, math500) --------------------------------------------------------------------------------------
def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (balanced braces) or `\\boxed x`; None when there is none."""
    if "\\boxed " in text:
        return text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    open_at = text.find("{", start)
    if open_at < 0:
        return None
    depth = 0
    for i in range(open_at, len(text)):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                # only a `\boxed{` directly followed by the brace counts
                head = text[start:open_at]
                return text[open_at + 1:i] if head == "\\boxed" else None
    return None


def dollar_span(text: str) -> str:
    pos = [i for i, c in enumerate(text) if c == "$"]
    return text[pos[0] + 1:pos[-1]] if len(pos) >= 2 else text


def math_candidate(response: str, boxed: bool = True) -> str:
    cand = dollar_span(response)
    if boxed:
        b = last_boxed(response)
        if b is not None:
            cand = b
    return cand


def _fix_fracs(s: str) -> str:
    parts = s.split("\\frac")
    out = parts[0]
    for p in parts[1:]:
        out += "\\frac"
        if not p or p[0] == "{":
            out += p
            continue
        if len(p) < 2:
            return s
        a, b, rest = p[0], p[1], p[2:]
        out += "{" + a + "}" + ("{" + b + "}" + rest if b != "{" else b + rest)
    return out


def _fix_slash(s: str) -> str:
    m = re.fullmatch(r"(-?\d+)/(-?\d+)", s)
    if m and s == f"{int(m.group(1))}/{int(m.group(2))}":
        return "\\frac{" + m.group(1) + "}{" + m.group(2) + "}"
    return s


def _fix_sqrt(s: str) -> str:
    if "\\sqrt" not in s:
        return s
    head, *rest = s.split("\\sqrt")
    out = head
    for r in rest:
        out += "\\sqrt" + (r if r.startswith("{") or not r else "{" + r[0] + "}" + r[1:])
    return out


def normalize_math(s: str) -> str:
    """MATH answer normalisation (Hendrycks et al.; as lm-eval's `strip_string`)."""
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac").replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
    if "\\text{ " in s:
        pieces = s.split("\\text{ ")
        if len(pieces) != 2:
            raise ValueError("ambiguous units")  # lm-eval then compares the raw strings
        s = pieces[0]
    s = s.replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        s = sides[1]
    s = _fix_sqrt(s).replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_slash(s)


def math_equal(candidate: str | None, target: str | None) -> bool:
    if candidate is None or target is None:
        return candidate is None and target is None
    try:
        return normalize_math(candidate) == normalize_math(str(target))
    except Exception:  # noqa: BLE001 - malformed LaTeX compares raw, as lm-eval does
        return candidate == str(target)


# ---- needle ----------------------------------------------------------------------------------------------------------
def first_number(text: str, digits: int | None = None) -> str:
    pat = rf"\d{{{digits}}}" if digits else r"\d+"
    m = re.search(rf"(?<!\d)({pat})(?!\d)", text)
    return m.group(1) if m else INVALID

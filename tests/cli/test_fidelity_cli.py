"""`kvarn fidelity`: synthetic run (fast, no model), JSON rows, results store, user errors."""
import json

import pytest

from kvarn.method.fidelity import run_fidelity, synthetic_kv
from kvarn.results import ResultsStore
from kvarn_cli.app import main
from tests.helpers import run_cli

pytest.importorskip("transformers")


def test_synthetic_json_and_store(tmp_path):
    r = run_cli("fidelity", "--context", "256", "--kv-dtype", "auto,fp8,turboquant_4bit_nc,kvarn_k4v2_g128,"
                "kvarn_k2v2_g128,kvarn_k4v2_g128-nobal", "--json", "--per-layer", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in r.stdout.splitlines() if x.strip()]
    by = {x["kv_dtype"]: x for x in rows}
    assert list(by) == ["auto", "fp8", "turboquant_4bit_nc", "kvarn_k4v2_g128", "kvarn_k2v2_g128",
                        "kvarn_k4v2_g128-nobal"]
    assert by["auto"]["k_rel_mse"] == 0 and by["auto"]["score_kl"] == 0
    assert by["kvarn_k4v2_g128"]["bytes_per_token_per_head"] == 108
    assert 0 < by["fp8"]["k_rel_mse"] < by["kvarn_k4v2_g128"]["k_rel_mse"] < by["kvarn_k2v2_g128"]["k_rel_mse"]
    assert by["kvarn_k4v2_g128"]["v_rel_mse"] > by["kvarn_k4v2_g128"]["k_rel_mse"]  # 2-bit values vs 4-bit keys
    assert "ppl" not in by["auto"]  # no model, no perplexity
    layers = by["turboquant_4bit_nc"]["layers"]
    assert len(layers) == 8 and [x["sixteen_bit"] for x in layers] == [True] * 2 + [False] * 4 + [True] * 2
    df = ResultsStore(tmp_path).read("fidelity")
    assert len(df) == 6 and set(df["status"]) == {"ok"} and df["config_hash"].nunique() == 6
    assert (df.set_index("kv_dtype").loc["fp8", "k_rel_mse"] - by["fp8"]["k_rel_mse"]) == pytest.approx(0)


def test_table_output(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["fidelity", "--context", "256", "--kv-dtype", "auto,kvarn_k4v2_g128"]) == 0
    o = capsys.readouterr().out
    assert "kvarn_k4v2_g128" in o and "K rel MSE" in o


@pytest.mark.parametrize("args,msg", [
    (("--kv-dtype", "int3"), "unknown codec"),
    (("--chunk", "0"), "--chunk"),
    (("--model", "/nonexistent/model"), "unknown model"),
    (("--sink", "-1"), "--sink"),
])
def test_user_errors_one_line_exit_2(args, msg, capsys):
    assert main(["fidelity", "--context", "256", *args]) == 2
    e = capsys.readouterr().err
    errs = [x for x in e.splitlines() if x.startswith("error:")]  # progress lines may precede it
    assert len(errs) == 1 and msg in errs[0] and "Traceback" not in e


def test_attention_metrics_order_on_synthetic():
    res, info = run_fidelity("synthetic", "auto,kvarn_k4v4_g128,kvarn_k2v2_g128", context=256)
    m = {r.kv_dtype: r.metrics for r in res}
    assert m["auto"]["out_rel_err"] == 0
    assert 0 < m["kvarn_k4v4_g128"]["score_kl"] < m["kvarn_k2v2_g128"]["score_kl"]
    assert 0 < m["kvarn_k4v4_g128"]["out_rel_err"] < m["kvarn_k2v2_g128"]["out_rel_err"]
    assert info["layers"] == 8 and info["context"] == 256
    lay = synthetic_kv(layers=1, t=200)[0]
    assert lay.q.shape[1] == len(lay.pos) and int(lay.pos.min()) >= 128 and int(lay.pos.max()) == 199


def test_text_loader(tmp_path):
    from kvarn.errors import KvarnError
    from kvarn.method.textdata import load_text

    t = load_text()
    assert t.startswith("CHAPTER 1. Loomings.") and 59_000 < len(t) <= 60_000
    f = tmp_path / "t.txt"
    f.write_text("hello", encoding="utf-8")
    assert load_text(f) == "hello"
    with pytest.raises(KvarnError):
        load_text(tmp_path / "missing.txt")


def test_a_model_that_overflows_in_float16_is_an_error_naming_the_layer(overflow_model):
    """Its config says float16 and layer 1 overflows there: no NaN perplexity with exit 0, but exit 1 and a line
    naming the forward and the module that went non-finite; --dtype float32 runs it."""
    model, text = overflow_model
    args = ["fidelity", "--model", str(model), "--text", str(text), "--start-char", "0", "--context", "256",
            "--kv-dtype", "auto,kvarn_k4v2_g128", "--json"]
    r = run_cli(*args)
    assert r.returncode == 1, r.stdout + r.stderr
    line = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and "non-finite logits" in line[0] and "model.layers.1.mlp" in line[0], r.stderr
    assert "float16" in line[0] and "--dtype" in line[0] and "Traceback" not in r.stderr
    assert r.stdout.strip() == ""  # no row printed
    r = run_cli(*args, "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in r.stdout.splitlines() if x.strip()]
    assert {x["dtype"] for x in rows} == {"float32"} and all(x["ppl"] > 0 for x in rows)


def test_chunked_eval_names_the_format_and_chunk():
    """A cache whose reads overflow: the error names that format and the chunk, not only the layer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvarn.finite import NonFiniteError
    from kvarn.method.codecs import parse_codecs
    from kvarn.method.fidelity import chunked_eval

    cfg = LlamaConfig(vocab_size=101, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg).eval()
    codecs = parse_codecs("auto,kvarn_k4v2_g128", ())
    layer = m.model.layers[1].self_attn.o_proj
    calls = {"n": 0}

    def poison(mod, args, out):  # the 4th forward: chunk 1's quantized-cache pass
        calls["n"] += 1
        return out * float("inf") if calls["n"] == 4 else out

    layer.register_forward_hook(poison)
    with pytest.raises(NonFiniteError) as e:
        chunked_eval(m, torch.randint(0, 101, (1, 256)), codecs, 128)
    msg = str(e.value)
    assert "kv dtype kvarn_k4v2_g128 in chunk 1 (tokens 128-255)" in msg and "model.layers.1.self_attn.o_proj" in msg


def test_bad_dtype_is_one_line_listing_the_accepted_values(capsys):
    assert main(["fidelity", "--context", "256", "--dtype", "float64"]) == 2
    e = capsys.readouterr().err
    assert e.strip().splitlines() == ["error: unknown --dtype 'float64'; accepted: auto, float16, bfloat16, float32 "
                                      "(auto: the model config's dtype)"]

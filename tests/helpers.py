"""Small test helpers shared by test modules."""
from __future__ import annotations

import contextlib
import fcntl

import os
import subprocess
import sys

import typer


def run_cli(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run `kvarn ARGS` in a subprocess (real exit codes, real stderr)."""
    e = dict(os.environ)
    e.setdefault("COLUMNS", "200")
    if env:
        e.update(env)
    return subprocess.run([sys.executable, "-m", "kvarn_cli.app", *args], capture_output=True, text=True,
                          env=e, timeout=timeout)


_cli_app = typer.Typer(add_completion=False)


@_cli_app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                    "help_option_names": []})
def _kvarn(ctx: typer.Context) -> None:
    """`kvarn ARGS` through the console entry point (one-line errors, exit 2), inside CliRunner's isolation."""
    from kvarn_cli.app import main

    raise typer.Exit(main(list(ctx.args)))


def cli(*args: str) -> tuple[int, str, str]:
    """Run `kvarn ARGS` in this process (faster than run_cli; monkeypatches apply): (exit code, stdout, stderr)."""
    from typer.testing import CliRunner

    r = CliRunner().invoke(_cli_app, list(args), env={"COLUMNS": "200"})
    return r.exit_code, r.stdout, r.stderr


# a tiny random Llama (SmolLM2's head dim 64, 2 heads so --tp 4 cannot divide them): the hf engine builds it with
# random weights and runs a bench cell in seconds (the tiny_llama fixture writes it to a folder)
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
              "intermediate_size": 256, "num_hidden_layers": 6, "num_attention_heads": 2, "num_key_value_heads": 1,
              "head_dim": 64, "vocab_size": 256, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": True, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}


# ---- the backend's kernel path against its torch path on the same steps (test_vllm_gpu, test_vllm_plugin_ops)

# Why the two paths agree to ATOL_KERNEL_PATH when the attention reads the same records (the kernel side's cache
# and tails, copied): the kernel side rounds to fp16 where the torch side keeps fp32, each a relative error of at
# most 2^-11 on a term of magnitude <= max|V| (about 4.5 for randn K/V at these sizes): the output itself, the
# p * sV operand of the value MMAs, and the 16-bit K/V the dense path materializes (the values directly, the keys
# through the softmax weights, twice the score error at most). 4 x 2^-11 x 4.5 = 8.8e-3; the keys' q * sK operand
# is split hi + lo (~2^-22) and the tail's dots multiply 16-bit operands exactly. The codes themselves are not
# compared through the outputs: a value on a rounding boundary may round the other way in the kernel's fp32
# order (one step of a 2-bit value, 1.5 sigma), so the records are checked on their own (>= 99.5% equal bytes).
ATOL_KERNEL_PATH = 1e-2
RTOL_KERNEL_PATH = 2.0 ** -10


def kernel_path_vs_torch_path(name: str, kernel_device: str, use_kernels: bool | None = None):
    """Two requests through prefill, a continuation chunk that completes a tile, mixed and decode steps, on
    `kernel_device` in fp16 (use_kernels: force the kernels, e.g. through the interpreter on a CPU) and through the
    torch path on the CPU in fp32 over a copy of the kernel side's cache. Yields (step, kernel out, torch out) and
    finally (None, kernel state, torch state)."""
    import numpy as np
    import torch

    from kvarn.formats import get_format
    from kvarn.vllm_plugin import ops, step_plan

    fmt = get_format(name)
    D, HK, HQ, g = 64, 3, 9, fmt.group
    gen = torch.Generator().manual_seed(0)
    # both sides see the same fp16-rounded inputs
    base = {rid: {x: torch.randn(3 * g, h, D, generator=gen).half().float()
                  for x, h in (("q", HQ), ("k", HK), ("v", HK))} for rid in ("a", "b")}
    states = {}
    for dev, dt in ((kernel_device, torch.float16), ("cpu", torch.float32)):
        states[dev, dt] = {"done": {"a": 0, "b": 0}, "slot": {"a": 0, "b": 1},
                           "blocks": {"a": torch.tensor([1, 2, 3], dtype=torch.int32),
                                      "b": torch.tensor([4, 5, 6], dtype=torch.int32)},
                           "cache": torch.zeros(8, HK, fmt.record_bytes(D), dtype=torch.uint8, device=dev),
                           "tk": torch.zeros(3, HK, g, D, dtype=dt, device=dev),
                           "tv": torch.zeros(3, HK, g, D, dtype=dt, device=dev)}
    steps = [[("a", g // 2)], [("a", g), ("b", g + 5)], [("a", 1), ("b", 7)], [("a", 1), ("b", 1)]]
    kern_key, ref_key = (kernel_device, torch.float16), ("cpu", torch.float32)
    for sched in steps:
        outs = []
        for key in (kern_key, ref_key):
            dev, dt = key
            st = states[key]
            qsl, seq, rows, qs, ks, vs = [0], [], [], [], [], []
            for rid, n in sched:
                a = st["done"][rid]
                for lst, x in ((qs, "q"), (ks, "k"), (vs, "v")):
                    lst.append(base[rid][x][a:a + n])
                st["done"][rid] = a + n
                seq.append(a + n); qsl.append(qsl[-1] + n); rows.append(st["slot"][rid])
            bt = torch.stack([st["blocks"][rid] for rid, _ in sched]).to(dev)
            q, k, v = (torch.cat(x).to(dev, dt) for x in (qs, ks, vs))
            plan = step_plan.plan_step(np.array(qsl), np.array(seq), len(seq), np.array(rows, dtype=np.int32), bt, g,
                                       dev)
            kw = {} if key == ref_key else {"use_kernels": use_kernels}
            ops.store(plan, k, v, st["cache"], st["tk"], st["tv"], fmt, **kw)
            if key == ref_key:  # attend over the kernel side's records (see ATOL_KERNEL_PATH)
                kern = states[kern_key]
                cache, tk, tv = kern["cache"].cpu(), kern["tk"].cpu().float(), kern["tv"].cpu().float()
            else:
                cache, tk, tv = st["cache"], st["tk"], st["tv"]
            out = torch.zeros_like(q)
            ops.attention(plan, q, k, v, out, cache, bt, torch.tensor(seq, dtype=torch.int32, device=dev), tk, tv,
                          fmt, D ** -0.5, **kw)
            outs.append(out.float().cpu())
        yield sched, outs[0], outs[1]
    yield None, states[kern_key], states[ref_key]


# ---- a worker whose own child escapes its process group and ignores SIGTERM (as a vLLM engine core can)

# Python source defining stubborn_family(pidfile): starts a grandchild in a session of its own that ignores SIGTERM,
# writes "<own pid> <grandchild pid>" to pidfile once the grandchild's handler is set, then sleeps past any timeout.
# Exec it in a fake worker (a `python -c` script, a fake package's module) and call stubborn_family.
STUBBORN_FAMILY = '''
import os, subprocess, sys, time

def stubborn_family(pidfile, sleep_s=120):
    g = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          "print('ready', flush=True); time.sleep(%d)" % sleep_s],
                         start_new_session=True, stdout=subprocess.PIPE, text=True)
    g.stdout.readline()
    with open(pidfile, "w") as f:
        f.write(f"{os.getpid()} {g.pid}")
    time.sleep(sleep_s)
'''


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_gone(pids, timeout_s: float = 5.0) -> list[int]:
    """Wait up to timeout_s for every pid to be gone (an orphan's reaping takes a moment); the ones still alive."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def kill_quietly(pids) -> None:
    """SIGKILL what a failed test left running."""
    import signal

    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@contextlib.contextmanager
def one_engine_at_a_time():
    """Held while a test's vLLM engine starts and runs: the GPU suite runs test processes side by side, and vLLM sizes
    its KV pool from the memory it sees grow while it profiles, so another engine starting at that moment takes the
    pool away ("No available memory for the cache blocks"). A lock file serializes engines across processes."""
    with open(os.path.join(os.environ.get("TMPDIR", "/tmp"), "kvarn-test-engine.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)

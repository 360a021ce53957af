"""The backend's store/attention plumbing on CPU (no vLLM): a simulated engine drives requests through chunked
prefill, mixed batches, decode, a preemption and resume, with padded rows; every step is checked against an oracle
built from the true K/V and the reference quantizer."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvarn.formats import get_format
from kvarn.method.reference import dequantize_tiles, quantize_tiles, reference_attention
from kvarn.method import paged
from kvarn.vllm_plugin import dense_prefill, ops, step_plan
from kvarn.vllm_plugin.tails import PendingFlush, SlotTable, StepSlots, TailBuffers, tail_bytes

FMT = get_format("kvarn_k4v2_g64")  # g = 64 keeps the CPU reference fast
G, D, HK, HQ = FMT.group, 64, 2, 4
SCALE = D ** -0.5


class Req:
    def __init__(self, rid, total, gen):
        self.rid = rid
        self.k = torch.randn(total, HK, D, generator=gen)
        self.v = torch.randn(total, HK, D, generator=gen)
        self.q = torch.randn(total, HQ, D, generator=gen)
        self.done = 0  # tokens in the cache
        self.blocks: list[int] = []
        self.own_sink = True  # False: started on a prefix hit, its slot's sink rows hold no tokens of its own


class Engine:
    def __init__(self, num_blocks=64, slots=4, seed=0, sink=0):
        self.cache = torch.zeros(num_blocks, HK, FMT.record_bytes(D), dtype=torch.uint8)
        self.tails = TailBuffers()
        self.window = FMT.window_tokens if sink else 0  # the window is kept only with a sink
        self.tails.allocate(["l0"], slots, HK, G, D, torch.float32, "cpu", sink=sink, window=self.window)
        self.tk, self.tv = self.tails.get("l0")
        self.sink = sink
        self.tags = torch.full((slots + 1,), -1, dtype=torch.int32)  # the builder's sink ownership tags
        self.sink_buf = torch.zeros(32, dtype=torch.int32)
        self.win_tags = torch.full((slots + 1, 2), -1, dtype=torch.int32)  # the builder's window tags
        self.win_buf = torch.zeros(32, dtype=torch.int32)
        self.win_model: dict[tuple[int, int], int] = {}  # (slot, half) -> block: the test's own model of them
        self.table = SlotTable(slots)
        self.tails.register_cache("l0", self.cache)  # as the backend's forward does (the deferred flush reads it)
        self.pending = PendingFlush(32, "cpu")
        self.free = list(range(1, num_blocks))  # block 0 = vLLM's null block
        np.random.default_rng(seed).shuffle(self.free)
        self.slots = slots

    def step(self, sched: list[tuple[Req, int]], pad_rows: int = 0, fast: bool = False, defer: bool = False):
        """sched: (request, number of new tokens), decodes first like vLLM's reorder. Returns per-token outputs.
        fast: a decode-only step goes through ops.decode_step with the Triton kernels (interpreter on CPU).
        defer: as the builder with KVARN_DEFER_FLUSH=1: the tiles the last step left pending are flushed first
        (every layer, one launch), and a fast step leaves the tiles it completes in the tail."""
        self.pending.flush(self.tails.layer_buffers(["l0"]), FMT)
        qsl, seq, qs, ks, vs, rows = [0], [], [], [], [], []
        for r, n in sched:
            need = -(-(r.done + n) // G)
            while len(r.blocks) < need:
                r.blocks.append(self.free.pop())
            qs.append(r.q[r.done:r.done + n]); ks.append(r.k[r.done:r.done + n]); vs.append(r.v[r.done:r.done + n])
            seq.append(r.done + n)
            qsl.append(qsl[-1] + n)
            rows.append(self.table.slot(r.rid))
        for _ in range(pad_rows):  # CUDA-graph style padding rows: no tokens, scratch slot
            qsl.append(qsl[-1]); seq.append(0); rows.append(self.slots)
        R = len(seq)
        width = max([len(r.blocks) for r, _ in sched] + [1])
        bt = torch.zeros(R, width, dtype=torch.int32)
        for i, (r, _) in enumerate(sched):
            bt[i, :len(r.blocks)] = torch.tensor(r.blocks, dtype=torch.int32)
        q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
        pad = 3  # padded token rows at the end, as vLLM pads num_tokens
        q = torch.cat([q, torch.zeros(pad, HQ, D)]); k = torch.cat([k, torch.zeros(pad, HK, D)])
        v = torch.cat([v, torch.zeros(pad, HK, D)])
        # a fast step gets the minimal plan the builder makes when the decode kernels are there (host fields only)
        plan = step_plan.plan_step(np.array(qsl), np.array(seq), R, np.array(rows, dtype=np.int32), bt, G, "cpu",
                                   decode_minimal=fast, sink=self.sink, window=self.window)
        step_plan.update_sink_lens(plan, self.tags, bt, self.sink_buf)
        step_plan.update_window_lens(plan, self.win_tags, bt, self.win_buf)
        for (r, n), slot in zip(sched, rows):  # a row that writes a tile's last W tokens: that half holds the tile
            c, s = r.done, r.done + n
            for t in ((s - 1) // G - 1, (s - 1) // G):
                if self.window and t >= 0 and min(s, t * G + G) > max(c, t * G + G - self.window):
                    blk = r.blocks[t]
                    self.win_model = {k: b for k, b in self.win_model.items() if b != blk}
                    self.win_model[(slot, t % 2)] = blk
        if defer and fast:
            plan.defer = self.pending.set_flag(1)  # the device flag, as the builder passes it
            self.pending.note(np.array(seq), np.array(rows, dtype=np.int32), bt, G)
        out = torch.full_like(q, float("nan"))
        seq_t = torch.tensor(seq, dtype=torch.int32)
        if fast:
            assert plan.decode_only and plan.minimal and plan.tail_slots is None, "a fast step must be decode-only"
            ops.decode_step(plan, q, k, v, out, self.cache, bt, seq_t, torch.tensor(rows, dtype=torch.int32),
                            self.tk, self.tv, FMT, SCALE, use_kernels=True)
        else:
            ops.store(plan, k, v, self.cache, self.tk, self.tv, FMT)
            ops.attention(plan, q, k, v, out, self.cache, bt, seq_t, self.tk, self.tv, FMT, SCALE)
        starts = [r.done for r, _ in sched]
        for r, n in sched:
            r.done += n
        deferred = plan.defer is not False
        self.check_state(sched, exact=not fast, deferred=deferred)
        self.check_out(sched, starts, out, qsl, atol=2e-3 if fast else 2e-5, deferred=deferred)
        n_out = R if fast else qsl[-1]  # the decode kernel writes zeros for padded rows (graph padding)
        if fast:
            assert (out[qsl[-1]:n_out] == 0).all()
        assert torch.isnan(out[n_out:]).all(), "rows past the batch must stay untouched"
        return out

    def check_state(self, sched, exact=True, deferred=False):
        for r, _ in sched:
            # a tile a deferred step completed is still in the tail (its record comes with the next step's flush)
            full = (r.done - 1) // G if deferred and r.done else r.done // G
            if full:
                want = quantize_tiles(r.k[:full * G].view(full, G, HK, D).transpose(1, 2),
                                      r.v[:full * G].view(full, G, HK, D).transpose(1, 2), FMT)
                got = self.cache[torch.tensor(r.blocks[:full])]
                if exact:
                    assert torch.equal(got, want), f"{r.rid}: records differ"
                else:  # the kernel's fp32 order may move a value on a rounding boundary by one code
                    (gk, gv), (wk, wv) = dequantize_tiles(got, FMT, D), dequantize_tiles(want, FMT, D)
                    for a_, b_ in ((gk, wk), (gv, wv)):
                        assert ((a_ - b_).norm() / b_.norm()).item() < 5e-3, f"{r.rid}: records differ"
            rem = r.done - full * G
            if rem:
                s = self.table.slot(r.rid)
                assert torch.equal(self.tk[s, :, :rem], r.k[full * G:r.done].transpose(0, 1))
                assert torch.equal(self.tv[s, :, :rem], r.v[full * G:r.done].transpose(0, 1))
            n = min(self.sink, r.done)
            if n and r.own_sink:  # the first tokens, 16-bit for good
                s = self.table.slot(r.rid)
                assert torch.equal(self.tk[s, :, G:G + n], r.k[:n].transpose(0, 1))
                assert torch.equal(self.tv[s, :, G:G + n], r.v[:n].transpose(0, 1))
            W = self.window
            if W and self.window_ok(r, r.done):  # the window half of the tile before the newest position's
                wt, s = (r.done - 1) // G - 1, self.table.slot(r.rid)
                row, pos = G + self.sink + (wt % 2) * W, wt * G + G - W
                assert torch.equal(self.tk[s, :, row:row + W], r.k[pos:pos + W].transpose(0, 1))
                assert torch.equal(self.tv[s, :, row:row + W], r.v[pos:pos + W].transpose(0, 1))

    def window_ok(self, r, s):
        """Whether the request's slot holds the window of its tile before the newest position's (the test's model)."""
        wt = (s - 1) // G - 1
        return s > G and self.win_model.get((self.table.slot(r.rid), wt % 2)) == r.blocks[wt]

    def check_out(self, sched, starts, out, qsl, atol=2e-5, deferred=False):
        for i, ((r, n), c) in enumerate(zip(sched, starts)):
            s = c + n
            if c == 0:  # first chunk: raw attention
                k, v = r.k[:s], r.v[:s]
            else:  # post-store state: dequantized full tiles + raw tail (a chunk's own tokens raw, below)
                full = (s - 1) // G if deferred else s // G  # deferred: a tile completed now is read raw
                kk, vv = [], []
                if full:
                    dk, dv = dequantize_tiles(self.cache[torch.tensor(r.blocks[:full])], FMT, D)
                    kk.append(dk.transpose(1, 2).reshape(-1, HK, D)); vv.append(dv.transpose(1, 2).reshape(-1, HK, D))
                kk.append(r.k[full * G:s]); vv.append(r.v[full * G:s])
                k, v = torch.cat(kk), torch.cat(vv)
                if full and self.sink and r.own_sink:  # the sink's positions raw
                    k[:self.sink], v[:self.sink] = r.k[:self.sink], r.v[:self.sink]
                W = self.window
                if W and self.window_ok(r, s):  # the window: the tile before the newest position's, last W raw
                    a = ((s - 1) // G - 1) * G + G - W
                    k[a:a + W], v[a:a + W] = r.k[a:a + W], r.v[a:a + W]
                if n > 1:  # a continuation chunk reads its own tokens raw
                    k, v = torch.cat([k[:c], r.k[c:s]]), torch.cat([v[:c], r.v[c:s]])
            want = reference_attention(r.q[c:s].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), SCALE,
                                       causal_offset=c).transpose(0, 1)
            got = out[qsl[i]:qsl[i + 1]]
            torch.testing.assert_close(got, want, atol=atol, rtol=1e-4 if atol < 1e-4 else 1e-3)


@pytest.fixture
def small_key_budget(monkeypatch):
    """Continuation chunks in several row groups per step (the dense path's transient-buffer bound)."""
    monkeypatch.setattr(dense_prefill, "DENSE_KEY_BUDGET", 150)


def test_dense_groups():
    assert list(dense_prefill._groups(np.array([100, 60, 40, 300, 10]), 150)) == [(0, 1), (1, 3), (3, 4), (4, 5)]
    assert list(dense_prefill._groups(np.array([5, 5]), 150)) == [(0, 2)] and list(dense_prefill._groups(np.array([]), 10)) == []


@pytest.mark.parametrize("sink", [0, 16])
def test_chunked_prefill_decode_mixed_and_preemption(small_key_budget, sink):
    gen = torch.Generator().manual_seed(0)
    eng = Engine(sink=sink)
    a, b, c = Req("a", 200, gen), Req("b", 150, gen), Req("c", 140, gen)
    eng.step([(a, 50)])  # first chunk, raw
    eng.step([(a, 100), (b, 70)])  # continuation completing a tile that spans chunks + a new request
    eng.step([(a, 1), (b, 60)], pad_rows=2)  # decode + continuation (b: completes tile 1 from tail + new)
    for _ in range(3):
        eng.step([(a, 1), (b, 1)])
    # preempt b: its blocks and slot are freed; on resume it is recomputed from the start
    eng.table.release(["b"])
    eng.free.extend(b.blocks); b.blocks, b.done = [], 0
    eng.step([(a, 1), (c, 64)])  # c's first chunk is exactly one tile
    eng.step([(a, 1), (b, 134), (c, 10)])  # b resumes (raw first chunk again), c continues
    eng.step([(a, 1), (b, 1), (c, 1)])
    eng.step([(a, 5), (b, 3), (c, 4)])  # three continuation rows in one step (dense: several row groups)
    assert len(eng.table) == 3
    eng.table.release(["c"])  # c is done
    eng.free.extend(c.blocks)
    d, e = Req("d", 60, gen), Req("e", 90, gen)
    # first chunks around a decode and a continuation row (not in vLLM's order): one raw attention over rows 0..3,
    # whose decode and continuation outputs the later paths overwrite, and decode rows gathered, not sliced
    eng.step([(d, 20), (a, 1), (b, 4), (e, 40)], pad_rows=1)
    eng.step([(a, 1), (b, 1), (d, 1), (e, 50)])  # decode rows leading the batch (sliced), one continuation range


@pytest.mark.parametrize("sink", [0, 16])
def test_decode_fast_path_matches_general_path(monkeypatch, sink):
    """ops.decode_step (store_decode + the decode kernel, as a full CUDA graph runs them) on decode-only steps:
    tail writes, a tile completing from the tail, a first-token row (ctx 0), graph padding rows (seq_len 0)."""
    gen = torch.Generator().manual_seed(3)
    eng = Engine(sink=sink)
    a, b, c = Req("a", 140, gen), Req("b", 90, gen), Req("c", 3, gen)
    eng.step([(a, G - 2)])
    eng.step([(b, 70)])

    def no_fallback(*a, **k):
        raise AssertionError("decode_step fell back to the general path")

    monkeypatch.setattr(ops, "store", no_fallback)
    monkeypatch.setattr(ops, "attention", no_fallback)
    eng.step([(a, 1), (b, 1), (c, 1)], pad_rows=2, fast=True)  # c: one-token prompt, no context
    eng.step([(a, 1), (b, 1), (c, 1)], fast=True)  # a completes tile 0 from 63 tail tokens + the new one
    eng.step([(a, 1), (b, 1), (c, 1)], pad_rows=1, fast=True)  # a: first token of tile 1


@pytest.mark.parametrize("sink", [0, 16])
def test_deferred_flush_decode_steps(monkeypatch, sink):
    """KVARN_DEFER_FLUSH's decode steps: a tile completed at a step is read from the tail by that step's attention
    (check_out: the reference reads it raw), its record is written by the next step's flush (flush_layers, before
    that step's new token lands in tail row 0), a request that finished right after completing a tile is flushed
    too, and once flushed the cache and tails are bit for bit those of the immediate path (store_decode)."""

    def no_fallback(*a, **k):
        raise AssertionError("decode_step fell back to the general path")

    engines = {}
    for defer in (False, True):
        gen = torch.Generator().manual_seed(5)
        eng = Engine(sink=sink)
        a, b, c = Req("a", 140, gen), Req("b", 200, gen), Req("c", 70, gen)
        eng.step([(a, G - 2)])
        eng.step([(b, 2 * G - 1)])
        eng.step([(c, G - 1)])
        # records are compared between the two paths below (the kernel's rounding vs the reference's is
        # test_decode_fast_path_matches_general_path's)
        eng.check_state = lambda *x, **k: None
        with monkeypatch.context() as m:
            m.setattr(ops, "store", no_fallback)
            m.setattr(ops, "attention", no_fallback)
            eng.step([(a, 1), (b, 1), (c, 1)], pad_rows=1, fast=True, defer=defer)  # b and c complete a tile
            if defer:
                assert eng.pending.n == 2 and torch.count_nonzero(eng.cache[c.blocks[0]]) == 0  # not written yet
            eng.step([(a, 1), (b, 1)], fast=True, defer=defer)  # c finished: its tile is flushed all the same
            eng.step([(a, 1), (b, 1)], pad_rows=2, fast=True, defer=defer)  # a's tile 0 (done last step) flushed
        engines[defer] = eng
    assert engines[True].pending.n == 0
    for x, y in ((engines[False].cache, engines[True].cache), (engines[False].tk, engines[True].tk),
                 (engines[False].tv, engines[True].tv)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("sink", [0, 16])
def test_prefix_hit_starts_on_a_tile_boundary(small_key_budget, sink):
    gen = torch.Generator().manual_seed(1)
    eng = Engine(sink=sink)
    a = Req("a", 180, gen)
    eng.step([(a, 130)])
    # a second request sharing a's first two tiles: vLLM gives it a's blocks and num_computed = 128
    b = Req("b", 180, gen)
    b.k[:128], b.v[:128], b.blocks, b.done = a.k[:128], a.v[:128], list(a.blocks[:2]), 128
    b.own_sink = False  # its slot's sink rows never saw its tokens: it reads the records there
    eng.step([(b, 42)])  # prefix-hit continuation: attends over the shared quantized tiles + its own new tokens
    eng.step([(a, 1), (b, 1)])
    if sink:
        assert eng.sink_buf[:2].tolist() == [sink, 0]
    # a finishes; c hits the same cached first blocks and gets a's slot, whose sink rows hold the same tokens
    eng.table.release(["a"])
    c = Req("c", 150, gen)
    c.k[:128], c.v[:128], c.blocks, c.done = a.k[:128], a.v[:128], list(a.blocks[:2]), 128
    eng.step([(c, 1)])  # a fully cached prompt: vLLM recomputes only its last token
    if sink:
        assert eng.table.slot("c") == 0 and eng.sink_buf[0].item() == sink


def test_dense_prefill_calls_varlen_like_flash_attention(monkeypatch):
    """The dense path hands FlashAttention-style arguments (cu_seqlens_q / _k as int32 device tensors, bottom-right
    causal) to the varlen function, with the rows of the step's output to write in place (`out`); a fake with FA's
    semantics must reproduce the reference."""
    calls = []

    def fake_fa(q, k, v, cu, max_len, cu_k=None, max_k=None, out=None):
        if cu_k is None:  # the raw first-chunk path: keys = queries
            cu_k, max_k = cu, max_len
        assert cu.dtype == torch.int32 and cu_k.dtype == torch.int32
        assert max_len == int((cu[1:] - cu[:-1]).max()) and max_k == int((cu_k[1:] - cu_k[:-1]).max())
        calls.append((cu.tolist(), cu_k.tolist()))
        o = paged.varlen_attention_torch(q, k, v, cu.tolist(), cu_k.tolist(), SCALE).to(q.dtype)
        assert out is not None and out.shape == o.shape  # as FlashAttention's out=: no copy of the rows afterwards
        views.append(out.data_ptr())
        return out.copy_(o)

    gen = torch.Generator().manual_seed(5)
    eng = Engine()
    a, b = Req("a", 200, gen), Req("b", 150, gen)
    eng.step([(a, 70)])
    real_attention = ops.attention
    views, outs = [], []

    def attention(*x, **kw):
        outs.append(x[4])  # the step's output buffer
        return real_attention(*x, **{**kw, "raw_varlen": fake_fa})

    monkeypatch.setattr(ops, "attention", attention)
    eng.step([(a, 90), (b, 30)])  # a continues over a completed quantized tile + its tail; b is a first chunk
    assert calls == [([0, 30], [0, 30]), ([0, 90], [0, 160])]  # b raw; a over its 160 post-store tokens
    # both wrote their rows of the step's output in place: b's tokens 90..120, then a's 0..90
    assert views == [outs[0][90:].data_ptr(), outs[0].data_ptr()]


def test_dense_index_is_built_once_per_step_and_read_by_every_layer(monkeypatch, small_key_budget):
    """A step's first layer builds the continuation rows' groups and indexes and keeps them on the plan; a later
    layer (other queries, another cache and tails) reads through them and gets what a fresh plan gives it."""
    gen = torch.Generator().manual_seed(11)
    eng = Engine(sink=16)
    a, b = Req("a", 200, gen), Req("b", 150, gen)
    eng.step([(a, 100), (b, 70)])
    builds = []
    real_index = dense_prefill.post_store_index
    monkeypatch.setattr(dense_prefill, "post_store_index", lambda *x, **kw: builds.append(1) or real_index(*x, **kw))
    real_attention = ops.attention
    layers = []

    def two_layers(plan, q, k, v, out, cache, bt, seq_t, tk, tv, fmt, scale, **kw):
        real_attention(plan, q, k, v, out, cache, bt, seq_t, tk, tv, fmt, scale, **kw)
        kept = dict(plan.prepared)
        assert kept and len(builds) == 2  # a's 160 keys, then b's 120: two groups of <= 150
        q2, cache2, tk2, tv2 = torch.randn(q.shape, generator=gen), cache.flip(0), tk * 0.5, tv + 1.0
        outs = []
        for p in (plan, dataclasses.replace(plan, prepared={})):
            o = torch.full_like(out, float("nan"))
            real_attention(p, q2, k, v, o, cache2, bt, seq_t, tk2, tv2, fmt, scale, **kw)
            outs.append(o)
        assert plan.prepared == kept and len(builds) == 4  # the kept plan built nothing; the fresh one its own
        n = int(plan.qsl[-1])
        assert torch.equal(outs[0][:n], outs[1][:n]) and not torch.allclose(outs[0][:n], out[:n])
        layers.append(n)

    monkeypatch.setattr(ops, "attention", two_layers)
    eng.step([(a, 60), (b, 50)])  # two continuation rows (a completes tile 1 from its tail and new tokens)
    assert layers == [110]


def test_minimal_plan_only_for_decode_steps_and_only_with_kernels():
    bt = torch.zeros(3, 4, dtype=torch.int32)
    slots = np.array([0, 1, 2], dtype=np.int32)
    dec = step_plan.plan_step(np.array([0, 1, 2, 2]), np.array([5, 9, 0]), 3, slots, bt, G, "cpu", decode_minimal=True)
    assert dec.minimal and dec.decode_only and dec.num_tiles == 0 and dec.dec_rows.tolist() == [0, 1]
    mixed = step_plan.plan_step(np.array([0, 1, 4]), np.array([5, 9]), 2, slots, bt, G, "cpu", decode_minimal=True)
    assert not mixed.minimal and not mixed.decode_only and mixed.tail_slots is not None
    q = torch.zeros(3, HQ, D)
    with pytest.raises(RuntimeError, match="needs the decode kernels"):
        ops.decode_step(dec, q, q[:, :HK], q[:, :HK], q.clone(), torch.zeros(4, HK, FMT.record_bytes(D),
                        dtype=torch.uint8), bt, torch.tensor([5, 9, 0]), torch.tensor(slots), torch.zeros(4, HK, G, D),
                        torch.zeros(4, HK, G, D), FMT, SCALE, use_kernels=False)


def test_plan_counts_and_tail_positions():
    bt = torch.arange(40, dtype=torch.int32).view(2, 20)
    plan = step_plan.plan_step(np.array([0, 1, 201]), np.array([64, 300]), 2, np.array([3, 1], dtype=np.int32), bt, 64,
                          "cpu")
    # row 0: decode of position 63 completes tile 0 (63 tail tokens + 1 new); row 1: ctx 100 -> tiles 1..3 complete
    assert plan.num_tiles == 1 + 3
    assert plan.tile_block_ids.tolist() == [0, 21, 22, 23]
    # tile 0 of row 0: 63 positions from slot 3's tail, the last is new token 0; row 1's tile 1: 100 - 64 from
    # slot 1's tail, then new tokens 1.. (position 0 would be token 1 - 36); tiles 2, 3 whole from new tokens
    assert plan.tile_old.tolist() == [63, 100 - 64, 0, 0] and plan.tile_slot.tolist() == [3, 1, 1, 1]
    assert plan.tile_first.tolist() == [-63, 1 - 36, 1 + 128 - 100, 1 + 192 - 100]
    assert plan.tail_tok.tolist() == list(range(1 + (256 - 100), 201))  # row 1 positions 256..299 -> tail
    assert set(plan.tail_pos.tolist()) == set(range(0, 44))
    assert plan.dec_rows.tolist() == [0] and plan.cont_rows.tolist() == [1] and len(plan.raw_rows) == 0


def test_slot_table_and_step_slots():
    t = SlotTable(2)
    assert t.rows(["x", "y"]).tolist() == [0, 1]
    with pytest.raises(Exception, match="tail slots"):
        t.slot("z")
    t.release(["x"])
    assert t.slot("z") == 0
    t.retain_only(["z"])
    assert len(t) == 1 and t.slot("y") == 1
    st = StepSlots()
    st.set_rows([5, 6], "mrv2")
    assert st.rows_for(4, scratch=9).tolist() == [5, 6, 9, 9]
    st.set_dummy()
    assert st.rows_for(2, scratch=9).tolist() == [9, 9]
    assert tail_bytes(255, 8, 128, 128, 2) == 2 * 256 * 8 * 128 * 128 * 2


@pytest.mark.parametrize("sink", [0, 16])
def test_materialize_dense_kernel_equals_reference_decoder(sink):
    """The dense path's K/V through the Triton decoder and tail-row copy (interpreter here) equal the reference
    decoder's and torch indexing's; with a sink and window, one row may read its sink and window rows and the other
    may not (its slot holds another request's: the records' values stay)."""
    gen = torch.Generator().manual_seed(7)
    eng = Engine(sink=sink)
    a, b = Req("a", 200, gen), Req("b", 150, gen)
    eng.step([(a, 150), (b, 70)])
    rows = np.array([0, 1])
    seq = np.array([150, 70])
    slots = np.array([eng.table.slot("a"), eng.table.slot("b")])
    bt = torch.zeros(2, 3, dtype=torch.int32)
    bt[0, :len(a.blocks)] = torch.tensor(a.blocks, dtype=torch.int32)
    bt[1, :len(b.blocks)] = torch.tensor(b.blocks, dtype=torch.int32)
    lens = {}
    if sink:
        lens = {"sink_lens": torch.tensor([sink, 0], dtype=torch.int32),
                "win_lens": torch.tensor([0, FMT.window_tokens], dtype=torch.int32)}
    args = (rows, seq, slots, eng.cache, bt, eng.tk, eng.tv, FMT, torch.float32)
    ref = dense_prefill.materialize_dense(*args, use_kernels=False, **lens)
    got = dense_prefill.materialize_dense(*args, use_kernels=True, **lens)
    assert ref[2].tolist() == got[2].tolist() == [0, 150, 220]
    for x, y in zip(got[:2], ref[:2]):
        assert ((x - y).norm() / y.norm()).item() < 1e-5
    if sink:  # the rows that come from the tail buffers are copies: exact
        ix = paged.post_store_index(rows, seq, slots, bt, eng.tk.shape[2], FMT, lens["sink_lens"], lens["win_lens"])
        from_tail = ix.row_dst[ix.row_use.view(-1)]
        assert len(from_tail) and torch.equal(got[0][from_tail], ref[0][from_tail])
        assert torch.equal(got[1][from_tail], ref[1][from_tail])


@pytest.mark.parametrize("sink", [0, 16])
def test_store_kernels_write_the_tails_the_torch_path_writes(sink):
    """ops.store through the kernels (interpreter): a mixed step of first chunks, continuation chunks and decodes
    writes the same tail rows (the unfinished tiles, the sink, the window) as the torch path, bit for bit, and
    records within one code on rounding boundaries."""
    gen = torch.Generator().manual_seed(3)
    ctx, qlen = np.array([0, 70, 130, 0, 200]), np.array([90, 60, 1, 20, 1])
    qsl = np.concatenate([[0], np.cumsum(qlen)])
    seq = ctx + qlen
    R, N = len(ctx), int(qsl[-1])
    bt = (1 + torch.arange(R * 4, dtype=torch.int32)).view(R, 4)
    window = FMT.window_tokens if sink else 0
    plan = step_plan.plan_step(qsl, seq, R, np.array([3, 0, 4, 2, 1], dtype=np.int32), bt, G, "cpu", sink=sink,
                               window=window)
    k, v = torch.randn(N, HK, D, generator=gen), torch.randn(N, HK, D, generator=gen)
    tails0 = torch.randn(2, R + 1, HK, G + sink + 2 * window, D, generator=gen).half()
    state = {}
    for kernels in (False, True):
        tk, tv = tails0[0].clone(), tails0[1].clone()
        cache = torch.zeros(R * 4 + 1, HK, FMT.record_bytes(D), dtype=torch.uint8)
        ops.store(plan, k.half(), v.half(), cache, tk, tv, FMT, use_kernels=kernels)
        state[kernels] = tk, tv, cache
    (tk0, tv0, c0), (tk1, tv1, c1) = state[False], state[True]
    assert plan.num_tiles == 2 and torch.equal(tk1, tk0) and torch.equal(tv1, tv0)
    assert not torch.equal(tk1, tails0[0])
    assert (c1 == c0).float().mean() > 0.995


def test_sink_tags_follow_recycled_blocks():
    """A block id vLLM recycles as another request's first tile takes its sink ownership along: a later prefix hit
    on it in the first owner's old slot must not read the first owner's tokens."""
    tags = torch.full((4,), -1, dtype=torch.int32)
    buf = torch.zeros(8, dtype=torch.int32)

    def step(rows, slots, first_blocks, ctx, qlen):
        R = len(rows)
        qsl = np.concatenate([[0], np.cumsum(qlen)])
        seq = np.asarray(ctx) + np.asarray(qlen)
        bt = torch.tensor([[b, 0] for b in first_blocks], dtype=torch.int32)
        plan = step_plan.plan_step(qsl, seq, R, np.asarray(slots, dtype=np.int32), bt, G, "cpu", sink=16)
        step_plan.update_sink_lens(plan, tags, bt, buf)
        return plan.sink_lens.tolist()

    assert step([0], [0], [5], [0], [10]) == [16]  # A (slot 0) writes its first tokens into block 5
    assert tags.tolist() == [5, -1, -1, -1]
    # A finished; block 5 is recycled as C's first block in slot 1
    assert step([0], [1], [5], [0], [40]) == [16] and tags.tolist() == [-1, 5, -1, -1]
    # D hits C's cached block 5 from slot 0: slot 0's rows hold A's tokens, not C's
    assert step([0], [0], [5], [128], [1]) == [0]
    # E hits the same cached block from slot 1 (C's slot, C's tokens = E's tokens): the sink is kept
    assert step([0], [1], [5], [128], [1]) == [16]
    # two claims in one step, a mismatched row beside them
    assert step([0, 1, 2], [2, 3, 0], [7, 8, 5], [0, 3, 200], [5, 2, 1]) == [16, 16, 0]
    assert tags.tolist() == [-1, 5, 7, 8]


def test_window_tags_name_the_tile_each_half_holds():
    """A slot's window half is read only for the tile whose block it was written with: not after a prefix hit on
    blocks another slot wrote, and not once vLLM recycles the block id for another request's tile."""
    W = FMT.window_tokens
    tags = torch.full((4, 2), -1, dtype=torch.int32)
    buf = torch.zeros(8, dtype=torch.int32)

    def step(slots, blocks, ctx, qlen):
        R = len(slots)
        qsl = np.concatenate([[0], np.cumsum(qlen)])
        seq = np.asarray(ctx) + np.asarray(qlen)
        bt = torch.tensor(blocks, dtype=torch.int32)
        plan = step_plan.plan_step(qsl, seq, R, np.asarray(slots, dtype=np.int32), bt, G, "cpu", sink=16, window=W)
        step_plan.update_window_lens(plan, tags, bt, buf)
        return plan.win_lens.tolist()

    assert step([0], [[5, 6, 7]], [0], [G + 3]) == [W]  # A (slot 0) writes tile 0 (block 5) and reads its window
    assert tags.tolist() == [[5, -1], [-1, -1], [-1, -1], [-1, -1]]
    assert step([0], [[5, 6, 7]], [G + 3], [G]) == [W] and tags[0].tolist() == [5, 6]  # tile 1's window: block 6
    # B hits A's first two blocks from slot 1: its halves hold nothing of them
    assert step([1], [[5, 6, 9]], [2 * G], [1]) == [0]
    # C hits them from A's slot (A done): the same blocks, the same tokens: the window stands
    assert step([0], [[5, 6, 8]], [2 * G], [1]) == [W]
    # block 6 recycled as D's second tile in slot 2: slot 0 no longer names it
    assert step([2], [[3, 6, 4]], [G], [G + 1]) == [W] and tags[:3].tolist() == [[5, -1], [-1, -1], [-1, 6]]
    assert step([0], [[5, 6, 8]], [2 * G + 1], [1]) == [0]
    assert step([3], [[1, 2, 3]], [0], [G]) == [0]  # one tile: no tile before the newest


def test_pending_flush_bookkeeping():
    """PendingFlush notes the rows whose token completes a tile (not padding / dummy rows on the scratch slot), keeps
    them when it grows, refuses more than it holds without losing what it had; the layer registry lists every
    layer's own cache, skips layers that share another's, and says None while a layer never ran its forward."""
    from kvarn.errors import KvarnError

    tails = TailBuffers()
    tails.allocate(["l0", "l1", "l2"], 4, HK, G, D, torch.float32, "cpu")
    caches = {n: torch.zeros(8, HK, FMT.record_bytes(D), dtype=torch.uint8) for n in ("l0", "l2")}
    tails.register_cache("l0", caches["l0"])
    tails.register_cache("l1", None)  # shares l0's cache
    assert tails.layer_buffers(["l0", "l1", "l2"]) is None  # l2 never ran: nothing may be flushed for it
    tails.register_cache("l2", caches["l2"])
    tk, tv, cs = tails.layer_buffers(["l0", "l1", "l2"])
    assert len(tk) == len(tv) == 2 and cs[0] is caches["l0"] and cs[1] is caches["l2"]

    pf = tails.pending(["l0", "l1", "l2"], 3, "cpu")
    assert tails.pending(["l2", "l1", "l0"], 3, "cpu") is pf  # one per layer set, whatever the order
    bt = torch.arange(20, dtype=torch.int32).reshape(5, 4)
    seq = np.array([G, 5, 2 * G, G, 0])
    rows = np.array([2, 0, 1, 4, 4], dtype=np.int32)  # row 3: a dummy row on the scratch slot 4
    pf.note(seq, rows, bt, G, scratch=4)
    assert pf.n == 2 and pf.slots[:2].tolist() == [2, 1] and pf.blocks[:2].tolist() == [0, 9]
    assert tails.pending(["l0", "l1", "l2"], 6, "cpu") is pf and pf.slots.shape[0] == 6  # grown in place
    assert pf.slots[:2].tolist() == [2, 1] and pf.blocks[:2].tolist() == [0, 9]
    with pytest.raises(KvarnError, match="pending buffer holds 6"):
        pf.note(np.full(7, G), np.arange(7, dtype=np.int32), torch.zeros(7, 2, dtype=torch.int32), G)
    assert pf.n == 2  # the tiles it had are still there


def test_pending_flush_logs_its_first_and_slow_launches(caplog, monkeypatch):
    """The first deferred flush and any whose launch takes seconds on the host (a compile mid-run) are logged with
    their tile count, so a stall in a serving log can be matched to one; the others are silent."""
    import logging

    from kvarn.vllm_plugin import tails as tails_mod

    tails = TailBuffers()
    tails.allocate(["l0"], 2, HK, G, D, torch.float32, "cpu")
    tails.register_cache("l0", torch.zeros(4, HK, FMT.record_bytes(D), dtype=torch.uint8))
    pf = tails.pending(["l0"], 2, "cpu")
    bt = torch.arange(8, dtype=torch.int32).reshape(2, 4)

    def flush_one():
        pf.note(np.array([G]), np.array([0], dtype=np.int32), bt, G)
        return pf.flush(tails.layer_buffers(["l0"]), FMT)

    monkeypatch.setattr(tails_mod, "SLOW_LAUNCH_S", 1e9)  # (the interpreter on a CPU is slow itself)
    with caplog.at_level(logging.INFO, logger="vllm.kvarn"):
        assert flush_one() == 1 and flush_one() == 1
        monkeypatch.setattr(tails_mod, "SLOW_LAUNCH_S", -1.0)  # every launch "slow"
        assert flush_one() == 1
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.kvarn"]
    assert len(lines) == 2, lines
    assert lines[0].startswith("kvarn: deferred flush #1: 1 tiles, launch ") and "slow" not in lines[0]
    assert lines[1].startswith("kvarn: deferred flush #3: 1 tiles") and lines[1].endswith("(slow: a compile?)")


def test_kernel_path_matches_torch_path_in_the_interpreter():
    """The GPU test's comparison (tests/vllm_plugin/test_vllm_gpu.py::test_ops_kernels_match_torch_path) with the kernels run
    by the Triton interpreter: fp16 steps through store, dense prefill and decode kernels against the fp32 torch
    path over the same records, within the fp16 arithmetic bound of tests/helpers.py."""
    from tests.helpers import ATOL_KERNEL_PATH, RTOL_KERNEL_PATH, kernel_path_vs_torch_path

    for step, got, want in kernel_path_vs_torch_path("kvarn_k4v2_g64", "cpu", use_kernels=True):
        if step is None:
            kern, ref = got, want
            break
        torch.testing.assert_close(got, want, atol=ATOL_KERNEL_PATH, rtol=RTOL_KERNEL_PATH,
                                   msg=lambda m: f"{step}: {m}")
    assert (kern["cache"] == ref["cache"]).float().mean() > 0.995  # codes may differ by one on rounding boundaries
    torch.testing.assert_close(kern["tk"].float(), ref["tk"].half().float())


def test_window_tags_follow_every_block_a_chunk_writes():
    """A long chunk rewrites blocks beyond its last two tiles: a recycled block id among them leaves every other
    slot's window tag too, so a later prefix hit in the first owner's slot does not read the first owner's tokens."""
    W = FMT.window_tokens
    tags = torch.full((4, 2), -1, dtype=torch.int32)
    buf = torch.zeros(8, dtype=torch.int32)

    def step(slots, blocks, ctx, qlen):
        qsl = np.concatenate([[0], np.cumsum(qlen)])
        seq = np.asarray(ctx) + np.asarray(qlen)
        bt = torch.tensor(blocks, dtype=torch.int32)
        plan = step_plan.plan_step(qsl, seq, len(slots), np.asarray(slots, dtype=np.int32), bt, G, "cpu", sink=16,
                                   window=W)
        step_plan.update_window_lens(plan, tags, bt, buf)
        return plan.win_lens.tolist()

    assert step([0], [[10, 11, 12, 0, 0]], [0], [2 * G + 5]) == [W] and tags[0].tolist() == [-1, 11]
    # A is done; block 11 is recycled as B's tile 1 of 5 in slot 1 (not one of B's last two tiles)
    assert step([1], [[20, 11, 21, 22, 23]], [0], [4 * G + 1]) == [W]
    assert tags[0].tolist() == [-1, -1]  # slot 0 no longer names block 11
    # C hits B's first two blocks from A's old slot: it must not read A's rows as B's tile 1
    assert step([0], [[20, 11, 30, 0, 0]], [2 * G], [4]) == [0]


@pytest.mark.parametrize("mixed", [False, True])
def test_step_store_script_runs_both_steps(mixed):
    """scripts/device/step_store.py (before_after.sh times it on both sides) plans and runs its step; on the CPU
    through the torch reference, so only that it runs and what it reports."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "device" / "step_store.py"
    args = ["--device", "cpu", "--requests", "4", "--prompt", "130", "--layers", "1", "--reps", "1", "--head-dim",
            "64", "--kv-heads", "2", "--q-heads", "4"] + (["--mixed"] if mixed else [])
    got = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, check=True)
    r = json.loads(got.stdout.strip().splitlines()[-1])
    # 128-token tiles. Fresh: 4 prompts of 130, a tile each. Mixed: a first chunk of 130 (one tile), a continuation of
    # 65 after 65 (tile 0, from its tail and new tokens), two decodes at position 130 (none)
    assert (r["mixed"], r["tokens"], r["tiles"]) == ((True, 130 + 65 + 2, 1 + 1) if mixed else (False, 520, 4))
    assert r["step_ms"] > 0 and len(r["ms"]) == 1
    assert 0 < r["host_ms"] <= r["step_ms"] and r["gpu_ms"] is None  # no GPU time on the CPU


@pytest.mark.parametrize("decode_first", [True, False])
def test_layers_of_a_step_share_its_prepared_launches(decode_first):
    """A mixed step's kernels (the Triton interpreter) are checked and prepared on its first layer and only launched on
    the others: every layer (its own cache, tails and Q/K/V) leaves the cache, the tails and the output that a fresh
    plan of its own gives it, bit for bit; a layer whose tensors differ in strides (Q/K/V as views of one fused
    buffer), dtype (fp32 K/V over fp16 tails) or head count prepares its own launches. decode_first: the decode row
    leads the batch (slices), else it sits between the others (gathered)."""
    sink, W = 16, FMT.window_tokens
    gen = torch.Generator().manual_seed(5)
    # requests: a decodes (70 tokens before), b starts (40), c continues (30 after 100: its tile 1 completes)
    order = ["a", "b", "c"] if decode_first else ["b", "a", "c"]
    blocks = {"a": [1, 2, 0], "b": [3, 0, 0], "c": [4, 5, 6]}
    done, new = {"a": 70, "b": 0, "c": 100}, {"a": 1, "b": 40, "c": 30}
    bt = torch.tensor([blocks[r] for r in order], dtype=torch.int32)
    slots = np.array(["abc".index(r) for r in order], dtype=np.int32)

    def plan_of(ctx, qlen):
        qsl, seq = np.concatenate([[0], np.cumsum(qlen)]), np.asarray(ctx) + np.asarray(qlen)
        p = step_plan.plan_step(qsl, seq, 3, slots, bt, G, "cpu", sink=sink, window=W)
        step_plan.update_sink_lens(p, torch.full((4,), -1, dtype=torch.int32), bt, torch.zeros(8, dtype=torch.int32))
        step_plan.update_window_lens(p, torch.full((4, 2), -1, dtype=torch.int32), bt,
                                     torch.zeros(8, dtype=torch.int32))
        return p

    n = sum(new.values())

    def layer(hk, fused=False, kv_dtype=torch.float16):  # the state after a first step, then the mixed step's Q/K/V
        cache = torch.zeros(7, hk, FMT.record_bytes(D), dtype=torch.uint8)
        tk, tv = (torch.zeros(4, hk, G + sink + 2 * W, D, dtype=torch.float16) for _ in range(2))
        kv = [torch.randn(170, hk, D, generator=gen).half() for _ in range(2)]
        ops.store(plan_of([0] * 3, [done[r] for r in order]), *kv, cache, tk, tv, FMT)
        if fused:  # as vLLM's QKV projection gives them: views of one buffer, row stride (HQ + 2 hk) * D
            qkv = torch.randn(n, HQ + 2 * hk, D, generator=gen).half()
            q, k, v = qkv[:, :HQ], qkv[:, HQ:HQ + hk], qkv[:, HQ + hk:]
        else:
            q, k, v = (torch.randn(n, h, D, generator=gen).half() for h in (HQ, hk, hk))
        return cache, tk, tv, q, k.to(kv_dtype), v.to(kv_dtype)

    layers = [layer(HK), layer(HK), layer(HK, fused=True), layer(HK, kv_dtype=torch.float32), layer(1)]
    mixed = plan_of([done[r] for r in order], [new[r] for r in order])
    assert mixed.num_tiles and mixed.cont_span is not None and mixed.dec_prefix == (1 if decode_first else 0)
    seq_t = torch.tensor([done[r] + new[r] for r in order], dtype=torch.int32)
    results = {}
    for shared in (True, False):
        runs = []
        for cache, tk, tv, q, k, v in layers:
            cache, tk, tv = cache.clone(), tk.clone(), tv.clone()
            plan = mixed if shared else dataclasses.replace(mixed, prepared={})
            out = torch.full_like(q, float("nan"))
            ops.store(plan, k, v, cache, tk, tv, FMT, use_kernels=True)
            ops.attention(plan, q, k, v, out, cache, bt, seq_t, tk, tv, FMT, SCALE, use_kernels=True)
            assert torch.isfinite(out).all()
            runs.append((cache, tk, tv, out))
        results[shared] = runs
    for a, b in zip(results[True], results[False]):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    # launches per kernel: one per geometry its tensors see. The store and the tail rows: the plain layers', the
    # fused one's, the fp32 one's, the one-head one's; the decode: the fp32 layer's Q, cache and tails are the plain
    # ones', and so are the fused layer's where its decode rows are gathered (a contiguous copy); the dense path's
    # record decoder and row reads (into its own fp16 buffers): one, and the one-head layer's
    made = [key[0] if isinstance(key[0], str) else key[0][0] for key in mixed.prepared if key[0] != "dense"]
    assert {k: made.count(k) for k in made} == {"store": 4, "tail rows": 4, "decode": 3 if decode_first else 2,
                                                "dense records": 2, "dense rows": 2}

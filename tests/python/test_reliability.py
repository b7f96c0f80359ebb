"""Never a wrong token: what a user may do between or around compiled calls —
share a step between threads, edit weights any way PyTorch allows, load another
model, change dtypes, run out of cache — gives eager's tokens, or hands the
graph to Inductor with the reason, or raises what eager raises."""

import functools
import gc
import mmap
import os
import threading
import warnings

import pytest
import torch
from transformers import StaticCache

import kwker
from kwker import _C, summary, weights
from kwker.testing import (_SMALL, block_mapped_again, in_shared_memory_block, logged, make_config, mapped_again,
                            random_model, small_model)

pytestmark = pytest.mark.usefixtures("fresh_compile_state")

PROMPT = torch.tensor([[3, 17, 42, 9, 7, 12, 5, 30]])


def greedy(model, compile_config=None, new_tokens=12):
    return model.generate(PROMPT, max_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                          compile_config=compile_config).tolist()


def assert_same_tokens(model, config):
    assert greedy(model, config) == greedy(model)


def kinds():
    return [g.kind for g in summary.graphs()]


# ---- 1. one compiled step, two threads ----------------------------------------------------


def test_one_compiled_step_called_from_two_threads_gives_each_its_own_logits(side_by_side):
    model = small_model("llama")
    step = torch.compile(model, backend="kwker", fullgraph=True)
    warnings.filterwarnings("ignore", message=".*past_key_values.*")

    def decode(fn, cache, token):
        with torch.no_grad():
            return fn(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits

    def fresh_cache():
        cache = StaticCache(config=model.config, max_cache_len=PROMPT.shape[1] + 12)
        with torch.no_grad():
            model(PROMPT, past_key_values=cache, use_cache=True)
        return cache

    decode(step, fresh_cache(), 1)  # compiles once, before the threads start

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(15):
            mine, theirs = fresh_cache(), fresh_cache()
            for _ in range(12):
                token = int(torch.randint(0, 64, (1,), generator=g))
                torch.testing.assert_close(decode(step, mine, token), decode(model, theirs, token), rtol=1e-4,
                                           atol=1e-4)

    assert side_by_side(run) == []
    assert kinds() == ["decode-replay"], kwker.report()


# ---- 2, 3. weights edited any way PyTorch allows ------------------------------------------


def test_weights_edited_through_data_are_read_fresh():
    model = small_model("llama")  # bf16-valued: kwker reads bf16 copies of every linear
    config = kwker.compile_config()
    assert_same_tokens(model, config)
    attn = model.model.layers[0].self_attn
    attn.q_proj.weight.data.mul_(-4.0)  # bf16-exact: the copy is packed again
    assert_same_tokens(model, config)
    before = greedy(model)
    first = before[0][PROMPT.shape[1]]
    head = model.lm_head.weight
    head.data[-1] = head[first].detach() * 20.0  # one row, on the partial page at the tied weight's end
    assert greedy(model) != before  # the edit decides the tokens
    assert_same_tokens(model, config)
    assert kinds() == ["decode-replay"], kwker.report()


def test_weights_of_a_float32_model_edited_through_data_are_read_fresh():
    model = small_model("llama", bf16_valued=False)  # q/k/v and gate/up are stacked copies
    config = kwker.compile_config()
    assert_same_tokens(model, config)
    k_proj = model.model.layers[1].self_attn.k_proj
    k_proj.weight.data.add_(torch.randn_like(k_proj.weight) * 0.5)
    assert_same_tokens(model, config)


@pytest.mark.parametrize("bf16_valued", [True, False])
def test_conv1d_weights_copied_as_their_transpose_are_read_fresh_after_an_edit(bf16_valued):
    """GPT-2's [K, N] weights: a bf16 copy, or a float32 one, of their transpose."""
    model = small_model("gpt2", bf16_valued=bf16_valued)
    config = kwker.compile_config()
    assert_same_tokens(model, config)
    before = greedy(model)
    c_fc = model.transformer.h[0].mlp.c_fc.weight
    c_fc.data[:, :40].mul_(-8.0)  # bf16-exact; columns, which are rows of the copy
    assert greedy(model) != before
    assert_same_tokens(model, config)
    assert kinds() == ["decode-replay"], kwker.report()


def test_a_copy_whose_packing_failed_on_the_way_is_packed_again_at_the_next_call(monkeypatch):
    """An interrupt or an allocation failing while a refresh packs a copy: the
    watches were rearmed already, and the next call read the half-made copy as
    fresh (a review found it); now it packs it again."""
    model = small_model("llama")
    config = kwker.compile_config()
    assert_same_tokens(model, config)
    before = greedy(model)
    model.model.layers[0].mlp.down_proj.weight.data.mul_(-4.0)
    model.lm_head.weight.data.mul_(-1.0)  # bf16-exact
    assert greedy(model) != before

    def interrupted(copy, sources, storage, scratch=None):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(kwker.weights, "fill_copy", interrupted)
        with pytest.raises(KeyboardInterrupt):
            greedy(model, config)
    assert_same_tokens(model, config)


@pytest.mark.parametrize("when", ["before", "after"])  # the weights shared before the compile, or after its copies
@pytest.mark.parametrize("how", ["share_memory", "shared_memory_block"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "mixtral"])  # stacked, transposed, experts' copies
def test_weights_shared_with_other_processes_are_read_as_stored_and_another_processs_write_is_seen(arch, how, when):
    """share_memory() (Hogwild training in workers, evaluation in the main
    process), or a multiprocessing.shared_memory block read through
    torch.frombuffer (which Tensor.is_shared() does not see): no watch sees
    another process's writes, so kwker copies none of these weights (before,
    its bf16 copies were read stale: other tokens). Weights moved there after
    the plan made its copies have the plan rebuilt (before, its copies were
    packed again from the new memory and read stale after such a write)."""
    model = small_model(arch)  # bf16-valued: every linear's weight would be a copy
    config = kwker.compile_config()
    if when == "after":
        assert_same_tokens(model, config)
    if how == "share_memory":
        model.share_memory()
        again_of = mapped_again
    else:
        block = in_shared_memory_block(model)
        again_of = functools.partial(block_mapped_again, block)
    assert_same_tokens(model, config)
    before = greedy(model)
    for name, p in model.named_parameters():
        if p.dim() >= 2 and "wte" not in name and "embed" not in name:
            again = again_of(p)
            again.copy_((again * -3.0).bfloat16().float())  # bf16-exact, as another process's write
    if how == "shared_memory_block":
        block.unlink()  # the memory lives while it is mapped; its name is needed no more
    assert greedy(model) != before  # the writes decide the tokens
    assert_same_tokens(model, config)
    assert kinds() == ["decode-replay"], kwker.report()


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mixtral"])  # stacked, transposed, experts' copies
@pytest.mark.parametrize("fits", ["none", "half"])
def test_weights_are_read_as_stored_where_their_copies_would_not_fit_in_the_memory_left(arch, fits, monkeypatch):
    """A bf16 model's stacked q/k/v and gate/up copies are about 65 % of its
    linear weights: a model that nearly filled the memory had the kernel's OOM
    killer end the process at its first compile, where eager runs. Copies are
    made until the memory left for them runs out, the rest read as stored. (A
    handler of the test's own: the sanitized run has no caplog.)"""
    model = small_model(arch)  # bf16-valued: every linear's weight would be a copy
    config = kwker.compile_config()
    taken = []
    close = weights.WeightArena.close
    monkeypatch.setattr(weights.WeightArena, "close", lambda arena: (taken.append(arena.taken), close(arena))[1])
    assert_same_tokens(model, config)
    all_copies = summary.graphs()[0].copies
    assert kinds() == ["decode-replay"] and all_copies > 0 and summary.graphs()[0].copies_refused == 0, kwker.report()
    summary.clear()
    torch._dynamo.reset()
    budget = 0 if fits == "none" else taken[0] // 2  # the first plan's copies
    monkeypatch.setattr(weights, "memory_for_copies", lambda: budget)
    monkeypatch.setattr(weights, "_warned_memory", False)  # warned once a process
    taken.clear()
    with logged("kwker.weights") as records:
        assert_same_tokens(model, config)
    graph = summary.graphs()[0]
    assert kinds() == ["decode-replay"] and graph.copies_refused > 0, kwker.report()
    assert (graph.copies == 0) if fits == "none" else (0 < graph.copies < all_copies), kwker.report()
    assert 0 < max(taken) <= budget if fits == "half" else max(taken) == 0
    assert "of weight copies not made: no memory left for them" in kwker.summary.format_report()
    assert any("would not fit in the memory left for them" in r.getMessage() for r in records)


def test_the_graphs_of_one_model_read_one_copy_of_each_weight_whatever_memory_is_left(monkeypatch):
    """A chunked prefill compiles three graphs (the first chunk, the others,
    the decode step); before, each made copies of every weight, and a second
    generate() of another length made them again. The first plan's copies
    take memory that the next plans' budget then lacks; the copies they share,
    unchanged, cost them nothing more, and they read them."""
    model = small_model("llama")  # bf16-valued: every linear's weight would be a copy
    closed = []
    close = weights.WeightArena.close
    monkeypatch.setattr(weights.WeightArena, "close", lambda arena: (closed.append(arena), close(arena))[1])
    monkeypatch.setattr(weights, "memory_for_copies", lambda: 0 if closed else 1 << 40)

    def chunked(config=None):  # the prompt in chunks of 4 tokens, then one a step: plans for two sizes
        return model.generate(PROMPT, max_new_tokens=8, do_sample=False, cache_implementation="static",
                              prefill_chunk_size=4, compile_config=config).tolist()

    config = kwker.compile_config()
    assert chunked(config) == chunked()
    assert model.generate(PROMPT, max_new_tokens=12, do_sample=False, cache_implementation="static",
                          compile_config=config).tolist() == greedy(model)  # another length: a dynamic graph
    assert kinds() == ["decode-replay"] * 4 and len(closed) == 4, kwker.report()
    assert closed[0].taken > 0 and all(not a.refused and not a.admitted for a in closed[1:])
    assert not any("budget" in vars(a) for a in closed[1:])  # the memory left not even read: all shared
    assert closed[0].capacity >= closed[0].taken and not any(a.capacity for a in closed[1:])  # none faulted in for copies shared
    assert all(g.copies == summary.graphs()[0].copies for g in summary.graphs()), kwker.report()
    assert len({a.family for a in closed}) == 1  # one lock for the plans that share copies
    plans = [p for p in (g.plan() for g in summary.graphs()) if isinstance(p, _C.Plan)]
    assert plans and all(p.call_lock is closed[0].family for p in plans), kwker.report()


def _two_graphs_over_one_attention(*shapes):
    """Plans of two graphs (the second adds 1) over the same bf16-valued q, k, v
    and o weights [256, 256], which read the same copies."""
    import torch.nn.functional as F

    from kwker.plan import compile_plan

    def first(x, q, k, v, o):
        return F.linear(F.linear(x, q) + F.linear(x, k) + F.linear(x, v), o)

    def second(x, q, k, v, o):
        return first(x, q, k, v, o) + 1.0

    torch.manual_seed(0)
    ws = [torch.nn.Parameter(torch.randn(256, 256).bfloat16().float(), requires_grad=False) for _ in range(4)]
    plans = [compile_plan(torch.fx.symbolic_trace(f), [torch.randn(n, 256), *ws])[0]
             for f, n in zip((first, second), shapes)]
    return plans, (first, second), ws


def test_a_plan_that_shares_no_copies_reserves_the_memory_of_every_copy_it_makes():
    """The tuner's plan (shares=False) makes every copy itself, those other
    plans share too: its reservation left those out, and it made them in
    memory of its own, faulted in on the calling thread (a review's finding).
    A plan that shares reserves only what is not shared yet."""
    from kwker.plan import reserve_weights

    (a, _), (first, _), ws = _two_graphs_over_one_attention(2, 2)
    gm, inputs = torch.fx.symbolic_trace(first), [torch.randn(2, 256), *ws]
    stacked = weights.copy_nbytes(ws[:3], weights.Storage(torch.bfloat16, _C.linear_block(256)))
    own = reserve_weights(gm, inputs, shares=False)
    assert own.capacity == stacked + weights.copy_nbytes(ws[3:], weights.Storage(torch.bfloat16, 0))
    assert reserve_weights(gm, inputs).capacity == 0
    with torch.no_grad():
        ws[3][0, 0] = 0.5  # bf16-valued still; o's copy stale: made again
    assert reserve_weights(gm, inputs).capacity == own.capacity - stacked


def test_a_copy_admitted_as_shared_and_made_after_a_write_is_counted():
    """admit() found o's copy shared and fresh, so it cost nothing; a write
    (another thread's) then made it stale, and make_copy made it again,
    uncounted: past the memory budget, and missing from what the plan took."""
    from kwker.plan import reserve_weights

    (a, _), (first, _), ws = _two_graphs_over_one_attention(2, 2)
    arena = reserve_weights(torch.fx.symbolic_trace(first), [torch.randn(2, 256), *ws])
    storage = weights.Storage(torch.bfloat16, 0)
    assert arena.admit([(["o"], storage)], {"o": ws[3]}) and arena.taken == 0
    shared = weights._shared[weights._shared_key([ws[3]], storage)]
    with torch.no_grad():
        ws[3][0, 0] = 0.5
    made = weights.make_copy([ws[3]], storage, arena)
    assert made is not shared and arena.taken == weights.copy_nbytes([ws[3]], storage)
    arena.close()


def test_two_parameters_over_one_memory_keep_copies_of_their_own_when_one_moves():
    """Two Parameters over one memory, read by two linears of one plan: they
    shared one copy, which each refresh packed from the first, then from the
    second, and after `a.data = other` the linear over a read b's values (19.7
    off eager's, no error; a review's reproducer)."""
    import torch.nn.functional as F

    from kwker.plan import compile_plan

    def two(x, y, a, b):
        return F.linear(x, a) + 10 * F.linear(y, b)

    w = torch.randn(64, 64).bfloat16().float()
    a, b = (torch.nn.Parameter(w, requires_grad=False) for _ in range(2))
    x, y = torch.randn(2, 64), torch.randn(2, 64)
    plan, detail = compile_plan(torch.fx.symbolic_trace(two), [x, y, a, b])
    assert detail["copies"] == 2
    torch.testing.assert_close(plan(x, y, a, b)[0], two(x, y, a, b), rtol=1e-4, atol=1e-3)
    a.data = a.detach() * 2
    for _ in range(2):
        torch.testing.assert_close(plan(x, y, a, b)[0], two(x, y, a, b), rtol=1e-4, atol=1e-3)


def test_a_copy_packed_from_a_weight_moved_is_shared_under_its_new_memory():
    """p.data = other: the plan that sees it packs the shared copy from the new
    memory, and a plan built after reads that copy; before, the copy stayed
    registered under the old memory, and every later plan made its own."""
    from kwker.plan import reserve_weights

    (a, _), (first, _), ws = _two_graphs_over_one_attention(2, 2)
    x = torch.randn(2, 256)
    ws[3].data = ws[3].detach().clone()
    torch.testing.assert_close(a(x, *ws)[0], first(x, *ws), rtol=1e-4, atol=1e-3)
    gm, inputs = torch.fx.symbolic_trace(first), [torch.randn(2, 256), *ws]
    assert reserve_weights(gm, inputs).capacity == 0


def test_a_weight_swapped_by_one_graphs_plan_and_back_is_read_right_by_the_others():
    """p.data = other, called through one plan (which watches the new memory
    and packs the shared copy from it), then p.data back: the other plan still
    held the first watch, which matched, and read the other weight's copy (19
    off eager's, no error; a review's reproducer)."""
    (a, b), (first, second), ws = _two_graphs_over_one_attention(2, 3)
    assert a.call_lock is b.call_lock
    xa, xb = torch.randn(2, 256), torch.randn(3, 256)
    original = ws[0].data
    ws[0].data = original * 2
    torch.testing.assert_close(a(xa, *ws)[0], first(xa, *ws), rtol=1e-4, atol=1e-3)
    ws[0].data = original
    torch.testing.assert_close(b(xb, *ws)[0], second(xb, *ws), rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(a(xa, *ws)[0], first(xa, *ws), rtol=1e-4, atol=1e-3)


def test_a_plan_compiled_again_keeps_its_lock_and_the_copies_still_fresh(monkeypatch):
    """q no longer bf16-valued: the plan is compiled again, stacks q, k, v anew
    in float32, and reads o's bf16 copy as it is, under the same lock (before,
    its first copy being new started another lock, and every other copy was
    made again)."""
    closed = []
    close = weights.WeightArena.close
    monkeypatch.setattr(weights.WeightArena, "close", lambda arena: (closed.append(arena), close(arena))[1])
    (a, b), (first, _), ws = _two_graphs_over_one_attention(2, 2)
    x = torch.randn(2, 256)
    ws[0].data[0, 0] += 1e-3
    torch.testing.assert_close(a(x, *ws)[0], first(x, *ws), rtol=1e-4, atol=1e-3)
    rebuilt = closed[-1]
    assert len(closed) == 3 and a.call_lock is b.call_lock and rebuilt.family is a.call_lock
    assert rebuilt.taken == weights.copy_nbytes(ws[:3], weights.Storage(torch.float32, _C.linear_block(256)))


def test_a_plan_compiled_again_inside_its_call_while_another_graph_is_tuned_over_its_weights(monkeypatch):
    """Thread A's plan, its float input changed, compiles again inside its call
    (holding its lock) and waits for Dynamo's compile lock; thread B, holding
    that compile lock, tunes another graph over the same weight. Had B's plan
    shared A's copies and lock, timing it would wait for A: both waited for
    ever (a review's reproducer). The tuner's plans hold locks of their own."""
    import torch.nn.functional as F

    import kwker.dynamo_backend
    import kwker.plan

    def scaled(x, w, s):
        return F.linear(x, w) * s

    def shifted(x, w):
        return F.linear(x, w) + 1.0

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 64).bfloat16().float(), requires_grad=False)
    x = torch.randn(2, 64)
    a, _ = kwker.plan.compile_plan(torch.fx.symbolic_trace(scaled), [x, w, torch.tensor(1.5, dtype=torch.float64)])
    b_tuning, a_compiling, b_locks = threading.Event(), threading.Event(), []
    compile_plan, trace_to_aten = kwker.dynamo_backend.compile_plan, kwker.plan.trace_to_aten

    def compile_in_tuning(*args, **kw):  # B, inside Dynamo's compile lock
        b_tuning.set()
        a_compiling.wait(30)
        plan, detail = compile_plan(*args, **kw)
        b_locks.append(plan.call_lock)
        return plan, detail

    def trace_in_refresh(*args, **kw):  # A, inside its plan's call
        a_compiling.set()
        return trace_to_aten(*args, **kw)

    monkeypatch.setattr(kwker.dynamo_backend, "compile_plan", compile_in_tuning)
    monkeypatch.setattr(kwker.plan, "trace_to_aten", trace_in_refresh)
    results = {}
    threads = [threading.Thread(target=lambda: results.update(b=torch.compile(shifted, backend=kwker.backend)(x, w)),
                                daemon=True),
               threading.Thread(target=lambda: b_tuning.wait(30) and results.update(
                   a=a(x, w, torch.tensor(2.5, dtype=torch.float64))[0]), daemon=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "deadlocked"
    assert b_locks and all(lock is not a.call_lock for lock in b_locks)
    # nor is the tuner's lock any later plan's (one built while the tuner timed its plan could wait likewise)
    later, _ = compile_plan(torch.fx.symbolic_trace(shifted), [x, w])
    assert all(lock is not later.call_lock for lock in b_locks)
    torch.testing.assert_close(results["a"], scaled(x, w, 2.5), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(results["b"], shifted(x, w), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("version", [1, 2])
def test_the_memory_for_copies_is_a_cgroups_where_it_has_a_limit(version, tmp_path):
    """A container's limit, not the machine's memory: in a 2.3 GiB memory cgroup
    SmolLM2-360M's float32 model with bf16 copies was killed (exit 137)."""
    cgroups = tmp_path / "cgroup"
    top = tmp_path / "sys" if version == 2 else tmp_path / "sys" / "memory"
    names = ("memory.max", "memory.current", "inactive_file") if version == 2 else \
        ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    cgroups.write_text("0::/a/b\n" if version == 2 else "4:memory:/a/b\n3:cpu:/x\n")
    for folder, limit, used, inactive in ((top / "a" / "b", "max" if version == 2 else str(1 << 62), 5 << 30, 0),
                                          (top / "a", str(3 << 30), 2 << 30, 1 << 30)):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / names[0]).write_text(limit + "\n")
        (folder / names[1]).write_text(f"{used}\n")
        (folder / "memory.stat").write_text(f"cache 5\n{names[2]} {inactive}\n")
    assert weights._cgroup_memory(str(cgroups), str(tmp_path / "sys")) == [(3 << 30, 1 << 30)]
    assert weights._cgroup_memory(str(tmp_path / "none"), str(tmp_path / "sys")) == []
    (top / "a" / "memory.stat").unlink()  # the limit holds, no page counted as reclaimable
    assert weights._cgroup_memory(str(cgroups), str(tmp_path / "sys")) == [(3 << 30, 2 << 30)]
    cgroups.write_bytes(b"0::/a/b\xff\n" if version == 2 else b"4:memory:/a/b\xff\n")  # a name not UTF-8
    assert weights._cgroup_memory(str(cgroups), str(tmp_path / "sys")) == [(3 << 30, 2 << 30)]


def test_kwker_copy_memory_bounds_the_copies_of_all_plans_together_in_place_of_the_estimate(monkeypatch):
    """KWKER_COPY_MEMORY is taken as given: copies are made where the estimate
    of the memory left has no room (a cgroup full here), and the copies alive,
    of every plan, count against it; `0` makes none."""
    import torch.nn.functional as F

    from kwker.plan import compile_plan

    def attention(x, q, k, v):
        return F.linear(x, q) + F.linear(x, k) + F.linear(x, v)

    def plan_over_new_weights():
        ws = [torch.nn.Parameter(torch.randn(64, 64).bfloat16().float(), requires_grad=False) for _ in range(3)]
        x = torch.randn(2, 64)
        plan, detail = compile_plan(torch.fx.symbolic_trace(attention), [x, *ws])
        torch.testing.assert_close(plan(x, *ws)[0], attention(x, *ws), rtol=1e-4, atol=1e-4)
        return plan, detail

    monkeypatch.setattr(weights, "_cgroup_memory", lambda: [(1 << 30, 1 << 30)])  # no memory left, by the estimate
    assert weights.memory_for_copies() < 0 and plan_over_new_weights()[1]["copies"] == 0
    one = 3 * 64 * 64 * 2  # a plan's copy: q, k, v stacked in bf16
    monkeypatch.setenv("KWKER_COPY_MEMORY", f"{one + 96}")  # a copy takes 64 bytes more from a budget: its alignment
    first, detail = plan_over_new_weights()
    assert detail["copies"] == 1 and not detail["copies_refused"]
    assert weights.memory_for_copies() == 96
    monkeypatch.setattr(weights, "_warned_memory", False)  # warned once a process
    with logged("kwker.weights") as records:
        _, detail = plan_over_new_weights()  # the first plan's copy takes the room
    assert detail["copies"] == 0 and detail["copies_refused"] == one + 64
    assert any("KWKER_COPY_MEMORY less the copies made before" in r.getMessage() for r in records), records
    del first
    gc.collect()
    assert plan_over_new_weights()[1]["copies"] == 1
    monkeypatch.setenv("KWKER_COPY_MEMORY", "0")
    assert plan_over_new_weights()[1]["copies"] == 0
    for value in ("3 gigs", "１２", "٣"):  # digits other than ASCII's too
        monkeypatch.setenv("KWKER_COPY_MEMORY", value)
        with pytest.warns(UserWarning, match=f"KWKER_COPY_MEMORY='{value}' is not a size"):
            assert weights.copy_memory_setting() is None
    monkeypatch.setenv("KWKER_COPY_MEMORY", "")  # unset, as an empty KWKER_CACHE_DIR
    assert weights.copy_memory_setting() is None
    for value, nbytes in (("3G", 3 << 30), ("1.5GiB", 3 << 29), ("512 mb", 512 << 20), ("4096", 4096),
                          ("9" * 400, 10**400 - 1), ("9" * 400 + ".5K", (10**400 << 10) - 512)):  # float's raised OverflowError
        monkeypatch.setenv("KWKER_COPY_MEMORY", value)
        assert weights.copy_memory_setting() == nbytes


def test_a_mapped_file_whose_name_is_not_utf8_leaves_the_shared_memory_check_working(tmp_path):
    """/proc/self/maps names every mapped file; read as text, a name that is not
    UTF-8 made every weight's decision raise UnicodeDecodeError."""
    path = os.path.join(os.fsencode(tmp_path), b"w\xff.bin")
    with open(path, "wb") as f:
        f.write(bytes(4096))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 4096, prot=mmap.PROT_READ):
        assert not weights.shared_with_other_processes([torch.zeros(4)])
        assert weights.shared_with_other_processes([torch.zeros(4).share_memory_()])


def test_weights_whose_storage_is_freed_and_allocated_again_are_read_fresh():
    """FSDP's way of gathering a parameter: its storage resized to 0 (the memory
    freed) and back, then written. The tensor, and the alias kwker's watch holds,
    keep their storage object, whose memory is new."""
    model = small_model("llama")
    config = kwker.compile_config()
    assert_same_tokens(model, config)
    before = greedy(model)
    for linear in (model.model.layers[0].self_attn.q_proj, model.model.layers[1].mlp.down_proj):
        weight = linear.weight
        new = (weight.detach() * -4.0).clone()  # bf16-exact
        storage = weight.untyped_storage()
        nbytes = storage.nbytes()
        storage.resize_(0)
        storage.resize_(nbytes)
        with torch.no_grad():
            weight.copy_(new)
    assert greedy(model) != before  # the new values decide the tokens
    assert_same_tokens(model, config)
    assert_same_tokens(model, config)
    assert kinds() == ["decode-replay"], kwker.report()


def test_a_weight_given_another_layout_under_skipped_guards_is_read_as_it_is_now():
    model = small_model("llama")
    config = kwker.compile_config()
    assert_same_tokens(model, config)  # the warm-up the README asks for
    q_proj = model.model.layers[0].self_attn.q_proj
    q_proj.weight.data = q_proj.weight.data.t()  # the same storage, transposed: guards would see it
    want = greedy(model)
    with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
        assert greedy(model, config) == want
    assert kinds() == ["decode-replay"], kwker.report()


# ---- 4. another model, new tensors ----------------------------------------------------------


def test_another_model_of_the_same_class_and_replaced_tensors_are_read_fresh():
    config = kwker.compile_config()
    first = small_model("llama", seed=0)
    assert_same_tokens(first, config)
    second = small_model("llama", seed=1)  # Dynamo reuses the step: kwker packs its weights
    assert greedy(second) != greedy(first)
    assert_same_tokens(second, config)
    second.model.layers[1].mlp.down_proj.weight.data = torch.randn(64, 160).to(torch.bfloat16).float()
    assert_same_tokens(second, config)
    del first, second
    third = small_model("llama", seed=2)  # after a model is deleted: its memory may come back
    assert_same_tokens(third, config)
    assert_same_tokens(small_model("llama", seed=0), config)
    assert kinds() == ["decode-replay"], kwker.report()


@pytest.fixture
def swapped_on_conversion():
    was = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(was)


def test_a_compiled_model_converted_to_bf16_by_swapping_its_tensors_gives_eagers_tokens(swapped_on_conversion):
    # swap_tensors refuses a tensor with weak references: Dynamo's fake mode held some
    # after a compile through compile_config() ("Couldn't swap Embedding.weight").
    model = small_model("llama", bf16_valued=False)
    assert_same_tokens(model, kwker.compile_config())
    model.to(torch.bfloat16)
    assert_same_tokens(model, kwker.compile_config())
    assert set(kinds()) == {"decode-replay"}, kwker.report()


# ---- 5. another architecture whose config has another float ---------------------------------


def test_a_float_of_the_config_that_differs_between_models_is_replayed_for_each():
    config = kwker.compile_config()
    for arch, eps in (("LlamaConfig", 1e-5), ("Qwen2Config", 1e-6), ("LlamaConfig", 1e-6), ("LlamaConfig", 1e-5)):
        model = random_model(make_config(arch, **{**_SMALL, "rms_norm_eps": eps}))
        assert_same_tokens(model, config)
    assert set(kinds()) == {"decode-replay"}, kwker.report()
    assert not any(g.fallback_ops for g in summary.graphs()), kwker.report()


def _scaled(x, s, t):
    return x * s + t


def test_a_float_input_that_becomes_nan_or_negative_zero_gives_eagers_values():
    """A float Dynamo made an input reaches the plan as a 0-dim float64 tensor,
    on whose value the plan is specialised and which it checks on every call.
    A NaN is its own value there (NaN != NaN once made every call a refresh that
    never caught up: PlanError), and -0.0 is another value than +0.0."""
    from kwker.plan import compile_plan

    f64 = lambda v: torch.tensor(v, dtype=torch.float64)
    x = torch.randn(2, 3)
    plan, _ = compile_plan(torch.fx.symbolic_trace(_scaled), [x, f64(1.5), f64(0.5)])
    for s, t in ((float("nan"), 0.5), (float("nan"), 0.5), (-0.0, -0.0), (0.0, -0.0), (2.0, float("nan")), (1.5, 0.5)):
        got, want = plan(x, f64(s), f64(t))[0], _scaled(x, f64(s), f64(t))
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
        assert torch.equal(got.signbit(), want.signbit()), (s, t)


def _linear(x, w, b):
    return torch.nn.functional.linear(x, w, b)


def test_a_linear_over_a_weight_of_another_dtype_raises_as_eager_does():
    """A weight made bf16 under a float32 activation (`weight.data = w.bfloat16()`
    on a block whose guards Dynamo kept, so that it compiled the step again) was
    taken by kwker's linear, which reads bf16 weights: tokens where eager raises."""
    from kwker.plan import compile_plan

    x, b = torch.randn(3, 64), torch.nn.Parameter(torch.randn(32), requires_grad=False)
    w = torch.nn.Parameter(torch.randn(32, 64).bfloat16(), requires_grad=False)
    with pytest.raises(RuntimeError) as eager:
        _linear(x, w, b)
    plan, detail = compile_plan(torch.fx.symbolic_trace(_linear), [x, w, b])
    assert detail["rewrites"].get("linear", 0) == 0, detail
    with pytest.raises(RuntimeError) as got:
        plan(x, w, b)
    assert str(eager.value) in str(got.value)


# ---- 6. dtypes kwker's kernels do not take ---------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_a_model_in_a_dtype_kwker_has_no_kernels_for_goes_to_inductor_with_the_reason(dtype):
    model = small_model("llama", dtype=dtype)
    assert_same_tokens(model, kwker.compile_config())
    (graph,) = summary.graphs()
    assert graph.kind == "inductor" and str(dtype) in graph.why, kwker.report()
    assert "input 'model.embed_tokens.weight' is" in graph.why  # named as in the model, not Dynamo's placeholder


# ---- 7. a cache position out of range ---------------------------------------------------------


def after_the_prompt(model, spare: int):
    """(name, step, cache) for eager's model and kwker's compiled one, each with
    a static cache of `spare` positions past the prompt, the prompt in it."""
    step = torch.compile(model, backend="kwker", fullgraph=True)
    warnings.filterwarnings("ignore", message=".*past_key_values.*")
    for name, fn in (("eager", model), ("kwker", step)):
        cache = StaticCache(config=model.config, max_cache_len=PROMPT.shape[1] + spare)
        with torch.no_grad():
            model(PROMPT, past_key_values=cache, use_cache=True)
        yield name, fn, cache


def test_a_step_past_the_end_of_the_cache_raises_as_eager_does():
    errors = {}
    for name, fn, cache in after_the_prompt(small_model("llama"), spare=2):
        with torch.no_grad():
            for _ in range(2):
                fn(torch.tensor([[5]]), past_key_values=cache, use_cache=True)
            with pytest.raises(IndexError) as e:
                fn(torch.tensor([[5]]), past_key_values=cache, use_cache=True)
        errors[name] = str(e.value)
    assert errors["kwker"].startswith(errors["eager"])
    assert kinds() == ["decode-replay"], kwker.report()


def test_a_step_that_raises_for_a_bad_token_id_writes_nothing_into_the_cache_as_eager():
    """The embedding skips a bad id's row and reports it; the layers after it
    had still run and written the skipped row's values into the cache, so a
    loop that caught the IndexError and went on decoded from a corrupted cache."""
    model = small_model("llama")
    after = {}
    for name, fn, cache in after_the_prompt(model, spare=4):
        with torch.no_grad():
            fn(torch.tensor([[5]]), past_key_values=cache, use_cache=True)
            with pytest.raises(IndexError):
                fn(torch.tensor([[model.config.vocab_size + 3]]), past_key_values=cache, use_cache=True)
            keys = [layer.keys.clone() for layer in cache.layers]
            logits = fn(torch.tensor([[6]]), past_key_values=cache, use_cache=True).logits
        after[name] = (keys, logits)
    for got, want in zip(after["kwker"][0], after["eager"][0]):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(after["kwker"][1], after["eager"][1])
    assert kinds() == ["decode-replay"], kwker.report()


def test_steps_past_dynamos_recompile_limit_run_eagerly_with_eagers_tokens():
    """Prompt lengths and batches are variants of the step; past Dynamo's limit
    (8, here 1) generate() went on only with fullgraph=False (compile_config's
    now, as transformers' own): with True it raised FailOnRecompileLimitHit."""
    model = small_model("llama")
    prompts = [PROMPT, PROMPT[:, :5], PROMPT.repeat(2, 1)]
    config = kwker.compile_config()
    with torch._dynamo.config.patch(recompile_limit=1):
        for ids in prompts:
            want = model.generate(ids, max_new_tokens=4, do_sample=False, cache_implementation="static")
            got = model.generate(ids, max_new_tokens=4, do_sample=False, cache_implementation="static",
                                 compile_config=config)
            assert got.tolist() == want.tolist()


# ---- 8. two threads compiling at once ---------------------------------------------------------


def test_two_threads_compiling_at_once_both_get_their_tokens(side_by_side):
    models = [small_model("llama"), small_model("qwen2")]
    want = [greedy(m) for m in models]
    got = [None, None]

    def run(i):
        got[i] = greedy(models[i], kwker.compile_config())

    assert side_by_side(run) == [] and got == want
    assert kinds() == ["decode-replay", "decode-replay"], kwker.report()


class _WaitsWhileTraced(torch.nn.Module):
    def __init__(self, tracing: threading.Event, called: threading.Event):
        super().__init__()
        self.tracing, self.called = tracing, called

    def forward(self, x):
        self.tracing.set()
        self.called.wait(timeout=30)
        return x * 2


def test_another_thread_calls_a_compiled_function_while_kwker_traces(side_by_side):
    """The same as below without timing: the trace waits (inside make_fx) until
    the other thread's compiled call has returned."""
    from kwker.aten_graph import trace_to_aten

    tracing, called = threading.Event(), threading.Event()
    double = torch.compile(lambda x: x * 2, backend="eager")
    double(torch.ones(2))

    def run(i):
        if i == 0:
            trace_to_aten(_WaitsWhileTraced(tracing, called), [torch.ones(2)])
        else:
            try:
                assert tracing.wait(timeout=30)
                assert torch.equal(double(torch.ones(2)), torch.full((2,), 2.0))
            finally:
                called.set()

    assert side_by_side(run) == []


def test_a_plan_traced_at_call_time_does_not_stop_another_thread_calling_a_compiled_step(side_by_side):
    """A plan for new sizes is traced when the step is called, outside Dynamo's
    compile; make_fx marks the process as FX-tracing, and another thread
    entering a compiled step then raised that it was FX-tracing a compiled
    function. Thread 0 gives a new prompt length each time (a plan per size);
    thread 1 decodes another model until thread 0 is done."""
    models = [small_model("llama"), small_model("qwen2")]
    configs = [kwker.compile_config(), kwker.compile_config()]
    prompts = [torch.tensor([list(range(1, n + 1))]) for n in range(4, 16)]

    def generate(i, ids, new_tokens, config=None):
        return models[i].generate(ids, max_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                                  compile_config=config).tolist()

    for ids in (PROMPT, prompts[0][:, :3]):  # a second length: Dynamo makes the cache length dynamic
        generate(0, ids, 2, configs[0])
    generate(1, PROMPT, 2, configs[1])
    got, done = [], threading.Event()

    def run(i):
        try:
            if i == 0:
                got.extend(generate(0, ids, 3, configs[0]) for ids in prompts)
            else:
                while not done.is_set():
                    generate(1, PROMPT, 4, configs[1])
        finally:
            done.set()

    assert side_by_side(run) == []
    assert got == [generate(0, ids, 3) for ids in prompts]


# ---- 9. what a plan returns and writes, as eager's tensors --------------------------------------


class _FoldedOutputs(torch.nn.Module):
    def forward(self, x):
        c = torch.arange(4.0)
        return x + c, c, torch.zeros(1).expand(3)


def test_a_value_folded_at_compile_time_is_returned_fresh_by_every_call():
    """Eager makes a new tensor on each call, and a caller may write the one it
    gets: the plan's constant must not be what it hands out."""
    from kwker.aten_graph import trace_to_aten
    from kwker.lower import lower_to_plan

    module, x = _FoldedOutputs(), torch.zeros(4)
    plan, _ = lower_to_plan(trace_to_aten(module, [x]), [x])
    first = plan(x)
    first[1].mul_(100)
    second = plan(x)
    for got, want in zip(second, module(x)):
        assert torch.equal(got, want)
    assert first[1].data_ptr() != second[1].data_ptr()


class _Noise(torch.nn.Module):
    def forward(self, x):
        return x + 2.0 * torch.randn(x.shape)  # drawn from a shape alone: every input of randn is a constant


def test_random_numbers_are_drawn_at_every_call_as_eager_draws_them():
    """An op that draws from the generator is never folded at compile time,
    which had added one draw to every call."""
    from kwker.aten_graph import trace_to_aten
    from kwker.lower import lower_to_plan

    module, x = _Noise(), torch.zeros(4)
    plan, report = lower_to_plan(trace_to_aten(module, [x]), [x])
    assert "aten.randn.default" in report.fallback_ops
    torch.manual_seed(0)
    first, second = plan(x)[0].clone(), plan(x)[0].clone()
    torch.manual_seed(0)
    assert torch.equal(first, module(x)) and torch.equal(second, module(x))
    assert not torch.equal(first, second)


def test_a_decode_step_that_adds_noise_gives_eagers_tokens_and_logits():
    import types

    model = small_model("llama")
    mlp = model.model.layers[0].mlp
    forward = type(mlp).forward
    mlp.forward = types.MethodType(lambda self, x: forward(self, x) + torch.randn(x.shape, dtype=x.dtype), mlp)

    def run(config):
        torch.manual_seed(0)
        return model.generate(PROMPT, max_new_tokens=8, do_sample=False, cache_implementation="static",
                              compile_config=config, return_dict_in_generate=True, output_logits=True)

    want, got = run(None), run(kwker.compile_config())
    assert kinds() == ["decode-replay"]
    assert got.sequences.tolist() == want.sequences.tolist()
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b)


def _recorded_plan(made: dict):
    from kwker.plan import compile_plan

    def backend(gm, example_inputs):
        made["plan"], made["detail"] = compile_plan(gm, example_inputs)
        return made["plan"]

    return backend


def test_two_folded_views_of_one_constant_each_read_their_own_values():
    """A constant the forward makes (an arange) and two views of it, each
    folded at compile time: the later fold (the transpose) replaced the
    storage's buffer with a contiguous copy of its own, and the slice, read
    after it, was read through the transpose's values (433 for eager's 133)."""

    def f(x):
        c = torch.arange(12.0).view(3, 4)
        a = c[:, 1:3]
        b = c.t()
        return (x + a).sum() + (x[:1, :1] + b).sum() * 0 + (x + a)[0, 0] * 100

    x = torch.zeros(3, 2)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(f, backend=_recorded_plan({}))(x)
    torch.testing.assert_close(got, f(x))


def test_copies_between_strided_views_of_one_folded_constant_are_native_and_eagers():
    """new_empty of a constant's shape filled by strided copies of two folded
    slices of that constant (the second slice's fold replaced the first one's
    buffer: a PlanError, its view outside it)."""

    def g(x):
        c = torch.arange(12.0).view(3, 4)
        e = c.new_empty((3, 4))
        e[:, ::2].copy_(c[:, 1::2])
        e[:, 1::2].copy_(c[:, ::2])
        return e + x

    x = torch.randn(3, 4)
    made = {}
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(g, backend=_recorded_plan(made))(x)
    torch.testing.assert_close(got, g(x))
    assert "aten.copy_.default" not in made["detail"]["fallback_ops"], made["detail"]


class _WritesItsInput(torch.nn.Module):
    def forward(self, buf):
        buf.add_(1.0)
        return buf * 2


def test_an_input_a_native_step_writes_has_its_version_bumped_so_autograd_refuses_what_it_saved():
    """Eager's add_ bumps buf's version counter, so backward refuses the value
    autograd saved before the write; a native write must do the same, not let
    backward read the new value."""
    from kwker.plan import compile_plan

    plan, detail = compile_plan(torch.fx.symbolic_trace(_WritesItsInput()), [torch.zeros(3)])
    assert detail["fallback_ops"] == []
    w, buf = torch.ones(3, requires_grad=True), torch.full((3,), 5.0)
    y = (w * buf).sum()
    plan(buf)
    assert buf.tolist() == [6.0] * 3 and buf._version == 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_a_cache_write_of_another_dtype_raises_as_eager_does():
    def ring(buf, pos, x):
        buf.index_copy_(2, pos, x)
        return buf.sum(2)

    args = lambda: [torch.zeros(1, 2, 6, 4), torch.tensor([1]), torch.randn(1, 2, 1, 4).bfloat16()]
    with pytest.raises(RuntimeError) as eager:
        ring(*args())
    with torch.no_grad(), pytest.raises(RuntimeError) as got:
        torch.compile(ring, backend="kwker")(*args())
    assert str(eager.value) in str(got.value)


# ---- 10. a bug of kwker's while compiling ---------------------------------------------------------


def test_a_kwker_error_compiling_a_decode_step_is_logged_and_the_step_compiled_elsewhere(monkeypatch):
    """Never a failed compile: JetMoE's step once raised AttributeError in the
    lowering (a SymInt read by a step) and torch.compile failed with it. (A
    handler of the test's own: the sanitized run has no caplog.)"""
    import kwker.dynamo_backend as backend

    def broken(*args, **kwargs):
        raise AttributeError("a lowering bug")

    monkeypatch.setattr(backend, "compile_decode_step", broken)
    with logged("kwker.dynamo_backend") as records:
        assert_same_tokens(small_model("llama"), kwker.compile_config())
    assert any("AttributeError: a lowering bug" in r.getMessage() for r in records)
    assert "decode-replay" not in kinds() and kinds(), kwker.report()


# ---- 11. tensors a graph holds rather than takes as inputs ------------------------------------------


@pytest.mark.parametrize("make_optimizer", [
    lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    lambda params: torch.optim.AdamW(params, lr=1e-2),
], ids=["sgd-momentum", "adamw"])
def test_a_compiled_optimizer_step_updates_its_state_once_per_call_as_eager(make_optimizer):
    """Dynamo holds an optimizer's parameters and state as attributes of its
    graph, real tensors: kwker's trace to ATen once ran `step += 1` and
    `momentum_buffer.mul_(0.9)` on them for real (an extra update at every
    compile) before it failed and the graph went to Inductor."""
    def train(compiled):
        torch.manual_seed(0)
        layer = torch.nn.Linear(8, 8)
        opt = make_optimizer(layer.parameters())
        step = torch.compile(opt.step, backend="kwker") if compiled else opt.step
        for i in range(3):
            layer(torch.randn(4, 8, generator=torch.Generator().manual_seed(i))).pow(2).mean().backward()
            step()
            opt.zero_grad()
        return [p.detach().clone() for p in layer.parameters()], opt.state_dict()["state"]

    (params, state), (want_params, want_state) = train(compiled=True), train(compiled=False)
    for got, want in zip(params, want_params):
        torch.testing.assert_close(got, want)
    for got, want in zip(state.values(), want_state.values()):
        torch.testing.assert_close(got, want)
    assert any("writes a tensor it holds" in g.why for g in summary.graphs()), kwker.report()

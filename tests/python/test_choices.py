"""Tuning choices remembered on disk (kwker.choices): a graph tuned before is
built as then chosen, in this process or another, and tuned again where the
record no longer holds."""

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import kwker.dynamo_backend
from kwker import choices, summary
from kwker.freeze import FrozenGraph
from kwker.options import KwkerOptions

pytestmark = pytest.mark.usefixtures("fresh_compile_state")


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 32)).eval()


def compile_and_run(model, *inputs, options=None):
    """The compiled model's outputs and kwker's report of the graph."""
    summary.clear()
    torch._dynamo.reset()
    out = torch.compile(model, backend="kwker", options=options)(*inputs)
    (graph,) = summary.graphs()
    return out, graph


def no_tuning(monkeypatch):
    def tuned(*args, **kwargs):
        raise AssertionError("the graph was tuned again")

    monkeypatch.setattr(kwker.dynamo_backend, "choose", tuned)


def records() -> list[str]:
    folder = choices.directory()
    return sorted(p.name for p in folder.glob("*.json")) if folder.exists() else []


def test_a_graph_tuned_before_is_built_as_chosen_without_tuning(monkeypatch):
    model, x = mlp(), torch.randn(8, 64)
    with torch.no_grad():
        expected = model(x)
        out, first = compile_and_run(model, x)
        assert first.kind == "tuned" and not first.recalled and len(records()) == 1
        no_tuning(monkeypatch)
        again, second = compile_and_run(model, x)
    assert second.recalled and second.choice == first.choice and second.candidates == first.candidates
    torch.testing.assert_close(again, expected, rtol=1e-4, atol=1e-5)
    header, row = summary.format_report().splitlines()
    nodes_end = header.index("nodes") + len("nodes")  # the columns stay under the header
    assert "(recalled)" in row and row[:nodes_end].endswith(f" {second.nodes}")


def test_a_training_graph_tuned_before_is_built_as_chosen(monkeypatch):
    model, x = mlp(), torch.randn(8, 64)
    reference = mlp()
    reference(x).sum().backward()
    compile_and_run(model, x)
    model.zero_grad()
    no_tuning(monkeypatch)
    out, graph = compile_and_run(model, x)
    out.sum().backward()
    assert graph.kind == "training" and graph.recalled
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)


def test_a_choice_made_while_reserving_the_plans_copies_failed_is_not_remembered(monkeypatch):
    """An error reserving the plan's weight copies may be the moment's (memory;
    a KWKER_COPY_MEMORY of 400 digits overflowed a float): it was taken for a
    plan kwker does not build (NotLowerable), and the choice made without the
    plan was remembered, keeping the plan out of every later process (a
    hostile pass). The plan is left out with the error, as a failed build is."""
    def failing(*args, **kwargs):
        raise MemoryError("no room at the moment")

    monkeypatch.setattr(kwker.dynamo_backend, "reserve_weights", failing)
    model, x = mlp(), torch.randn(8, 64)
    with torch.no_grad():
        out, graph = compile_and_run(model, x)
        torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)
    assert graph.left_out["plan"].startswith("MemoryError: no room at the moment"), kwker.report()  # not NotLowerable
    assert graph.kind == "tuned" and records() == [], kwker.report()


def captured_graph(model, *inputs):
    """Dynamo's graph of model and its example inputs."""
    seen = []

    def backend(gm, example_inputs):
        seen.append((gm, example_inputs))
        return gm

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend)(*inputs)
    return seen[-1]


def test_the_key_changes_with_what_the_choice_rests_on():
    opts = KwkerOptions()
    base = choices.key("inference", *captured_graph(mlp(), torch.randn(8, 64)), opts)
    assert choices.key("inference", *captured_graph(mlp(seed=1), torch.randn(8, 64)), opts) == base  # other values
    assert choices.key("training", *captured_graph(mlp(), torch.randn(8, 64)), opts) != base
    assert choices.key("inference", *captured_graph(mlp(), torch.randn(16, 64)), opts) != base
    assert choices.key("inference", *captured_graph(mlp().double(), torch.randn(8, 64).double()), opts) != base
    assert choices.key("inference", *captured_graph(mlp(), torch.randn(8, 64)), KwkerOptions(glue=False)) != base
    rounded = mlp()
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # a bf16 checkpoint loaded in float32
    assert choices.key("inference", *captured_graph(rounded, torch.randn(8, 64)), opts) != base
    one = torch.randn(16, 64)  # two inputs over one storage, or one each: no plan over shared storage
    aliased = choices.key("inference", *captured_graph(torch.add, one[:8], one[8:]), opts)
    assert choices.key("inference", *captured_graph(torch.add, *torch.randn(16, 64).split(8)), opts) == aliased
    apart = captured_graph(torch.add, torch.randn(16, 64)[:8], torch.randn(16, 64)[8:])  # the same offsets
    assert choices.key("inference", *apart, opts) != aliased
    gm, example_inputs = captured_graph(mlp(), torch.randn(8, 64))
    with torch.no_grad():
        assert choices.key("inference", gm, example_inputs, opts) != base
    with torch.autocast("cpu", torch.bfloat16):
        assert choices.key("inference", gm, example_inputs, opts) != base
    default = torch.get_default_dtype()
    try:  # Inductor's torch.arange(n) under a bf16 default was off eager's by 6.6e-4: left out when tuned, not recalled
        torch.set_default_dtype(torch.bfloat16)
        assert choices.key("inference", gm, example_inputs, opts) != base
    finally:
        torch.set_default_dtype(default)
    with torch._inductor.config.patch(freezing=True):
        assert choices.key("inference", gm, example_inputs, opts) != base
    conv, matmul = torch.backends.mkldnn.conv, torch.backends.mkldnn.matmul
    before, matmul_before = conv.fp32_precision, matmul.fp32_precision
    try:  # set by the new API, under which torch.get_float32_matmul_precision() raises: the key was a crash
        conv.fp32_precision = "bf16"
        assert choices.key("inference", gm, example_inputs, opts) != base
        conv.fp32_precision = before
        torch.set_float32_matmul_precision("highest")  # the default's arithmetic, which an unset "none" means
        assert choices.key("inference", *captured_graph(mlp(), torch.randn(8, 64)), opts) == base
    finally:
        conv.fp32_precision, matmul.fp32_precision = before, matmul_before
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert choices.key("inference", *captured_graph(mlp(), torch.randn(8, 64)), opts) != base
    finally:
        torch.set_num_threads(threads)


def test_a_relative_cache_folder_stays_where_it_was_first_used(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KWKER_CACHE_DIR", "relative/records")
    first = choices.directory()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert choices.directory() == first == tmp_path / "relative" / "records"


def test_the_code_hash_skips_an_editors_lock_and_hashes_a_file_gone_as_gone(tmp_path, monkeypatch):
    """An editor's lock beside kwker's files (Emacs's `.#choices.py`, a link to
    nowhere) made every compile fail with FileNotFoundError."""
    package = tmp_path / "kwker"
    package.mkdir()
    (package / "choices.py").write_text("one")
    (package / "tune.py").write_text("two")
    monkeypatch.setattr(choices, "__file__", str(package / "choices.py"))

    def code() -> str:
        choices._kwker_code.cache_clear()
        return choices._kwker_code()

    try:
        before = code()
        (package / ".#choices.py").symlink_to("user@host.1234:1700000000")
        assert code() == before
        (package / "tune.py").write_text("three")
        edited = code()
        assert edited != before
        monkeypatch.setattr(type(package), "read_bytes", lambda path: (_ for _ in ()).throw(FileNotFoundError(path)))
        assert code() not in (before, edited)  # read as gone, not raised
    finally:
        monkeypatch.undo()
        choices._kwker_code.cache_clear()


class Checkpointed(torch.nn.Module):
    """Two of these differ only inside the checkpointed body, a graph of its
    own inside Dynamo's; with ceil_mode=True torch 2.13's Inductor gets the
    pooling's gradient wrong (pytorch#198119), which tuning catches."""

    def __init__(self, ceil_mode):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(4, 1, 1))
        self.ceil_mode = ceil_mode

    def body(self, x):
        return torch.nn.functional.avg_pool2d(torch.sigmoid(x) + x.tanh(), 3, 2, ceil_mode=self.ceil_mode)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.body, x * self.scale, use_reentrant=False)


def test_graphs_that_differ_inside_a_checkpointed_body_do_not_share_a_choice():
    x = torch.randn(2, 4, 16, 16)
    for ceil_mode in (False, True):
        model = Checkpointed(ceil_mode)
        (expected,) = torch.autograd.grad(model(x).sum(), model.scale)
        out, graph = compile_and_run(model, x)
        (grad,) = torch.autograd.grad(out.sum(), model.scale)
        assert graph.kind == "training" and not graph.recalled
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-5)


def test_nothing_is_remembered_with_inductors_caches_off():
    model, x = mlp(), torch.randn(8, 64)
    with torch.no_grad(), torch.compiler.config.patch(force_disable_caches=True):
        compile_and_run(model, x)
        _, graph = compile_and_run(model, x)
        assert choices.directory() is None
    assert not graph.recalled and records() == []


def test_what_a_users_signal_handler_raises_inside_a_candidates_compile_reaches_the_user(monkeypatch):
    """A timeout's alarm going off while Inductor compiled was taken for
    Inductor's failure: the user's exception vanished, and Inductor was left out."""
    def deadline(signum, frame):
        raise TimeoutError("a user's deadline")

    def alarmed(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(5)  # the handler runs here, in this thread

    old = signal.signal(signal.SIGUSR1, deadline)
    try:
        monkeypatch.setattr(kwker.dynamo_backend, "compile_with_inductor", alarmed)
        with torch.no_grad(), pytest.raises(Exception) as raised:
            compile_and_run(mlp(), torch.randn(8, 64))
    finally:
        signal.signal(signal.SIGUSR1, old)
    error = raised.value
    while error is not None and not isinstance(error, TimeoutError):
        error = error.__cause__ or error.__context__
    assert isinstance(error, TimeoutError), raised.value
    assert records() == []


def test_a_choice_made_with_a_candidate_left_out_by_an_error_is_not_remembered(monkeypatch):
    """An error may be the moment's: a user's signal handler raising a timeout
    inside Inductor's compile was taken for Inductor's failure, and the record
    kept Inductor out of every later process."""
    model, x = mlp(), torch.randn(8, 64)

    def interrupted(*args, **kwargs):
        raise TimeoutError("a user's deadline")

    with torch.no_grad():
        with monkeypatch.context() as patch:
            patch.setattr(kwker.dynamo_backend, "compile_with_inductor", interrupted)
            out, graph = compile_and_run(model, x)
        assert "inductor" in graph.left_out and records() == []
        torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)
        _, graph = compile_and_run(model, x)
        assert not graph.recalled and "inductor" in graph.candidates and len(records()) == 1
        _, graph = compile_and_run(model, x)
    assert graph.recalled


def test_a_choice_timed_while_other_processes_kept_the_cpus_busy_is_not_remembered(caplog):
    """Another process on the second vCPU made kwker's plan 10-50x slower in the
    tuning and Inductor was kept: in every later process, had it been remembered."""
    # Calls of tens of ms, so that the timing's windows run long enough for the spinners' share to pass the
    # counters' tick rounding: at 512 rows the rounds could end within 0.12 s (the spinners' 0.12 CPU-s under
    # 0.15), and the test failed 4 times in 6 on a 2-vCPU Xeon; at 16384, 6 passes in 6.
    model, x = mlp(), torch.randn(16384, 64)
    cpus = len(os.sched_getaffinity(0))
    spinning = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cpus)]
    try:
        time.sleep(0.5)  # the spinners past their start
        with torch.no_grad(), caplog.at_level(logging.INFO, logger="kwker"):  # warned once a process
            out, graph = compile_and_run(model, x)
    finally:
        for p in spinning:
            p.kill()
            p.wait()
    assert "other processes used" in graph.busy and records() == []
    assert "is not remembered" in caplog.text and f"not remembered: {graph.busy}" in summary.format_report()
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)
        _, graph = compile_and_run(model, x)
    assert graph.busy is None and not graph.recalled and len(records()) == 1, graph.candidates


@pytest.mark.parametrize("content", ["{not json", '{"choice": "plan", "unknown": 1}', '{"choice": "nonexistent"}',
                                     '{"choice": "eager", "candidates": "fast"}', "[1]",
                                     '{"choice": "eager", "candidates": {"eager": NaN}}',
                                     '{"choice": "eager", "candidates": {"eager": 1%s}}' % ("0" * 400),
                                     '{"choice": "eager", "candidates": {"eager": true}}', '{"choice": "eager", "fallback": ""}',
                                     '{"choice": "eager", "candidates": {"eager\\n    9  forged": 1.0}}',
                                     "[" * 20000 + "]" * 20000, '{"choice": "eager"}' + " " * (1 << 17)])
def test_a_record_that_cannot_be_read_or_built_is_tuned_again_and_replaced(content, caplog):
    model, x = mlp(), torch.randn(8, 64)
    with torch.no_grad():
        expected = model(x)
        compile_and_run(model, x)
        (name,) = records()
        (choices.directory() / name).write_text(content)
        with caplog.at_level(logging.WARNING, logger="kwker"):
            out, graph = compile_and_run(model, x)
    assert not graph.recalled and "tuned again" in caplog.text
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    assert choices.Record(**json.loads((choices.directory() / name).read_text())).choice == graph.choice


def test_a_record_path_that_is_no_regular_file_is_tuned_again_without_reading_it(caplog):
    model, x = mlp(), torch.randn(8, 64)
    with torch.no_grad():
        compile_and_run(model, x)
        (name,) = records()
        path = choices.directory() / name
        path.unlink()
        os.mkfifo(path)  # a read would wait for a writer forever
        with caplog.at_level(logging.WARNING, logger="kwker"):
            out, graph = compile_and_run(model, x)
    assert not graph.recalled and "not a regular file" in caplog.text
    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)


def test_a_choice_that_cannot_be_written_on_a_read_only_disk_is_not_remembered(monkeypatch, caplog):
    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    choices.directory().mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(os, "replace", read_only)
    monkeypatch.setattr(choices.Path, "unlink", read_only)  # removing the temporary file fails too
    with caplog.at_level(logging.WARNING, logger="kwker"):
        choices.remember("a-key", choices.Record("eager", None, {"eager": 1.0}))
    assert "could not be written" in caplog.text and records() == []


def test_a_cache_folder_that_is_a_file_is_named_so_once_a_graph(tmp_path, monkeypatch, caplog):
    """It was warned about twice a graph, first as a record that cannot be read
    (NotADirectoryError), then as a write that failed with "File exists"."""
    (tmp_path / "kwker").write_text("")
    monkeypatch.setenv("KWKER_CACHE_DIR", str(tmp_path / "kwker"))
    model, x = mlp(), torch.randn(8, 64)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="kwker"):
        out, graph = compile_and_run(model, x)
    (message,) = [r.getMessage() for r in caplog.records if "tuning choice" in r.getMessage()]
    assert "is a file, not a folder" in message and graph.kind == "tuned"
    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_record_is_readable_as_the_umask_says(umask):
    """As Inductor's cache files: a folder shared by several users (0644 under
    umask 022) serves each; a NamedTemporaryFile made every record 0600."""
    old = os.umask(umask)
    try:
        choices.remember("a-key", choices.Record("eager", None, {"eager": 1.0}))
    finally:
        os.umask(old)
    assert os.stat(choices.directory() / "a-key.json").st_mode & 0o777 == 0o666 & ~umask
    assert [p.name for p in choices.directory().iterdir()] == ["a-key.json"]  # no temporary file left


class ConvBN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


def test_a_remembered_frozen_graph_is_built_with_its_fallback():
    model, x = ConvBN().eval(), torch.randn(2, 3, 16, 16)
    gm, example_inputs = captured_graph(model, x)
    with torch.no_grad():  # grad mode is part of the key, as it is of the compile below
        key = choices.key("inference", gm, example_inputs, KwkerOptions())
    choices.remember(key, choices.Record("frozen", "inductor", {"inductor": 2.0, "eager": 3.0, "frozen": 1.0}))
    made = []
    real = kwker.dynamo_backend.FrozenGraph

    def recording(*args):
        made.append(real(*args))
        return made[-1]

    with pytest.MonkeyPatch.context() as m, torch.no_grad():
        m.setattr(kwker.dynamo_backend, "FrozenGraph", recording)
        out, graph = compile_and_run(model, x)
        expected = model(x)
    assert graph.recalled and graph.choice == "frozen" and isinstance(made[0], FrozenGraph)
    # the record's fallback, Inductor's compiled graph, not FrozenGraph's own (Dynamo's graph, run eagerly)
    assert not isinstance(made[0].fallback, torch.fx.GraphModule)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_another_process_builds_the_choice_this_one_made(tmp_path):
    program = textwrap.dedent("""
        import torch
        from kwker import summary
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 32)).eval()
        with torch.no_grad():
            torch.compile(model, backend="kwker")(torch.randn(8, 64))
        (graph,) = summary.graphs()
        print(graph.choice, graph.recalled)
    """)
    env = dict(os.environ, KWKER_CACHE_DIR=str(tmp_path / "shared"))
    runs = [subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, check=True)
            .stdout.split()[-2:] for _ in range(2)]
    assert runs[0][1] == "False" and runs[1] == [runs[0][0], "True"], runs

"""python -m kwker.run: what the launched program sees — the preloaded jemalloc
in its own memory map, torch's thread count, its CPU affinity, its arguments —
read inside the program itself, not from the launcher's own logic."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from kwker.run import JEMALLOC_CONF, find_jemalloc, parse_cpus

PROBE = textwrap.dedent("""
    import json, os, sys
    maps = open("/proc/self/maps").read()
    report = dict(argv=sys.argv[1:], jemalloc_mapped="libjemalloc" in maps, cpus=sorted(os.sched_getaffinity(0)),
                  env={k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "GOMP_SPINCOUNT", "MALLOC_CONF")})
    if "--faults" in sys.argv:  # page faults of ten 16 MiB buffers allocated, written and freed in turn
        import resource
        def cycle():
            buffer = bytearray(16 << 20)
            buffer[::4096] = bytes(len(buffer) // 4096)
        cycle()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(10):
            cycle()
        report["faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    if "--torch" in sys.argv:
        import torch
        report["torch_threads"] = torch.get_num_threads()
    print(json.dumps(report))
""")

CPUS = sorted(os.sched_getaffinity(0))


def launch(tmp_path, *options, program_args=(), user_env=None):
    """The probe's report, launched from an environment without the variables the
    launcher sets (this test run's own GOMP_SPINCOUNT, say), plus `user_env`."""
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "KMP_BLOCKTIME", "MALLOC_CONF",
                        "LD_PRELOAD")} | (user_env or {})
    out = subprocess.run([sys.executable, "-m", "kwker.run", *options, str(probe), *program_args],
                         capture_output=True, text=True, env=env, check=True)
    assert out.stderr.startswith("kwker.run: "), out.stderr
    return json.loads(out.stdout)


def test_jemalloc_is_mapped_into_the_program_with_its_conf(tmp_path):
    seen = launch(tmp_path, "--jemalloc")
    assert seen["jemalloc_mapped"]
    assert seen["env"]["MALLOC_CONF"] == JEMALLOC_CONF
    assert not launch(tmp_path)["jemalloc_mapped"]


def test_under_jemalloc_memory_freed_and_allocated_again_is_not_faulted_in_again(tmp_path):
    """16 MiB is over jemalloc's threshold for its arena of large allocations,
    whose freed pages PyTorch's tuning guide's MALLOC_CONF gave back at once
    (40970 faults for the ten here: 4096 a buffer)."""
    seen = launch(tmp_path, "--jemalloc", program_args=["--faults"])
    assert seen["jemalloc_mapped"] and seen["faults"] < 100, seen


def test_threads_set_torch_threads_and_pin_to_as_many_cpus(tmp_path):
    seen = launch(tmp_path, "--threads", "1", program_args=["--torch"])
    assert seen["torch_threads"] == 1
    assert seen["cpus"] == CPUS[:1]
    assert seen["env"]["GOMP_SPINCOUNT"] == "10000"


def test_default_is_one_thread_per_allowed_cpu(tmp_path):
    seen = launch(tmp_path, program_args=["--torch"])
    assert seen["torch_threads"] == len(CPUS)
    assert seen["cpus"] == CPUS


def test_cpus_pin_the_program(tmp_path):
    seen = launch(tmp_path, "--cpus", str(CPUS[-1]))
    assert seen["cpus"] == [CPUS[-1]]
    assert seen["env"]["OMP_NUM_THREADS"] == "1"


def test_the_environments_choices_are_kept_unless_an_option_sets_them(tmp_path):
    user_env = dict(OMP_WAIT_POLICY="passive", MALLOC_CONF="narenas:1", OMP_NUM_THREADS="7")
    seen = launch(tmp_path, "--jemalloc", user_env=user_env)
    assert seen["env"] == dict(OMP_NUM_THREADS="7", GOMP_SPINCOUNT=None, MALLOC_CONF="narenas:1")
    assert seen["jemalloc_mapped"]
    assert launch(tmp_path, "--threads", "1", user_env=user_env)["env"]["OMP_NUM_THREADS"] == "1"


def test_program_arguments_pass_untouched(tmp_path):
    args = ["--threads", "9", "-m", "--", "--help"]
    assert launch(tmp_path, "--threads", "1", program_args=args)["argv"] == args
    assert launch(tmp_path, "--", program_args=args)["argv"] == args


def test_module_form_runs_the_module():
    out = subprocess.run([sys.executable, "-m", "kwker.run", "-m", "json.tool", "--help"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.startswith("usage: python -m json.tool")


@pytest.mark.parametrize("options, message", [
    (["--cpus", "x"], "--cpus 'x': expected a list such as 0-3,6"),
    (["--cpus", "3-1"], "--cpus '3-1': expected a list"),
    (["--cpus", "100000"], "--cpus 100000: this process may only use CPUs"),
    (["--threads", "0"], "--threads 0: expected at least 1"),
    (["--thread", "2"], "unrecognized arguments: --thread"),  # not argparse's abbreviation, which split_argv misread
    ([], "name a script (or -m module) to run"),
    (["--", "-c", "print(1)"], "'-c' after --: name a script (or -m module) to run"),  # it ran as python -c
])
def test_bad_options_name_the_problem(options, message):
    out = subprocess.run([sys.executable, "-m", "kwker.run", *options] + (["x.py"] if options else []),
                         capture_output=True, text=True)
    assert out.returncode != 0
    assert message in out.stderr


def test_more_threads_than_cpus_is_warned_about_whoever_asked_for_them(tmp_path):
    (tmp_path / "nothing.py").write_text("")
    for options, threads, warning in ((["--cpus", str(CPUS[0]), "--threads", "2"], None, "--threads 2 on 1 CPUs"),
                                      (["--threads", "1"], None, None),
                                      (["--cpus", str(CPUS[0])], "16", "OMP_NUM_THREADS=16 on 1 CPUs")):
        env = {**os.environ, **({"OMP_NUM_THREADS": threads} if threads else {})}
        out = subprocess.run([sys.executable, "-m", "kwker.run", *options, str(tmp_path / "nothing.py")],
                             capture_output=True, text=True, env=env)
        assert out.returncode == 0 and ("threads share a CPU" in out.stderr) == (warning is not None), out.stderr
        assert warning is None or warning in out.stderr, out.stderr


def test_parse_cpus_reads_taskset_lists_of_allowed_cpus():
    assert parse_cpus("0-3,6", range(8)) == [0, 1, 2, 3, 6]
    assert parse_cpus("2,2,1", range(8)) == [1, 2]
    with pytest.raises(SystemExit, match="expected a list"):
        parse_cpus("0-", range(8))  # not 0 alone
    with pytest.raises(SystemExit, match="may only use CPUs"):  # refused before a range of 10^12 is counted out
        parse_cpus("0-999999999999", range(8))


def test_missing_jemalloc_says_how_to_install(tmp_path):
    with pytest.raises(SystemExit, match="apt-get install libjemalloc2"):
        find_jemalloc([str(tmp_path)])
    (tmp_path / "libjemalloc.so.2").write_bytes(b"")
    assert find_jemalloc([str(tmp_path)]) == str(tmp_path / "libjemalloc.so.2")

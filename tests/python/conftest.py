"""Fixtures the test files share."""

import threading

import pytest
import torch

from kwker import summary


@pytest.fixture
def fresh_compile_state():
    """Dynamo's caches and kwker's report empty before and after the test."""
    torch._dynamo.reset()
    summary.clear()
    yield
    torch._dynamo.reset()


def _side_by_side(work, n_threads: int = 2) -> list[str]:
    """Runs work(i) for i in range(n_threads) on as many threads at once and
    returns what they raised, as text (empty: every one ran through)."""
    errors = []

    def run(i):
        try:
            work(i)
        except Exception as e:  # noqa: BLE001 - returned to the test
            errors.append(f"thread {i}: {e!r}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


@pytest.fixture
def side_by_side():
    return _side_by_side


@pytest.fixture(autouse=True)
def own_tuning_choices(tmp_path, monkeypatch):
    """Each test remembers its tuning choices (kwker.choices) in a folder of its
    own: a choice another test made must not stand in for this one's tuning."""
    monkeypatch.setenv("KWKER_CACHE_DIR", str(tmp_path / "kwker-choices"))

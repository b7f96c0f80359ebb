"""kwker: a CPU backend for torch.compile whose core is C.

torch finds the backend through the ``torch_dynamo_backends`` entry point, so
``torch.compile(model, backend="kwker")`` needs no import. ``kwker.backend`` is
the same function, for ``torch.compile(model, backend=kwker.backend)``.
"""

__all__ = ["backend"]


def __getattr__(name):
    # Lazy, because TORCH_LOGS=kwker makes torch import this package while torch
    # itself is still being imported.
    if name == "backend":
        from kwker.backend import kwker_backend

        return kwker_backend
    raise AttributeError(f"module 'kwker' has no attribute {name!r}")

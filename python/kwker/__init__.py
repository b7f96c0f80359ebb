"""kwker: a CPU backend for torch.compile whose core is C.

torch finds the backend through the ``torch_dynamo_backends`` entry point, so
``torch.compile(model, backend="kwker")`` needs no import. ``kwker.backend`` is
the same function, for ``torch.compile(model, backend=kwker.backend)``.
"""

from importlib.metadata import version as _version

from kwker import threads as _threads

__all__ = ["__version__", "backend", "compile_config", "guard_filter", "report"]
__version__ = _version("kwker")


def compile_config(**kwargs):
    """A transformers ``CompileConfig`` for ``generate()`` with kwker's backend:

    - the backend function (kwker.backend), not the name "kwker": two threads
      looking the name up at once race in torch's registry ("duplicate name:
      kwker");
    - ``mode=None``: CompileConfig's default "reduce-overhead" would clash with
      ``options=`` (torch.compile takes one or the other); a mode given here
      becomes its Inductor settings among the options, as kwker's backend
      reads a mode;
    - ``options={"guard_filter_fn": kwker.guard_filter}``: Dynamo's guards on
      the parameters that kwker's plan checks again itself are dropped
      (kwker.guards; ``"guard_filter_fn": None`` keeps every guard); other
      options given are added to it;
    - ``_compile_all_devices``, without which generate() compiles nothing on a CPU;
    - ``fullgraph=False``, transformers' default: past Dynamo's recompile limit
      (eight variants of the step: prompt lengths, batches, sliding windows,
      chunked prefills in one process) a step then runs eagerly instead of
      raising ``FailOnRecompileLimitHit``.

    Keyword arguments override these."""
    from transformers import CompileConfig

    from kwker.guards import guard_filter

    from kwker.options import mode_patches

    options = {"guard_filter_fn": guard_filter, **mode_patches(kwargs.pop("mode", None)),
               **(kwargs.pop("options", None) or {})}
    config = CompileConfig(**{"backend": _registered_backend(), "mode": None, "fullgraph": False, "options": options,
                              **kwargs})
    config._compile_all_devices = True
    return config


def report() -> str:
    """Each graph kwker compiled in this process: kind, fallback ops, compile seconds."""
    from kwker.summary import format_report

    return format_report()


def __getattr__(name):
    # Lazy, because TORCH_LOGS=kwker makes torch import this package while torch
    # itself is still being imported.
    if name == "backend":
        return _registered_backend()
    if name == "guard_filter":
        from kwker.guards import guard_filter

        return guard_filter
    raise AttributeError(f"module 'kwker' has no attribute {name!r}")


_registry_lock = _threads.ForkSafeLock()


def _registered_backend():
    """kwker's backend function, looked up by its name in torch's registry (one
    thread at a time: two looking the name up at once race there). Registered,
    it is one of the backends after whose compile Dynamo drops its fake mode's
    weak references to the model's tensors
    (torch._dynamo.config.invalidate_compile_context_weakrefs): the function
    passed unregistered left them, and ``model.to(dtype)`` under
    ``torch.__future__.set_swap_module_params_on_conversion(True)`` then
    failed ("Couldn't swap Embedding.weight")."""
    import torch._dynamo

    with _registry_lock:
        return torch._dynamo.lookup_backend("kwker")

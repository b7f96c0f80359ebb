"""What ``mode=`` and ``options=`` mean for kwker, checked before anything compiles.

torch validates neither for a backend other than Inductor, so kwker does: its own
keys (``inner``, ``glue``) are taken out, every other key must be an Inductor
config key and is handed to Inductor, and ``mode`` goes through Inductor's own
mode table.
"""

import difflib
from dataclasses import dataclass, field
from typing import Any

INNER_CHOICES = ("eager", "inductor")

KWKER_OPTIONS_HELP = (
    "kwker's own options are 'inner' ('eager': graphs kwker does not replay run rewritten, eagerly, and "
    "training graphs eagerly as they are; 'inductor': inference graphs, decode steps too, are compiled "
    "rewritten by Inductor, training graphs by stock Inductor; absent: decode steps are replayed, other "
    "CPU inference graphs get the fastest of stock Inductor, eager, kwker's plan and (with convolutions "
    "and batch norms) Inductor with frozen weights, training graphs the faster of stock Inductor and "
    "eager, timed on their first call, and the rest go to stock Inductor) and 'glue' (bool: False keeps the model's own "
    "norm, rotary, written-out tanh GELU and gated-activation ops); every other key must be an Inductor config option (see "
    "torch._inductor.config)"
)


@dataclass(frozen=True)
class KwkerOptions:
    inner: str | None = None  # None: replay decode steps, tune other CPU graphs, stock Inductor for the rest
    glue: bool = True
    mode: str | None = None
    inductor_patches: dict[str, Any] = field(default_factory=dict)


def parse_options(mode: str | None = None, options: dict[str, Any] | None = None) -> KwkerOptions:
    """Validate ``mode`` and ``options`` and split them into kwker's and Inductor's."""
    from torch._inductor import config as inductor_config

    if options is not None and not isinstance(options, dict):
        raise ValueError(f"kwker: options must be a dict, got {type(options).__name__}. {KWKER_OPTIONS_HELP}")
    patches = dict(mode_patches(mode))
    inner, glue = None, True
    known = inductor_config.get_config_copy()
    for key, value in (options or {}).items():
        if not isinstance(key, str):
            raise ValueError(f"kwker: option keys must be strings, got {key!r}. {KWKER_OPTIONS_HELP}")
        if key == "inner":
            inner = _parse_inner(value)
        elif key == "glue":
            glue = _parse_glue(value)
        else:
            name = key.replace("-", "_")
            if name not in known:
                raise ValueError(f"kwker: unknown option {key!r}{_did_you_mean(name, known)}. {KWKER_OPTIONS_HELP}")
            _check_inductor_type(key, name, value, inductor_config)
            patches[name] = value
    return KwkerOptions(inner=inner, glue=glue, mode=mode, inductor_patches=patches)


def mode_patches(mode: str | None) -> dict[str, Any]:
    """Inductor's settings for torch.compile's mode (torch._inductor.list_mode_options)."""
    if mode is None or mode == "default":
        return {}
    from torch._inductor import list_mode_options

    if not isinstance(mode, str):
        raise ValueError(f"kwker: mode must be a string, got {mode!r}")
    try:
        return list_mode_options(mode)
    except RuntimeError as e:
        raise ValueError(f"kwker: {e}") from None


def _parse_inner(value: Any) -> str | None:
    if value is None or value in INNER_CHOICES:
        return value
    raise ValueError(f"kwker: option 'inner' must be 'eager' or 'inductor', got {value!r}. {KWKER_OPTIONS_HELP}")


def _parse_glue(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ValueError(f"kwker: option 'glue' must be True or False, got {value!r}. {KWKER_OPTIONS_HELP}")


def _check_inductor_type(key: str, name: str, value: Any, inductor_config) -> None:
    """The same type check Inductor's own wrapper makes, as a ValueError naming the key."""
    from typing import get_origin

    expected = inductor_config.get_type(name)
    if get_origin(expected) is None and isinstance(expected, type) and not isinstance(value, expected):
        raise ValueError(
            f"kwker: Inductor option {key!r} must be of type {expected.__name__}, got {type(value).__name__} ({value!r})"
        )


def _did_you_mean(name: str, known: dict[str, Any]) -> str:
    close = difflib.get_close_matches(name, list(known) + ["inner", "glue"], n=3)
    return f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""

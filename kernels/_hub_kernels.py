"""When this folder is imported as the top-level `kernels`, hand over to Hugging Face's.

Python started in the pagedllm checkout without -P has the checkout root on sys.path, so
`import kernels` (transformers imports Hugging Face's `kernels` package when it is
installed) finds this folder, which is `pagedllm_integrations.kernels` once installed.
`kernels/__init__.py` then calls `hand_over`: the import is answered with the package the
caller meant, found with the checkout root left out of the search. Without such a package
installed, the ImportError says what happened and what to do.
"""

from __future__ import annotations

import importlib
import os
import sys

CHECKOUT_ROOT = os.path.realpath(os.path.join(os.path.dirname(__file__), os.pardir))


def hand_over() -> None:
    """Replace the half-imported top-level `kernels` (this folder) in sys.modules with the
    `kernels` package found elsewhere on sys.path (the import statement returns that)."""
    ours = sys.modules.pop("kernels")
    sys.modules.pop("kernels._hub_kernels", None)
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != CHECKOUT_ROOT]
    try:
        hub = importlib.import_module("kernels")
    except ImportError as error:
        sys.modules.pop("kernels", None)
        raise ImportError(
            f"`import kernels` found pagedllm's kernels/ folder ({ours.__file__}) because "
            "Python runs with the pagedllm checkout's root on sys.path, and no other "
            "`kernels` package is installed. pagedllm's kernels are imported as "
            "`pagedllm_integrations.kernels`; run Python with -P (`python -P -m pytest ...`) "
            "or from another directory."
        ) from error
    finally:
        sys.path[:] = saved
    sys.modules["kernels"] = hub

"""podcute: fused prefill+decode (POD) paged attention for Hopper, in the CuTe DSL."""

import os as _os

# `layouts/` sits beside `podcute/` and is imported as podcute.layouts. Installs map it
# (pyproject package-dir); a source tree on sys.path (e.g. an install whose editable
# finder is not active) finds it through this extra package path entry.
_src_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_src_root, "layouts", "__init__.py")):
    __path__.append(_src_root)

from podcute.api import PODAttention, pod_attention  # noqa: E402
from podcute.plan import PlanSummary  # noqa: E402
from podcute.reference import pod_attention_reference  # noqa: E402

__all__ = ["PODAttention", "pod_attention", "pod_attention_reference", "PlanSummary"]
__version__ = "0.1.0"

"""SM90 MLA decode kernels (pure CuTe DSL + torch; never imports mlacore).

``schedule`` is pure Python/torch; cutlass is imported lazily on first compile.
"""

from .api import (  # noqa: F401
    D_QK,
    D_V,
    Schedule,
    alloc_workspace,
    check_inputs,
    get_combine_kernel,
    get_partial_kernel,
    make_schedule,
    mla_decode_sm90,
    mla_decode_sm90_balanced,
    specializations,
    workspace_bytes,
)

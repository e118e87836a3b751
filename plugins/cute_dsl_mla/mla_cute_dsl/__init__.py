"""mla-cute-dsl: the project's own Hopper (SM90) MLA decode kernels in CuTe DSL.

Kept free of heavy imports: ``mla_cute_dsl.kernels`` (CuTe DSL + torch) is
imported on demand.
"""

from mlacore.versions import version_getattr

__getattr__ = version_getattr(__name__, "mla-cute-dsl")

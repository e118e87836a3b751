"""mlacore backend plugin for FlashInfer's MLA decode kernels.

Importing this package never imports flashinfer: listing backends must stay
fast and must work where flashinfer cannot load. flashinfer is imported on
the first plan.
"""

from mlacore.versions import version_getattr

__getattr__ = version_getattr(__name__, "mla-flashinfer")

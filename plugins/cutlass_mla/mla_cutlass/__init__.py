"""mla-cutlass: NVIDIA's CUTLASS SM100 MLA decode kernel (through FlashInfer) behind mlacore's contract.

Not verified on hardware. Importing this package imports neither torch nor
flashinfer: listing backends and checking a policy stay light.
"""

from mlacore.versions import version_getattr

__getattr__ = version_getattr(__name__, "mla-cutlass")

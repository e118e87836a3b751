"""mla-cutlass: NVIDIA's CUTLASS SM100 MLA decode kernel (through FlashInfer) behind mlacore's contract.

Not verified on hardware. Importing this package imports neither torch nor
flashinfer: listing backends and checking a policy stay light.
"""

__version__ = "0.1.0"

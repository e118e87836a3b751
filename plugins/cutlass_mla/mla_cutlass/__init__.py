"""mla-cutlass: NVIDIA's CUTLASS SM100 MLA decode kernel (through FlashInfer) behind mlacore's contract.

Not verified on hardware. Importing this package imports neither torch nor
flashinfer: listing backends and checking a policy stay light.
"""


def __getattr__(name: str) -> str:
    if name == "__version__":  # one source: the installed distribution's metadata (pyproject.toml)
        from importlib import metadata

        try:
            return metadata.version("mla-cutlass")
        except metadata.PackageNotFoundError:  # a source tree that is not installed
            return "0+unknown"
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""mlacore backend plugin for FlashInfer's MLA decode kernels.

Importing this package never imports flashinfer: listing backends must stay
fast and must work where flashinfer cannot load. flashinfer is imported on
the first plan.
"""


def __getattr__(name: str) -> str:
    if name == "__version__":  # one source: the installed distribution's metadata (pyproject.toml)
        from importlib import metadata

        try:
            return metadata.version("mla-flashinfer")
        except metadata.PackageNotFoundError:  # a source tree that is not installed
            return "0+unknown"
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

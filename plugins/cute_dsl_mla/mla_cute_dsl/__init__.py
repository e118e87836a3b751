"""mla-cute-dsl: the project's own Hopper (SM90) MLA decode kernels in CuTe DSL.

Kept free of heavy imports: ``mla_cute_dsl.kernels`` (CuTe DSL + torch) is
imported on demand.
"""


def __getattr__(name: str) -> str:
    if name == "__version__":  # one source: the installed distribution's metadata (pyproject.toml)
        from importlib import metadata

        try:
            return metadata.version("mla-cute-dsl")
        except metadata.PackageNotFoundError:  # a source tree that is not installed
            return "0+unknown"
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

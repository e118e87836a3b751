"""Grids of decode problems for `mla bench` and `mla tune`: named presets and TOML files.

A grid file lists axes; every combination is one cell:

    [grid]
    num_heads  = [16, 128]
    seq_len_q  = [1, 2]
    batch      = [1, 8, 64]
    kv_len     = [1024, 4096]     # the longest request of each cell
    kv_spread  = 0.5              # lengths uniform in [kv_len*(1-spread), kv_len]; 0: all equal
    page_size  = [64]
    q_dtype    = ["bf16"]
    kv_dtype   = ["bf16", "fp8_e4m3"]
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Dict, List, Tuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..policy import PolicyError, _format_validation_error
from ..problem import DType, DecodeProblem, DeviceSpec, QDType

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class Grid(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "custom"
    num_heads: Tuple[int, ...] = (16,)
    seq_len_q: Tuple[int, ...] = (1,)
    batch: Tuple[int, ...] = (1,)
    kv_len: Tuple[int, ...] = (4096,)
    kv_spread: float = Field(default=0.0, ge=0.0, le=1.0)
    page_size: Tuple[int, ...] = (64,)
    q_dtype: Tuple[QDType, ...] = ("bf16",)
    kv_dtype: Tuple[DType, ...] = ("bf16",)

    def problems(self, device: DeviceSpec) -> List[DecodeProblem]:
        cells = []
        for h, s_q, b, n, page, qd, kvd in itertools.product(
                self.num_heads, self.seq_len_q, self.batch, self.kv_len, self.page_size, self.q_dtype,
                self.kv_dtype):
            lo = max(s_q, int(round(n * (1.0 - self.kv_spread)))) if b > 1 else n
            cells.append(DecodeProblem(num_heads=h, seq_len_q=s_q, batch_size=b, max_kv_len=n,
                                       min_kv_len=min(lo, n), page_size=page, q_dtype=qd, kv_dtype=kvd,
                                       device=device))
        return cells

    def describe(self) -> str:
        axes = self.model_dump(exclude={"name"})
        return f"{self.name}: " + " ".join(f"{k}={list(v) if isinstance(v, tuple) else v}" for k, v in axes.items())


PRESETS: Dict[str, Grid] = {
    # small enough for a CPU and the reference backend
    "quick": Grid(name="quick", num_heads=(16,), seq_len_q=(1, 2), batch=(1, 4), kv_len=(256, 1024),
                  page_size=(64,)),
    # DeepSeek-V3 at TP8: 16 heads per rank
    "tp8": Grid(name="tp8", num_heads=(16,), batch=(1, 8, 32, 64, 128), kv_len=(1024, 4096, 8192, 16384),
                kv_spread=0.0),
    # TP1: all 128 heads on one GPU
    "tp1": Grid(name="tp1", num_heads=(128,), batch=(1, 8, 32, 64, 128), kv_len=(1024, 4096, 16384)),
    # multi-token prediction / speculative verification
    "mtp": Grid(name="mtp", num_heads=(16, 128), seq_len_q=(2, 4), batch=(1, 32, 128), kv_len=(4096,)),
    # fp8 latent cache
    "fp8": Grid(name="fp8", num_heads=(16, 128), batch=(1, 32, 128), kv_len=(4096, 16384),
                kv_dtype=("bf16", "fp8_e4m3")),
}


def load_grid(spec: str) -> Grid:
    """A preset name or a path to a TOML grid file."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    if not path.is_file():
        raise PolicyError(f"--grid: {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a file")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise PolicyError(f"{spec}: not valid TOML: {err}") from None
    if set(data) != {"grid"}:
        raise PolicyError(f"{spec}: expected exactly one table [grid], got {sorted(data)}")
    try:
        return Grid.model_validate({"name": path.stem, **data["grid"]})
    except ValidationError as err:
        raise PolicyError(_format_validation_error(spec, err).replace(f"{spec}: ", f"{spec}: grid.")) from None

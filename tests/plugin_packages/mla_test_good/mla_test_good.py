"""A real plugin distribution for mlacore's tests: one entry point, two backends.

`mla_register_backends(register)` registers

* `chunked_reference`: the reference math in small chunks, with typed options
  (`chunk_tokens`). It restricts num_heads and page_size so verdict reasons
  can be tested, takes at most 65536 tokens (declared as a limit, as data),
  and is measurably slower than the reference on long sequences;
* `drops_last_token`: a wrong backend that forgets each request's last kv
  token (an off-by-one kernel), for `mla check` and `mla bench`.
"""

from typing import List

import torch
from pydantic import Field

from mlacore import Backend, BackendInfo, BackendOptions, Limits, Planned, Session, hookimpl
from mlacore.reference import mla_decode_paged

MAX_TOKENS = 65536


class ChunkedOptions(BackendOptions):
    chunk_tokens: int = Field(default=64, ge=1)


class ChunkedPlanned(Planned):
    def __init__(self, lens, table, pages, config, chunk_tokens):
        self.lens, self.table, self.pages = lens, table, pages
        self.config, self.chunk_tokens = config, chunk_tokens

    def run(self, q, kv_cache, out, lse):
        c = self.config
        mla_decode_paged(q, kv_cache, self.table, self.lens, self.pages, c.sm_scale, c.kv_scale, c.causal,
                         out, lse, c.kv_lora_rank, chunk_tokens=self.chunk_tokens)


class ChunkedSession(Session):
    def __init__(self, config, options, drop_last=False):
        self.config, self.options, self.drop_last = config, options, drop_last

    def plan(self, problem, step):
        lens = step.kv_lens
        if self.drop_last:
            lens = torch.clamp(lens - 1, min=0)
        pages = -(-problem.max_kv_len // problem.page_size)
        return ChunkedPlanned(lens, step.page_table, pages, self.config, self.options.chunk_tokens)


class ChunkedReference(Backend):
    """test backend: reference math, 64-token chunks"""

    name = "chunked_reference"
    Options = ChunkedOptions

    @hookimpl
    def info(self):
        return BackendInfo(description="test backend: reference math, 64-token chunks")

    @hookimpl
    def can_implement(self, shape, options) -> List[str]:
        reasons = []
        if shape.num_heads not in (16, 128):
            reasons.append(f"num_heads={shape.num_heads} not in {{16, 128}}")
        if shape.page_size not in (16, 64):
            reasons.append(f"page_size={shape.page_size} not in {{16, 64}}")
        return reasons

    @hookimpl
    def limits(self, shape, options):
        return Limits(max_kv_len=MAX_TOKENS, why="test backend: 64K tokens at most")

    @hookimpl
    def open(self, config, options):
        return ChunkedSession(config, options)


class DropsLastToken(Backend):
    """A wrong backend: it forgets each request's last kv token (an off-by-one kernel)."""

    name = "drops_last_token"

    @hookimpl
    def can_implement(self, shape, options) -> List[str]:
        return []

    @hookimpl
    def open(self, config, options):
        return ChunkedSession(config, ChunkedOptions(), drop_last=True)


@hookimpl
def mla_register_backends(register):
    register(ChunkedReference())
    register(DropsLastToken())

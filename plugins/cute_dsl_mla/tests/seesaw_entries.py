"""Shared by the tests that check what the seesaw host entries ask their kernel getters for: the entries called
with the getters, the launches and the balanced schedule check patched out (nothing compiles or runs), returning
the keyword arguments each call passed to its getter. Why: an entry's default call must keep its keywords (so every
existing cache key stays), and each option must reach the getter; five test files checked that with copies of the
same scaffolding."""

from __future__ import annotations

import torch


class FakeSchedule:
    """The schedule fields the entries read before their getter (the balanced entry checks that block_m gives
    its rows the 64-row tile's m-blocks; q below has 64 rows)."""

    block_m = 64
    rows = 64

    def __init__(self, wide_store: bool = False) -> None:
        self.wide_store = wide_store


def getter_keywords(monkeypatch, calls, *, wide_store: bool = False,
                    partial_dtype: torch.dtype = torch.float32) -> list[dict]:
    """Run each (balanced, kv_dtype, keywords) of `calls` through mla_decode_sm90_wgmma_seesaw[_balanced] with a
    bf16 q, check=False, a workspace of `partial_dtype` (its partial name) and a FakeSchedule(wide_store); return
    the keywords each call gave its getter, in order."""
    from mla_cute_dsl.kernels import api
    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    asked: list[dict] = []
    for name in ("get_partial_kernel_wgmma_seesaw", "get_partial_kernel_wgmma_seesaw_balanced"):
        monkeypatch.setattr(W, name, lambda *a, **kw: asked.append(kw))
    for name in ("launch", "launch_balanced", "check_balanced"):
        monkeypatch.setattr(api, name, lambda *a, **kw: None)
    q = torch.zeros(1, 1, 64, 576, dtype=torch.bfloat16)
    workspace = [torch.zeros(1, dtype=partial_dtype)]
    for balanced, kv_dtype, keywords in calls:
        entry = W.mla_decode_sm90_wgmma_seesaw_balanced if balanced else W.mla_decode_sm90_wgmma_seesaw
        entry(q, q.to(kv_dtype), None, None, 1.0, 1.0, None, None, FakeSchedule(wide_store), workspace, check=False,
              **keywords)
    return asked

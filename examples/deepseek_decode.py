"""A DeepSeek-V3 decode loop through mlacore, checked against Hugging Face transformers.

The model (random weights, built from transformers' own DeepseekV3Config and
modeling classes) is driven the way serving engines drive it:

* weight absorption: q_nope @ W_UK gives the 512-wide latent query, and the
  attention's latent output @ W_UV gives the value heads, so attention runs
  over the compressed cache alone;
* a paged latent cache per layer, [num_pages, page_size, 576] (512 latent
  after kv_a_layernorm | 64 rope key after rotary), with shuffled page ids;
* `MLADecoder.plan` once per step, `MLADecoder.run` once per layer.

The checks (see `main`): per-step logits and a 32-token greedy generation
against transformers' own forward with its cache; a tensor-parallel split of
the heads (8 ranks of 2) against the full run, with every rank choosing the
same backend; a speculative step verifying 2 tokens at once (s_q=2) against
feeding them one by one.

Run:  python examples/deepseek_decode.py [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from mlacore import Dispatcher, MLADecoder
from mlacore.policy import load_policy

PAGE_SIZE = 16


def build_model(device: str, seed: int = 0, num_layers: int = 3, num_heads: int = 16):
    """A small DeepSeek-V3 (MLA dims of the real one: 512 latent, 64 rope, 128 nope, 128 v), random weights."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
        n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=96, qk_rope_head_dim=64, v_head_dim=128,
        qk_nope_head_dim=128, max_position_embeddings=256, initializer_range=0.05,
    )
    config._attn_implementation = "eager"
    model = DeepseekV3ForCausalLM(config).to(device=device, dtype=torch.float32).eval()
    with torch.no_grad():
        # a peaked output distribution: greedy choices far from ties, so a token
        # mismatch means a real difference, not rounding
        model.lm_head.weight.mul_(8.0)
    return model


# -- the engine side -----------------------------------------------------------------


@dataclass
class Request:
    pages: List[int] = field(default_factory=list)
    length: int = 0  # tokens in the cache


class PagedLatentCache:
    """One [num_pages, page_size, 576] tensor per layer; pages handed out in shuffled order."""

    def __init__(self, num_layers: int, num_pages: int, dtype: torch.dtype, device: str, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_pages, generator=g).tolist()
        # poison: a kernel reading a slot nobody wrote shows NaN in the logits
        self.layers = [torch.full((num_pages, PAGE_SIZE, 576), float("nan"), dtype=dtype, device=device)
                       for _ in range(num_layers)]

    def reserve(self, req: Request, new_length: int) -> None:
        while len(req.pages) * PAGE_SIZE < new_length:
            req.pages.append(self.free.pop())

    def slots(self, req: Request, positions: Sequence[int]) -> List[int]:
        return [req.pages[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in positions]


class MLAEngine:
    """Runs a transformers DeepSeek-V3 model's weights with absorbed MLA over a paged latent cache."""

    def __init__(self, model, device: str, attn_dtype: torch.dtype, num_pages: int = 64,
                 dispatcher: Optional[Dispatcher] = None, seed: int = 0):
        self.model = model
        self.cfg = model.config
        self.device = device
        self.attn_dtype = attn_dtype
        self.H = self.cfg.num_attention_heads
        attn0 = model.model.layers[0].self_attn
        self.sm_scale = float(attn0.scaling)
        self.cache = PagedLatentCache(self.cfg.num_hidden_layers, num_pages, attn_dtype, device, seed)
        self.dispatcher = dispatcher or Dispatcher(policy=load_policy())
        # created once: static shape facts of this rank
        # q arrives as the engine holds it, (q_nope after W_UK, q_pe after rope): no concatenation per layer
        self.decoder = MLADecoder(self.H, PAGE_SIZE, q_dtype=attn_dtype, kv_dtype=attn_dtype, device=device,
                                  sm_scale=self.sm_scale, dispatcher=self.dispatcher, q_layout="split")
        nope, v = self.cfg.qk_nope_head_dim, self.cfg.v_head_dim
        self.w_uk, self.w_uv = [], []
        for layer in model.model.layers:
            w = layer.self_attn.kv_b_proj.weight.view(self.H, nope + v, self.cfg.kv_lora_rank)
            self.w_uk.append(w[:, :nope, :])  # [H, 128, 512]: q_nope -> latent query
            self.w_uv.append(w[:, nope:, :])  # [H, 128, 512]: latent output -> value heads
        self.requests: Dict[int, Request] = {}
        self.last_attention: Optional[Tuple] = None  # layer-0 inputs of the last step, for the TP check
        self.last_backend = ""

    def add_request(self, rid: int) -> None:
        self.requests[rid] = Request()

    @torch.no_grad()
    def forward(self, rids: Sequence[int], tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, s_q] (one row per request, appended after its cache) -> logits [B, s_q, vocab]."""
        B, s_q = tokens.shape
        reqs = [self.requests[r] for r in rids]
        positions = torch.tensor([[r.length + i for i in range(s_q)] for r in reqs], device=self.device)
        for r in reqs:
            self.cache.reserve(r, r.length + s_q)
        slots = torch.tensor([self.cache.slots(r, range(r.length, r.length + s_q)) for r in reqs],
                             device=self.device)
        for r in reqs:
            r.length += s_q
        width = max(len(r.pages) for r in reqs)
        table = torch.tensor([r.pages + [0] * (width - len(r.pages)) for r in reqs], dtype=torch.int32)
        lens = torch.tensor([r.length for r in reqs], dtype=torch.int32)
        # once per step: host-side planning shared by every layer
        plan = self.decoder.plan(lens.to(self.device), table.to(self.device), seq_len_q=s_q,
                                 kv_lens_host=lens, page_table_host=table)
        self.last_backend = plan.backend

        m = self.model.model
        h = m.embed_tokens(tokens)
        cos, sin = m.rotary_emb(h, positions)
        for li, layer in enumerate(m.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            if attn.q_lora_rank is None:
                q = attn.q_proj(x)
            else:
                q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
            q = q.view(B, s_q, self.H, -1).transpose(1, 2)  # [B, H, s_q, 192]
            q_nope, q_rot = q.split([self.cfg.qk_nope_head_dim, self.cfg.qk_rope_head_dim], dim=-1)
            ckv = attn.kv_a_proj_with_mqa(x)
            latent, k_rot = ckv.split([self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim], dim=-1)
            latent = attn.kv_a_layernorm(latent)
            k_rot = k_rot.view(B, 1, s_q, -1)
            q_rot, k_rot = _rotary(self.cfg)(q_rot, k_rot, cos, sin)
            # append this step's latents to the paged cache (lengths already include them)
            cache = self.cache.layers[li]
            new = torch.cat([latent, k_rot.view(B, s_q, -1)], dim=-1).to(self.attn_dtype)
            cache.view(-1, 576)[slots.reshape(-1)] = new.reshape(-1, 576)
            # absorb W_UK into the query: q_nope [B, s_q, H, 512] (a strided view is fine), q_pe [B, s_q, H, 64]
            q_latent = torch.einsum("bhsd,hdc->bshc", q_nope, self.w_uk[li]).to(self.attn_dtype)
            q_pe = q_rot.transpose(1, 2).to(self.attn_dtype)
            if li == 0:  # the packed form, for the tensor-parallel check's own decoders
                self.last_attention = (torch.cat([q_latent, q_pe], dim=-1).contiguous(), cache, lens, table, s_q)
            # once per layer
            out, _ = self.decoder.run((q_latent, q_pe), cache, plan)
            v = torch.einsum("bshc,hdc->bshd", out.float(), self.w_uv[li]).reshape(B, s_q, -1)
            h = h + attn.o_proj(v)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.lm_head(m.norm(h))


def _rotary(cfg):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as mod

    return mod.apply_rotary_pos_emb_interleave if cfg.rope_interleave else mod.apply_rotary_pos_emb


# -- transformers' own forward ----------------------------------------------------------


@torch.no_grad()
def hf_greedy(model, prompt: List[int], steps: int, device: str) -> Tuple[List[int], List[torch.Tensor]]:
    """Prompt then `steps` greedy tokens with transformers' forward and its cache; logits per step."""
    import inspect

    # transformers renamed past_key_values to cache (5.2x); take whichever this version has
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = torch.tensor([prompt], device=device)
    out = model(input_ids=ids, use_cache=True)
    past, logits = out.past_key_values, [out.logits[0, -1]]
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(steps - 1):
        out = model(input_ids=torch.tensor([[tokens[-1]]], device=device), use_cache=True, **{cache_kw: past})
        past = out.past_key_values
        logits.append(out.logits[0, -1])
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens, logits


def engine_greedy(engine: MLAEngine, prompts: List[List[int]], steps: int) -> Tuple[List[List[int]], List[List[torch.Tensor]]]:
    """Prefill each request alone (s_q = prompt length, causal), then decode the batch together."""
    tokens: List[List[int]] = []
    logits: List[List[torch.Tensor]] = []
    for rid, prompt in enumerate(prompts):
        engine.add_request(rid)
        lg = engine.forward([rid], torch.tensor([prompt], device=engine.device))
        tokens.append([int(lg[0, -1].argmax())])
        logits.append([lg[0, -1]])
    rids = list(range(len(prompts)))
    for _ in range(steps - 1):
        lg = engine.forward(rids, torch.tensor([[t[-1]] for t in tokens], device=engine.device))
        for rid in rids:
            tokens[rid].append(int(lg[rid, 0].argmax()))
            logits[rid].append(lg[rid, 0])
    return tokens, logits


# -- the checks ----------------------------------------------------------------------------


@dataclass
class Report:
    tokens_equal: bool
    max_logit_diff: float
    logit_scale: float
    tp_max_diff: float
    tp_backends: List[str]
    spec_max_diff: float
    backend: str

    def lines(self) -> List[str]:
        return [
            f"backend chosen by the policy: {self.backend}",
            f"greedy tokens identical to transformers: {self.tokens_equal}",
            f"max |logit diff| over every step: {self.max_logit_diff:.3e} (logit std {self.logit_scale:.2f})",
            f"tensor parallel 8x2 heads vs full: max diff {self.tp_max_diff:.3e}; rank backends {self.tp_backends}",
            f"speculative s_q=2 vs one by one: max logit diff {self.spec_max_diff:.3e}",
        ]


def tensor_parallel_check(engine: MLAEngine, ranks: int = 8) -> Tuple[float, List[str]]:
    """Split the last step's layer-0 attention over `ranks` decoders of H/ranks heads each."""
    q, cache, lens, table, s_q = engine.last_attention
    dev = engine.device
    full_plan = engine.decoder.plan(lens.to(dev), table.to(dev), s_q, kv_lens_host=lens, page_table_host=table)
    full, _ = engine.decoder.run((q[..., :512], q[..., 512:]), cache, full_plan)
    per = engine.H // ranks
    parts, chosen = [], []
    for r in range(ranks):
        # each rank builds its own decoder from the same policy file, as separate processes would
        dec = MLADecoder(per, PAGE_SIZE, q_dtype=engine.attn_dtype, kv_dtype=engine.attn_dtype, device=dev,
                         sm_scale=engine.sm_scale, dispatcher=Dispatcher(policy=engine.dispatcher.policy))
        plan = dec.plan(lens.to(dev), table.to(dev), s_q, kv_lens_host=lens, page_table_host=table)
        out, _ = dec.run(q[:, :, r * per:(r + 1) * per].contiguous(), cache, plan)
        parts.append(out)
        chosen.append(plan.backend)
    return float((torch.cat(parts, dim=2).float() - full.float()).abs().max()), chosen


def speculative_check(model, device: str, attn_dtype: torch.dtype, prompt: List[int], drafts: List[int]) -> float:
    """Verify 2 draft tokens in one s_q=2 step; compare with feeding them one at a time."""
    a = MLAEngine(model, device, attn_dtype, seed=1)
    b = MLAEngine(model, device, attn_dtype, seed=2)  # other page ids: the answer must not depend on them
    for e in (a, b):
        e.add_request(0)
        e.forward([0], torch.tensor([prompt], device=device))
    both = a.forward([0], torch.tensor([drafts], device=device))[0]
    one = b.forward([0], torch.tensor([[drafts[0]]], device=device))[0, 0]
    two = b.forward([0], torch.tensor([[drafts[1]]], device=device))[0, 0]
    return float(torch.maximum((both[0] - one).abs().max(), (both[1] - two).abs().max()))


def run_checks(device: str = "cpu", steps: int = 32, seed: int = 0) -> Report:
    attn_dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = build_model(device, seed)
    g = torch.Generator().manual_seed(seed + 100)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (5, 9)]
    engine = MLAEngine(model, device, attn_dtype, seed=seed)
    eng_tokens, eng_logits = engine_greedy(engine, prompts, steps)
    max_diff, equal, scale = 0.0, True, 0.0
    for rid, prompt in enumerate(prompts):
        hf_tokens, hf_logits = hf_greedy(model, prompt, steps, device)
        equal &= hf_tokens == eng_tokens[rid]
        for a, b in zip(hf_logits, eng_logits[rid]):
            max_diff = max(max_diff, float((a - b).abs().max()))
            scale = max(scale, float(a.std()))
    tp_diff, tp_backends = tensor_parallel_check(engine)
    spec = speculative_check(model, device, attn_dtype, prompts[0], eng_tokens[0][:2])
    return Report(equal, max_diff, scale, tp_diff, tp_backends, spec, engine.last_backend)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args(argv)
    report = run_checks(args.device, args.steps)
    for line in report.lines():
        print(line)
    ok = report.tokens_equal and len(set(report.tp_backends)) == 1
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

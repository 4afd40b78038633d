"""fp8 KV cache: torch float8 storage, the checkpoint's k/v scales, dequantized inside attention.

* Greedy outputs with fp8_e4m3 / fp8_e5m2 KV stay within top-5 agreement of the bf16-KV outputs
  (where the tokens differ, each side's token is in the other's top-5, and comparison stops).
* KV bytes per token (and the page) halve against bf16; state bytes are unchanged.
* The loader accepts the checkpoint names HF / vLLM / ModelOpt / compressed-tensors use for the
  scales, and the pool's K/V hold value / scale.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridserve import LLM, SamplingParams
from tests.checkpoints import make
from tests.prefix_utils import released_everything

PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)


def _prompts(n: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(7)
    return [{"prompt_token_ids": torch.randint(3, 128, (length,), generator=g).tolist()}
            for length in (5, 23, 41)[:n]]


def _generate(path: str, **options):
    llm = LLM(path, cache_memory="8MiB", **options)
    outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
    assert released_everything(llm.engine)
    return llm, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _top5_agreement(ours, ref) -> int:
    """Tokens compared before the first divergence (summed); a divergence must be a near-tie."""
    compared = 0
    for (toks, lps), (ref_toks, ref_lps) in zip(ours, ref):
        for t, (a, b) in enumerate(zip(toks, ref_toks)):
            if a != b:
                assert a in ref_lps[t] and ref_lps[t][a].rank <= 5, f"fp8 token {a} not in bf16 top-5 at {t}"
                assert b in lps[t] and lps[t][b].rank <= 5, f"bf16 token {b} not in fp8 top-5 at {t}"
                break
            compared += 1
    return compared


@pytest.mark.parametrize("family", ["llama", "bamba"])
def test_fp8_kv_agrees_with_bf16_kv_and_halves_kv_bytes(ckpt_dir, family):
    path = make(ckpt_dir, family, dtype=torch.bfloat16)
    bf16, ref = _generate(path)
    base = bf16.cache_layout()
    assert base["kv_cache_dtype"] == "bfloat16"
    for kv in ("fp8_e4m3", "fp8_e5m2"):
        llm, ours = _generate(path, kv_cache_dtype=kv)
        layout = llm.cache_layout()
        assert 2 * layout["kv_bytes_per_token"] == base["kv_bytes_per_token"]
        assert 2 * layout["page_bytes"] == base["page_bytes"]
        assert layout["state_bytes_per_sequence"] == base["state_bytes_per_sequence"]
        want = torch.float8_e4m3fn if kv == "fp8_e4m3" else torch.float8_e5m2
        for entry in layout["layers"]:
            if any(t["name"] == "k" for t in entry["tensors"]):
                cache = llm.engine.pool.layer_caches[entry["index"]]
                assert cache.k.dtype == want and cache.v.dtype == want
                assert cache.k_scale == 1.0 and cache.v_scale == 1.0  # the checkpoint has no scales
        assert _top5_agreement(ours, ref) >= 10, kv


SCALE_NAMES = {
    "compressed-tensors": ("{attn}.k_scale", "{attn}.v_scale"),
    "modelopt": ("{attn}.k_proj.k_scale", "{attn}.v_proj.v_scale"),
    "output_scale": ("{attn}.k_proj.output_scale", "{attn}.v_proj.output_scale"),
    "vllm-attn": ("{attn}.attn.k_scale", "{attn}.attn.v_scale"),
    "kv_scale": ("{attn}.kv_scale", None),
}


def _with_scales(src: str, dst: str, style: str, k_scale: float, v_scale: float, extra: dict | None = None) -> str:
    """Copy checkpoint ``src`` to ``dst`` with k/v scale tensors for every attention layer added."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
                g.write(f.read())
    weights = load_file(os.path.join(src, "model.safetensors"))
    k_name, v_name = SCALE_NAMES[style]
    for key in [k for k in weights if k.endswith("self_attn.k_proj.weight")]:
        attn = key.removesuffix(".k_proj.weight")
        weights[k_name.format(attn=attn)] = torch.tensor(k_scale)
        if v_name is not None:
            weights[v_name.format(attn=attn)] = torch.tensor([v_scale])
    weights.update(extra or {})
    save_file(weights, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("style", list(SCALE_NAMES))
def test_loader_accepts_checkpoint_kv_scales(ckpt_dir, tmp_path, style):
    from hybridserve.cache.spec import CacheDtypes
    from hybridserve.models.loader import build_model, load_hf_config

    path = _with_scales(make(ckpt_dir, "llama", dtype=torch.bfloat16), str(tmp_path / style), style, 0.5, 0.25)
    dt = CacheDtypes(torch.float8_e4m3fn, torch.bfloat16, torch.bfloat16)
    model = build_model(path, load_hf_config(path), torch.bfloat16, dt, torch.device("cpu"))
    attn = [m for m in model.modules() if getattr(getattr(m, "spec", None), "attention", None) is not None]
    assert attn
    for m in attn:
        assert m.k_scale == 0.5
        assert m.v_scale == (0.5 if style == "kv_scale" else 0.25)


def test_kv_scale_of_a_non_attention_module_is_still_an_error(ckpt_dir, tmp_path):
    src = make(ckpt_dir, "llama", dtype=torch.bfloat16)
    path = _with_scales(src, str(tmp_path / "bad"), "compressed-tensors", 0.5, 0.5,
                        extra={"model.layers.0.mlp.k_scale": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="mlp.k_scale"):
        LLM(path, kv_cache_dtype="fp8_e4m3", cache_memory="8MiB")


def _prompt_kv(llm: LLM, ids: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill ``ids`` alone; the stored (raw, still scaled) K and V of every prompt position at ``layer``."""
    engine = llm.engine
    engine.add_request("probe", ids, SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    seq = engine.scheduler.running[0]
    bs = engine.layout.block_size
    pages = torch.tensor([seq.block_table[p // bs] for p in range(len(ids))])
    offsets = torch.arange(len(ids)) % bs
    cache = engine.pool.layer_caches[layer]
    k, v = cache.k[pages, offsets].float(), cache.v[pages, offsets].float()  # (L, Hkv, Dh)
    engine.abort_request("probe")
    return k, v


def test_checkpoint_scales_are_used_by_the_fp8_cache(ckpt_dir, tmp_path):
    src = make(ckpt_dir, "bamba", dtype=torch.bfloat16)
    path = _with_scales(src, str(tmp_path / "scaled"), "compressed-tensors", 0.5, 2.0)
    _, ref = _generate(src)
    scaled, ours = _generate(path, kv_cache_dtype="fp8_e4m3")
    unscaled = LLM(src, kv_cache_dtype="fp8_e4m3", cache_memory="8MiB")
    first = min(i for i, c in scaled.engine.pool.layer_caches.items() if c.k is not None)
    for cache in scaled.engine.pool.layer_caches.values():
        if cache.k is not None:
            assert (cache.k_scale, cache.v_scale) == (0.5, 2.0)
    # the first attention layer's K/V do not depend on the KV cache: stored = value / scale, so the
    # scaled cache holds the unscaled one's values times 2 (K) and times 1/2 (V), fp8 rounding aside
    ids = _prompts(1)[0]["prompt_token_ids"]
    k, v = _prompt_kv(scaled, ids, first)
    k_plain, v_plain = _prompt_kv(unscaled, ids, first)
    assert k.abs().max() > 0 and v.abs().max() > 0
    torch.testing.assert_close(k * 0.5, k_plain, rtol=0.07, atol=0.01)
    torch.testing.assert_close(v * 2.0, v_plain, rtol=0.07, atol=0.01)
    # outputs through the scaled cache still agree with bf16 KV
    assert _top5_agreement(ours, ref) >= 10
    # a bf16 KV cache stores values unscaled whatever the checkpoint says
    bf16 = LLM(path, cache_memory="8MiB")
    assert all(c.k_scale == 1.0 and c.v_scale == 1.0 for c in bf16.engine.pool.layer_caches.values())


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float16])
def test_attention_ignores_nan_bytes_past_the_context(kv_dtype):
    """Pages are carved from a pool shared with state: bytes past a sequence's length (the rest of its
    last page, padding entries of the block table) may read as NaN in the KV dtype."""
    from hybridserve.ops.paged_attention import paged_attention, paged_attention_ref, write_kv_cache

    g = torch.Generator().manual_seed(0)
    raw = torch.full((2 * 3 * 8 * 2 * 4 * 2,), 0xFF, dtype=torch.uint8)  # 0xFF: NaN in fp8 and fp16
    k_cache, v_cache = raw.view(kv_dtype).view(2, 3, 8, 2, -1).unbind(0)  # (3 pages, 8 tokens, 2 heads, Dh)
    assert torch.isnan(k_cache.float()).all()
    lens = [5, 11]
    tables = torch.tensor([[2, 0], [1, 2]])  # sequence 0 uses one page; its second entry is padding
    slots = torch.tensor([2 * 8 + p for p in range(5)] + [tables[1, p // 8] * 8 + p % 8 for p in range(11)])
    k = torch.randn(16, 2, k_cache.shape[-1], generator=g)
    v = torch.randn(16, 2, k_cache.shape[-1], generator=g)
    write_kv_cache(k, v, k_cache, v_cache, slots, 1.0, 1.0)
    for cu in ([0, 1, 2], [0, 5, 16]):  # decode (one query each), then prefill of every position
        q = torch.randn(cu[-1], 4, k_cache.shape[-1], generator=g)
        args = (q, k_cache, v_cache, tables, torch.tensor(lens), torch.tensor(cu), 0.5, 1.0, 1.0)
        out = paged_attention(*args)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, paged_attention_ref(*args))

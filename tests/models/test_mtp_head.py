"""Multi-token-prediction heads (``models/mtp.py``): loading, cache specs, and the forward over a CachePool.

The head runs over the same pool as its target (a layout of the target's specs and the head's), through a
prefill step of two sequences and then a step mixing one sequence's decode with the other's next prefill
chunk (so its attention reads the KV the first step wrote). Every row is compared with a plain-PyTorch
reference written here from the checkpoint's tensors alone (zero-centered norms, the fusing projection,
causal attention with the family's gated query, q/k norms and partial RoPE, the MoE), in float32.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from hybridserve.cache.layout import compute_layout
from hybridserve.cache.pool import CachePool
from hybridserve.cache.spec import CacheDtypes
from hybridserve.forward_batch import ForwardBatch, SeqGroup
from hybridserve.models.base import merge_specs
from hybridserve.models.loader import build_model, load_hf_config
from hybridserve.models.mtp import build_mtp_head, mtp_layer_count
from tests.checkpoints import add_mtp_weights, make

F32 = torch.float32
CPU = torch.device("cpu")
DTYPES = CacheDtypes(F32, F32, F32)
BLOCK = 4
# (step 1 prefill length, step 2 tokens) per sequence: A decodes one token in step 2, B prefills 3 more
PLAN = ((6, 1), (9, 3))
FAMILIES = ["qwen3_next", "qwen3_5", "qwen3_5_moe_vl", "nemotron_h_latent"]


# ------------------------------------------------------------------------------------------------ reference
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """x (..., D) normalized over D, times (1 + w) zero-centered, else times w."""
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * (1.0 + w) if zero_centered else x * w


def _rope(x: torch.Tensor, pos: torch.Tensor, rot: int, theta: float) -> torch.Tensor:
    """HF half-rotation RoPE on the first ``rot`` features of x (T, H, D)."""
    inv = 1.0 / theta ** (torch.arange(0, rot, 2, dtype=F32) / rot)  # (rot/2,)
    f = pos.to(F32)[:, None] * inv  # (T, rot/2)
    cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]  # (T, 1, rot)
    xr, xp = x[..., :rot], x[..., rot:]
    rotated = torch.cat([-xr[..., rot // 2:], xr[..., :rot // 2]], -1)
    return torch.cat([xr * cos + rotated * sin, xp], -1)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q (T, Hq, D), k/v (T, Hkv, D) of one sequence from position 0 -> (T, Hq, D)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # (T, Hq, D)
    scores = torch.einsum("thd,shd->hts", q, k) * q.shape[-1] ** -0.5  # (Hq, T, T)
    t = q.shape[0]
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


def _silu_mlp(x, w, p):
    return (torch.nn.functional.silu(x @ w[p + "gate_proj.weight"].T) * (x @ w[p + "up_proj.weight"].T)) \
        @ w[p + "down_proj.weight"].T


def _qwen_reference(w: dict, cfg: dict, ids: torch.Tensor, hidden: torch.Tensor, module: int) -> torch.Tensor:
    """One sequence from position 0: ids (T,) the tokens at p + 1, hidden (T, H) -> (T, H)."""
    eps, h = cfg["rms_norm_eps"], cfg["hidden_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dh = cfg.get("head_dim") or h // heads
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rot = int(dh * rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    emb_key = next(k for k in ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight") if k in w)
    e = w[emb_key][ids]  # (T, H)
    x = torch.cat([_rms(e, w["mtp.pre_fc_norm_embedding.weight"], eps, True),
                   _rms(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps, True)], -1) @ w["mtp.fc.weight"].T
    p = f"mtp.layers.{module}."
    t, pos = x.shape[0], torch.arange(x.shape[0])
    a = _rms(x, w[p + "input_layernorm.weight"], eps, True)
    qg = (a @ w[p + "self_attn.q_proj.weight"].T).view(t, heads, 2 * dh)
    q, gate = qg[..., :dh], qg[..., dh:]  # (T, Hq, Dh) each
    k = (a @ w[p + "self_attn.k_proj.weight"].T).view(t, kv_heads, dh)
    v = (a @ w[p + "self_attn.v_proj.weight"].T).view(t, kv_heads, dh)
    q = _rope(_rms(q, w[p + "self_attn.q_norm.weight"], eps, True), pos, rot, theta)
    k = _rope(_rms(k, w[p + "self_attn.k_norm.weight"], eps, True), pos, rot, theta)
    att = _causal_attention(q, k, v) * torch.sigmoid(gate)  # (T, Hq, Dh)
    x = x + att.reshape(t, heads * dh) @ w[p + "self_attn.o_proj.weight"].T
    m = _rms(x, w[p + "post_attention_layernorm.weight"], eps, True)
    if p + "mlp.gate.weight" in w:  # the MoE: softmax top-k (renormalized), sigmoid-gated shared expert
        probs = (m @ w[p + "mlp.gate.weight"].T).softmax(-1)  # (T, E)
        top, idx = probs.topk(cfg["num_experts_per_tok"], -1)
        if cfg.get("norm_topk_prob", True):
            top = top / top.sum(-1, keepdim=True)
        routed = torch.zeros_like(m)
        for j in range(idx.shape[1]):
            for r in range(t):
                routed[r] += top[r, j] * _silu_mlp(m[r], w, f"{p}mlp.experts.{int(idx[r, j])}.")
        shared = torch.sigmoid(m @ w[p + "mlp.shared_expert_gate.weight"].T) * _silu_mlp(m, w, p + "mlp.shared_expert.")
        x = x + routed + shared
    else:
        x = x + _silu_mlp(m, w, p + "mlp.")
    return _rms(x, w["mtp.norm.weight"], eps, True)


def _relu2_mlp(x, w, p):
    return torch.relu(x @ w[p + "up_proj.weight"].T).square() @ w[p + "down_proj.weight"].T


def _nemotron_moe(x: torch.Tensor, w: dict, cfg: dict, p: str) -> torch.Tensor:
    """Grouped sigmoid routing with correction bias, relu^2 experts through the latent, plus the shared expert."""
    t, e_num = x.shape[0], cfg["n_routed_experts"]
    scores = (x @ w[p + "gate.weight"].T).sigmoid()  # (T, E)
    choice = scores + w[p + "gate.e_score_correction_bias"]
    groups = choice.view(t, cfg["n_group"], -1)  # (T, G, E/G)
    best = groups.topk(2, -1)[0].sum(-1).topk(cfg["topk_group"], -1)[1]  # (T, topk_group)
    keep = torch.zeros(t, cfg["n_group"], dtype=torch.bool).scatter_(1, best, True)
    choice = choice.masked_fill(~keep[:, :, None].expand_as(groups).reshape(t, e_num), float("-inf"))
    idx = choice.topk(cfg["num_experts_per_tok"], -1)[1]  # (T, k)
    weight = scores.gather(1, idx)
    if cfg.get("norm_topk_prob"):
        weight = weight / (weight.sum(-1, keepdim=True) + 1e-20)
    weight = weight * cfg["routed_scaling_factor"]
    latent = p + "fc1_latent_proj.weight" in w
    xin = x @ w[p + "fc1_latent_proj.weight"].T if latent else x
    routed = torch.zeros_like(xin)
    for j in range(idx.shape[1]):
        for r in range(t):
            routed[r] += weight[r, j] * _relu2_mlp(xin[r], w, f"{p}experts.{int(idx[r, j])}.")
    if latent:
        routed = routed @ w[p + "fc2_latent_proj.weight"].T
    return routed + _relu2_mlp(x, w, p + "shared_experts.")


def _nemotron_reference(w: dict, cfg: dict, ids: torch.Tensor, hidden: torch.Tensor, module: int) -> torch.Tensor:
    """Nemotron-H's MTP module ``module`` (attention then MoE blocks) over one sequence -> (T, H)."""
    eps = cfg["layer_norm_epsilon"]
    heads, kv_heads, dh = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    kinds = cfg["mtp_layers_block_type"]
    t = ids.shape[0]
    base = module * len(kinds)
    p0 = f"mtp.layers.{base}."
    e = w["backbone.embeddings.weight"][ids]
    x = torch.cat([_rms(e, w[p0 + "enorm.weight"], eps, False), _rms(hidden, w[p0 + "hnorm.weight"], eps, False)],
                  -1) @ w[p0 + "eh_proj.weight"].T
    for j, kind in enumerate(kinds):
        p = f"mtp.layers.{base + j}."
        a = _rms(x, w[p + "norm.weight"], eps, False)
        if kind == "full_attention":  # no RoPE, no q/k norms
            q = (a @ w[p + "mixer.q_proj.weight"].T).view(t, heads, dh)
            k = (a @ w[p + "mixer.k_proj.weight"].T).view(t, kv_heads, dh)
            v = (a @ w[p + "mixer.v_proj.weight"].T).view(t, kv_heads, dh)
            x = x + _causal_attention(q, k, v).reshape(t, heads * dh) @ w[p + "mixer.o_proj.weight"].T
        else:
            x = x + _nemotron_moe(a, w, cfg, p + "mixer.")
    return _rms(x, w[f"mtp.layers.{base + len(kinds) - 1}.final_layernorm.weight"], eps, False)


def _reference(path: str, ids: torch.Tensor, hidden: torch.Tensor, module: int) -> torch.Tensor:
    with open(os.path.join(path, "config.json")) as f:
        outer = json.load(f)
    cfg = outer.get("text_config") or outer
    w = {n: t.float() for n, t in load_file(os.path.join(path, "model.safetensors")).items()}
    if outer["model_type"] == "nemotron_h":
        return _nemotron_reference(w, cfg, ids, hidden, module)
    return _qwen_reference(w, cfg, ids, hidden, module)


# ------------------------------------------------------------------------------------------- pool and batch
def _load(path: str, first_layer_index: int | None = None):
    cfg = load_hf_config(path)
    target = build_model(path, cfg, F32, DTYPES, CPU)
    first = max(s.index for s in target.cache_specs()) + 1 if first_layer_index is None else first_layer_index
    return cfg, target, build_mtp_head(path, cfg, target, F32, DTYPES, CPU, first)


def _pool(target, head) -> CachePool:
    layout = compute_layout(merge_specs(target.cache_specs() + head.cache_specs()), BLOCK)
    return CachePool(layout, 16 * layout.page_bytes + 4 * layout.slot_bytes + 4096, CPU)


def _group(rows: list[tuple[int, int]], start: int, tables, slots) -> SeqGroup:
    """rows: (first position, tokens) per sequence -> a SeqGroup whose tokens start at ``start``."""
    cu = [0]
    for _, n in rows:
        cu.append(cu[-1] + n)
    i64 = dict(dtype=torch.int64)
    return SeqGroup(start, start + cu[-1], torch.tensor(cu, **i64), torch.tensor([p + n for p, n in rows], **i64),
                    tables, slots)


def _run_steps(path: str, step: int):
    """Two steps of target then head over one pool (PLAN); returns, per sequence, (head outputs, next-token
    ids, target hidden states) over all its positions in order, and the head."""
    _, target, head = _load(path)
    pool = _pool(target, head)
    total = [a + b for a, b in PLAN]
    g = torch.Generator().manual_seed(7)
    tokens = [torch.randint(3, 128, (n + 1,), generator=g) for n in total]  # the head's row p reads token p + 1
    got = [pool.allocate(-(-n // BLOCK), 1 if pool.layout.has_state else 0) for n in total]
    width = max(len(a.pages) for a in got)
    tables = torch.tensor([a.pages + [0] * (width - len(a.pages)) for a in got], dtype=torch.int64)  # (2, width)
    slots = torch.tensor([a.slots[0] for a in got], dtype=torch.int64) if pool.layout.has_state else None
    outs: list[list[torch.Tensor]] = [[], []]
    hiddens: list[list[torch.Tensor]] = [[], []]
    # step 1: both sequences prefill from 0; step 2: A decodes one token (the decode group comes first), B
    # prefills its next chunk. Each entry: (sequence, first position, tokens)
    for decodes, prefills in [([], [(0, 0, PLAN[0][0]), (1, 0, PLAN[1][0])]),
                              ([(0, PLAN[0][0], PLAN[0][1])], [(1, PLAN[1][0], PLAN[1][1])])]:
        rows = decodes + prefills
        spans = [torch.arange(p, p + n) for _, p, n in rows]
        ids = torch.cat([tokens[i][pos] for (i, _, _), pos in zip(rows, spans)])  # (T,)
        nxt = torch.cat([tokens[i][pos + 1] for (i, _, _), pos in zip(rows, spans)])  # (T,)
        positions = torch.cat(spans)  # (T,)
        slot_mapping = torch.cat([tables[i][pos // BLOCK] * BLOCK + pos % BLOCK for (i, _, _), pos in zip(rows, spans)])

        def group(items, start):
            if not items:
                return None
            pick = torch.tensor([i for i, _, _ in items])
            return _group([(p, n) for _, p, n in items], start, tables[pick], None if slots is None else slots[pick])

        batch = ForwardBatch(slot_mapping, group(decodes, 0), group(prefills, sum(n for _, _, n in decodes)),
                             pool.layer_caches)
        with torch.inference_mode():
            hidden = target(ids, positions, batch)  # (T, H)
            out = head(nxt, positions, hidden, batch, step=step)  # (T, H)
        assert out.shape == hidden.shape and out.dtype == F32
        start = 0
        for i, _, n in rows:
            outs[i].append(out[start:start + n])
            hiddens[i].append(hidden[start:start + n])
            start += n
    return [(torch.cat(outs[i]), tokens[i][1:], torch.cat(hiddens[i])) for i in range(2)], head


# ------------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("step", [0, 3])
def test_head_matches_reference_through_the_pool(ckpt_dir, family, step):
    """Prefill of two sequences, then a decode beside a prefill chunk: every row equals the reference; step 3
    of a two-module head runs module 1 (``step % num_layers``)."""
    path = add_mtp_weights(make(ckpt_dir, family), num_layers=2, seed=1)
    seqs, head = _run_steps(path, step)
    assert head.num_layers == 2 and head.layer_for(step) == step % 2
    for out, nxt, hidden in seqs:
        ref = _reference(path, nxt, hidden, step % 2)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    # the other module gives other outputs: the step really picks the module
    other = _reference(path, seqs[1][1], seqs[1][2], 1 - step % 2)
    assert (other - seqs[1][0]).abs().max() > 1e-2


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_specs_indices_and_sharing(ckpt_dir, family):
    path = add_mtp_weights(make(ckpt_dir, family), num_layers=2, seed=1)
    cfg, target, head = _load(path, first_layer_index=10)
    specs = head.cache_specs()
    assert [s.index for s in specs] == [10, 11] and all(s.attention is not None for s in specs)
    attn = [m for m in head.modules() if hasattr(m, "layer_index") and getattr(m, "spec", None) is not None]
    assert sorted(m.layer_index for m in attn) == [10, 11] and all(m.spec.index == m.layer_index for m in attn)
    embed = target.model.embed_tokens if family == "qwen3_next" else target.model.embeddings
    shared = head.embed_tokens if family == "qwen3_next" else head.embeddings
    assert shared is embed and shared.weight.data_ptr() == embed.weight.data_ptr()
    assert {s.index for s in target.cache_specs()}.isdisjoint({s.index for s in specs})
    assert mtp_layer_count(cfg) == 2
    hidden = torch.randn(3, cfg.hidden_size)
    torch.testing.assert_close(head.compute_logits(hidden), target.compute_logits(hidden))
    with pytest.raises(ValueError, match="collide"):
        _load(path, first_layer_index=1)


def test_checkpoint_without_mtp_weights_raises(ckpt_dir, tmp_path):
    plain = make(ckpt_dir, "qwen3_next")
    cfg = load_hf_config(plain)
    assert mtp_layer_count(cfg) == 0
    target = build_model(plain, cfg, F32, DTYPES, CPU)
    with pytest.raises(ValueError, match="declares no MTP layers.*mtp_num_hidden_layers"):
        build_mtp_head(plain, cfg, target, F32, DTYPES, CPU, 4)
    # the config declares MTP layers, the safetensors hold none
    declared = str(tmp_path / "declared")
    shutil.copytree(plain, declared)
    with open(os.path.join(declared, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(declared, "config.json"), "w") as f:
        json.dump({**config, "mtp_num_hidden_layers": 1}, f)
    cfg = load_hf_config(declared)
    assert mtp_layer_count(cfg) == 1
    with pytest.raises(ValueError, match=r"holds no MTP weights \(no mtp\.\* tensors"):
        build_mtp_head(declared, cfg, target, F32, DTYPES, CPU, 4)


def test_family_without_mtp_raises(ckpt_dir):
    path = make(ckpt_dir, "llama")
    cfg = load_hf_config(path)
    assert mtp_layer_count(cfg) == 0
    target = build_model(path, cfg, F32, DTYPES, CPU)
    with pytest.raises(ValueError, match="LlamaForCausalLM has no multi-token-prediction.*Qwen3-Next.*Nemotron-H"):
        build_mtp_head(path, cfg, target, F32, DTYPES, CPU, 3)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe_vl", "nemotron_h"])
def test_mtp_layer_count(ckpt_dir, family):
    plain = make(ckpt_dir, family)
    assert mtp_layer_count(load_hf_config(plain)) == 0
    assert mtp_layer_count(load_hf_config(add_mtp_weights(plain, num_layers=3, seed=2))) == 3


def test_hf_loads_checkpoint_with_mtp_weights(ckpt_dir):
    """transformers ignores the added ``mtp.*`` tensors and config keys: its logits are the plain checkpoint's."""
    from transformers import AutoModelForCausalLM

    plain = make(ckpt_dir, "qwen3_next")
    ids = torch.tensor([[5, 9, 17, 33]])
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(plain, dtype=F32)(ids).logits
        b = AutoModelForCausalLM.from_pretrained(add_mtp_weights(plain, num_layers=1), dtype=F32)(ids).logits
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe_vl", "nemotron_h_latent"])
def test_head_decode_runs_on_kernels_and_is_captured(ckpt_dir, family):
    """bf16 on the compiled CPU kernels (``enable_cpu_kernels`` and ``pack_kernel_linear_layers`` applied to
    the head's module tree): a decode step after a prefill takes no fallback, is captured as kernel calls
    only (``kernels/graph.py``), and its replay equals the eager step bit for bit."""
    from hybridserve.kernels import enable_cpu_kernels, fallbacks, gemm
    from hybridserve.kernels.graph import capture, module_regions, tensor_region
    from hybridserve.layers.packed_linear import pack_kernel_linear_layers
    from hybridserve.layers.rotary import RotaryEmbedding
    from hybridserve.ops.dispatch import runs_on_kernels
    from tests.kernels.helpers import find_compiler

    if find_compiler() is None:
        pytest.skip("no C++ compiler: the CPU kernels cannot be built")
    bf16 = torch.bfloat16
    path = add_mtp_weights(make(ckpt_dir, family), num_layers=1, seed=3)
    cfg = load_hf_config(path)
    dtypes = CacheDtypes(bf16, bf16, F32)
    target = build_model(path, cfg, bf16, dtypes, CPU)
    first = max(s.index for s in target.cache_specs()) + 1
    head = build_mtp_head(path, cfg, target, bf16, dtypes, CPU, first)
    if not (enable_cpu_kernels(target) and enable_cpu_kernels(head) and gemm.available()):
        pytest.skip("the CPU kernels are not available here")
    assert runs_on_kernels(head)
    pack_kernel_linear_layers(target)
    assert pack_kernel_linear_layers(head) > 0  # fc and the layer's projections and experts
    for module in target.modules():
        if isinstance(module, RotaryEmbedding):
            module.make_table(64, bf16)
    pool = _pool(target, head)
    n = 7
    got = pool.allocate(-(-(n + 1) // BLOCK), 1 if pool.layout.has_state else 0)
    table = torch.tensor([got.pages], dtype=torch.int64)
    slots = torch.tensor(got.slots, dtype=torch.int64) if got.slots else None
    tokens = torch.randint(3, 128, (n + 2,), generator=torch.Generator().manual_seed(5))
    i64 = dict(dtype=torch.int64)

    def batch_of(start: int, count: int, decode: bool) -> ForwardBatch:
        pos = torch.arange(start, start + count)
        group = SeqGroup(0, count, torch.tensor([0, count], **i64), torch.tensor([start + count], **i64), table, slots)
        return ForwardBatch(table[0][pos // BLOCK] * BLOCK + pos % BLOCK, group if decode else None,
                            None if decode else group, pool.layer_caches)

    fallbacks.reset()
    with torch.inference_mode():
        prefill = batch_of(0, n, decode=False)
        hidden = target(tokens[:n], torch.arange(n), prefill)  # (n, H)
        head(tokens[1:n + 1], torch.arange(n), hidden, prefill)
        decode = batch_of(n, 1, decode=True)
        ids, positions = tokens[n + 1:n + 2].clone(), torch.tensor([n], **i64)
        last = target(tokens[n:n + 1], positions, decode).clone()  # (1, H)
        eager = head(ids, positions, last, decode).clone()

        def forward():
            return head(ids, positions, last, decode)

        statics = [ids, positions, last, decode.slot_mapping, table, pool.buffer, decode.decode.cu_seqlens_q,
                   decode.decode.seq_lens] + ([slots] if slots is not None else [])
        graph = capture(forward, module_regions(head) + module_regions(target) + [tensor_region(t) for t in statics])
        arena = torch.empty(max(graph.arena_bytes, 64), dtype=torch.uint8)
        graph.place(arena)
        replayed = graph.replay()
    assert fallbacks.total() == 0, fallbacks.counts()
    assert torch.equal(replayed, eager)

"""Train hybridserve's default model: a small Bamba (Mamba2 + attention hybrid) on Jane Austen.

Prerequisites (see docs/default_model.md):
    python training/prepare_data.py      # -> training/data/{train,val}.txt
    python training/train_tokenizer.py   # -> training/data/tokenizer/

Then:
    nohup nice -n 10 python training/train.py > training/logs/train.out 2>&1 &

What it does:
  * builds a ``transformers.BambaForCausalLM`` from the architecture flags below (Mamba2-style
    init for ``dt_bias`` / ``A_log``), single CPU thread by default;
  * trains on random-offset, non-overlapping windows of the tokenized training stream, shuffled
    per epoch by a ``torch.Generator`` seeded from ``--seed`` (so the data order is a pure
    function of the seed), with AdamW, linear warmup and cosine decay to ``--min-lr-frac``;
  * logs train loss every ``--log-every`` steps and the full held-out loss every ``--eval-every``
    steps to ``--log-csv``;
  * stops at ``--max-steps`` or when ``--time-limit-min`` of wall clock is spent, whichever comes
    first.  The learning-rate schedule runs on ``max(step / max_steps, elapsed / time_limit)``,
    so the cosine decay finishes even if the wall-clock budget binds first (the run is then
    reproducible up to where the two clocks diverge; with an ample time limit it is exactly
    reproducible from the seed);
  * saves the final model (``save_pretrained``, safetensors) and the tokenizer to ``--out``
    and draws the loss curve to ``--plot``.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = os.path.join(HERE, "data")
    ap.add_argument("--train-file", default=os.path.join(d, "train.txt"))
    ap.add_argument("--val-file", default=os.path.join(d, "val.txt"))
    ap.add_argument("--tokenizer", default=os.path.join(d, "tokenizer"))
    ap.add_argument("--out", default=os.path.join(ROOT, "hybridserve", "default_model"))
    ap.add_argument("--plot", default=os.path.join(ROOT, "docs", "default_model_loss.png"))
    ap.add_argument("--log-csv", default=os.path.join(HERE, "logs", "train_log.csv"))
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=1)
    # architecture
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--attn-layers", default="2,5", help="comma-separated attention layer indices")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--mamba-heads", type=int, default=8)
    ap.add_argument("--mamba-d-state", type=int, default=64)
    ap.add_argument("--mamba-groups", type=int, default=1)
    ap.add_argument("--mamba-expand", type=int, default=2)
    ap.add_argument("--mamba-chunk", type=int, default=64)
    ap.add_argument("--max-positions", type=int, default=2048)
    # optimisation
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--max-steps", type=int, default=2600)
    ap.add_argument("--time-limit-min", type=float, default=70.0,
                    help="stop the training loop after this many minutes of wall clock (then eval+save)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-batch", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="dtype the checkpoint is saved in (training is float32)")
    ap.add_argument("--plot-only", action="store_true",
                    help="only redraw --plot from --log-csv and the summary.json beside it")
    return ap.parse_args()


def tokenize_file(tok, path: str) -> torch.Tensor:
    text = open(path, encoding="utf-8").read()
    ids = tok(text, add_special_tokens=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def build_model(args, tok):
    from transformers import BambaConfig, BambaForCausalLM

    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = BambaConfig(
        vocab_size=len(tok),
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        attn_layer_indices=[int(i) for i in args.attn_layers.split(",") if i.strip()],
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.ffn,
        mamba_n_heads=args.mamba_heads,
        mamba_d_head=args.mamba_expand * args.hidden // args.mamba_heads,
        mamba_d_state=args.mamba_d_state,
        mamba_n_groups=args.mamba_groups,
        mamba_expand=args.mamba_expand,
        mamba_d_conv=4,
        mamba_chunk_size=args.mamba_chunk,
        max_position_embeddings=args.max_positions,
        tie_word_embeddings=True,
        pad_token_id=eot,
        bos_token_id=eot,
        eos_token_id=eot,
        use_cache=True,
    )
    model = BambaForCausalLM(cfg)
    # Mamba2 initialisation (HF's default is dt_bias = 1, A = 1..H): dt log-uniform in
    # [1e-3, 1e-1] stored as softplus^-1(dt), A uniform in [1, 16].
    g = torch.Generator().manual_seed(args.seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            mixer = getattr(layer, "mamba", None)
            if mixer is None:
                continue
            h = mixer.num_heads
            dt = torch.exp(torch.rand(h, generator=g) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            dt = dt.clamp(min=1e-4)
            mixer.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            mixer.A_log.copy_(torch.log(torch.empty(h).uniform_(1, 16, generator=g)))
    return model


class Batches:
    """Deterministic epoch-shuffled windows of (seq_len + 1) tokens from one token stream."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch: int, seed: int):
        self.tokens, self.seq_len, self.batch = tokens, seq_len, batch
        self.g = torch.Generator().manual_seed(seed)
        self.epoch, self.queue = 0, []

    def _refill(self):
        span = self.seq_len + 1
        offset = int(torch.randint(0, span, (1,), generator=self.g))
        n = (len(self.tokens) - offset) // span
        starts = offset + span * torch.randperm(n, generator=self.g)
        self.queue = starts.tolist()
        self.epoch += 1

    def next(self) -> torch.Tensor:
        rows = []
        for _ in range(self.batch):
            if not self.queue:
                self._refill()
            s = self.queue.pop()
            rows.append(self.tokens[s : s + self.seq_len + 1])
        return torch.stack(rows)  # (B, T+1)


@torch.no_grad()
def evaluate(model, tokens: torch.Tensor, seq_len: int, batch: int) -> tuple[float, int]:
    """Mean next-token loss over non-overlapping windows of the held-out stream."""
    model.eval()
    n = (len(tokens) - 1) // seq_len
    total, count = 0.0, 0
    for i in range(0, n, batch):
        idx = range(i, min(i + batch, n))
        x = torch.stack([tokens[j * seq_len : j * seq_len + seq_len] for j in idx])
        y = torch.stack([tokens[j * seq_len + 1 : j * seq_len + seq_len + 1] for j in idx])
        logits = model(input_ids=x, use_cache=False).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum")
        total += loss.item()
        count += y.numel()
    model.train()
    return total / count, count


def lr_at(args, step: int, elapsed: float) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = max((step - args.warmup) / max(1, args.max_steps - args.warmup), elapsed / (args.time_limit_min * 60))
    progress = min(1.0, progress)
    cos = 0.5 * (1 + math.cos(math.pi * progress))
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * cos)


def plot(csv_path: str, png_path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, train, esteps, evals = [], [], [], []
    with open(csv_path) as f:
        for row in csv.DictReader(f):
            if row["train_loss"]:
                steps.append(int(row["step"]))
                train.append(float(row["train_loss"]))
            if row["val_loss"]:
                esteps.append(int(row["step"]))
                evals.append(float(row["val_loss"]))
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.plot(steps, train, lw=1, alpha=0.8, label="train loss (mean over log interval)")
    ax.plot(esteps, evals, "o-", ms=4, label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(png_path), exist_ok=True)
    fig.savefig(png_path)


def plot_title(n_params: int, tokens_seen: int, val_loss: float) -> str:
    return (f"hybridserve default model: Bamba {n_params / 1e6:.1f}M params, {tokens_seen / 1e6:.1f}M tokens "
            f"(held-out ppl {math.exp(val_loss):.1f})")


def main() -> None:
    args = parse_args()
    if args.plot_only:
        with open(os.path.join(os.path.dirname(args.log_csv), "summary.json")) as f:
            s = json.load(f)
        plot(args.log_csv, args.plot, plot_title(s["params"], s["tokens_seen"], s["final_val_loss"]))
        return
    t_start = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)

    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    train_tokens = tokenize_file(tok, args.train_file)
    val_tokens = tokenize_file(tok, args.val_file)
    print(f"train tokens {len(train_tokens):,}  val tokens {len(val_tokens):,}", flush=True)

    model = build_model(args, tok)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params:,}  layer types {model.config.layers_block_type}", flush=True)

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    batches = Batches(train_tokens, args.seq_len, args.batch, args.seed)

    os.makedirs(os.path.dirname(args.log_csv), exist_ok=True)
    logf = open(args.log_csv, "w", newline="")
    log = csv.writer(logf)
    log.writerow(["step", "tokens", "elapsed_s", "lr", "train_loss", "val_loss"])

    loop_start = time.time()
    budget = args.time_limit_min * 60
    model.train()
    acc, acc_n, step = 0.0, 0, 0
    val_loss = None
    while step < args.max_steps:
        elapsed = time.time() - loop_start
        if elapsed > budget:
            print(f"time limit reached at step {step}", flush=True)
            break
        lr = lr_at(args, step, elapsed)
        for group in opt.param_groups:
            group["lr"] = lr
        xy = batches.next()
        # Next-token loss on all T positions, computed here (HF's `labels=` would shift and
        # drop the last position).
        logits = model(input_ids=xy[:, :-1], use_cache=False).logits.float()  # (B, T, V)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), xy[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        step += 1
        acc += loss.item()
        acc_n += 1
        tokens_seen = step * args.batch * args.seq_len
        do_eval = step % args.eval_every == 0 or step == args.max_steps
        if step % args.log_every == 0 or do_eval:
            val_loss = evaluate(model, val_tokens, args.seq_len, args.eval_batch)[0] if do_eval else None
            tl = acc / acc_n
            log.writerow([step, tokens_seen, f"{time.time() - loop_start:.1f}", f"{lr:.3e}", f"{tl:.4f}",
                          f"{val_loss:.4f}" if val_loss is not None else ""])
            logf.flush()
            msg = f"step {step:5d}  tok {tokens_seen:>10,}  {time.time() - loop_start:7.1f}s  lr {lr:.2e}  train {tl:.4f}"
            if val_loss is not None:
                msg += f"  val {val_loss:.4f} (ppl {math.exp(val_loss):.2f})"
            print(msg, flush=True)
            acc, acc_n = 0.0, 0

    train_time = time.time() - loop_start
    final_val, n_val = evaluate(model, val_tokens, args.seq_len, args.eval_batch)
    tokens_seen = step * args.batch * args.seq_len
    if acc_n:
        log.writerow([step, tokens_seen, f"{train_time:.1f}", "", f"{acc / acc_n:.4f}", f"{final_val:.4f}"])
    else:
        log.writerow([step, tokens_seen, f"{train_time:.1f}", "", "", f"{final_val:.4f}"])
    logf.close()
    print(f"final held-out loss {final_val:.4f}  ppl {math.exp(final_val):.2f}  ({n_val:,} tokens)", flush=True)

    # ---- save ----------------------------------------------------------------------------
    save_dtype = getattr(torch, args.dtype)
    model.eval()
    model.config.use_cache = True
    model = model.to(save_dtype)
    model.config.dtype = save_dtype
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    summary = {
        "seed": args.seed,
        "params": n_params,
        "steps": step,
        "tokens_seen": tokens_seen,
        "epochs": tokens_seen / len(train_tokens),
        "train_tokens": len(train_tokens),
        "val_tokens_scored": n_val,
        "train_loop_seconds": round(train_time, 1),
        "final_val_loss": round(final_val, 4),
        "final_val_ppl": round(math.exp(final_val), 3),
        "args": vars(args),
    }
    with open(os.path.join(os.path.dirname(args.log_csv), "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    plot(args.log_csv, args.plot, plot_title(n_params, tokens_seen, final_val))

    # ---- a sample, for the log ------------------------------------------------------------
    model = model.float()
    ids = tok("Once upon a time", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=60, do_sample=False, pad_token_id=tok.pad_token_id)
    print("greedy sample:", repr(tok.decode(out[0])), flush=True)
    print(f"done in {(time.time() - t_start) / 60:.1f} min total", flush=True)


if __name__ == "__main__":
    main()

"""``hybridserve drift``: how far each recurrent-state dtype moves a model's logprobs from float32 state, by
position (``hybridserve/evaluation/drift.py``); a table on stdout, optionally JSON and a PNG plot."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hybridserve.entrypoints.engine_args import HelpFormatter, add_engine_args, engine_kwargs

#: the state dtypes compared with float32 state when --state-dtypes is not given
DEFAULT_STATE_DTYPES = "bfloat16,float16"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "drift", help="state-precision drift: |Δlogprob| of each recurrent-state dtype against float32 state, "
                      "by position", formatter_class=HelpFormatter,
        description="A float32-state engine generates a greedy continuation of a prompt taken from a long text; "
                    "then an engine per state dtype (--mamba-ssm-cache-dtype) scores the same prompt + "
                    "continuation teacher-forced. Reported per bucket of positions: the mean and max |Δlogprob| "
                    "of the actual next token against float32 state, and the top-1 agreement. The state is "
                    "rounded to its dtype whenever it is stored between steps: with --max-num-batched-tokens 1 "
                    "(the default here) after every token, as decoding does; a larger budget scores faster and "
                    "rounds only at prefill chunk ends. --seed seeds the engines and every request (the stochastic "
                    "rounding of a quantized state keys on it). With no --model, the shipped model; with no "
                    "--text, a text shipped for this report (docs/state_precision.md).")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    p.add_argument("--state-dtypes", default=DEFAULT_STATE_DTYPES, metavar="NAME[,NAME...]",
                   help="recurrent-state dtypes to compare with float32 state, comma-separated: any value "
                        "--mamba-ssm-cache-dtype accepts (float32 again checks that runs repeat exactly); SSM:CONV "
                        "sets that run's conv-state dtype too (int8:int8; the reference keeps --mamba-cache-dtype, "
                        "give --mamba-cache-dtype float32 for an all-float32 reference)")
    p.add_argument("--text", default=None, metavar="FILE",
                   help="UTF-8 text whose first --prompt-tokens tokens are the prompt (default: the shipped text)")
    p.add_argument("--prompt-tokens", type=int, default=520, help="prompt length in tokens (at least 2)")
    p.add_argument("--generate-tokens", type=int, default=520,
                   help="tokens generated greedily with float32 state after the prompt, then scored (0: none)")
    p.add_argument("--bucket", type=int, default=64, help="positions per row of the table (and point of the plot)")
    p.add_argument("--json", default=None, metavar="OUT.json", help="write the report as JSON to this file")
    p.add_argument("--plot", default=None, metavar="OUT.png",
                   help="draw the report into this PNG (needs matplotlib: pip install 'hybridserve[plot]')")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bars on stderr (a line per run is still printed)")
    add_engine_args(p)  # --seed: the engine's and every request's (the rounding of a quantized state keys on it)
    for action in p._actions:
        if action.dest == "mamba_ssm_cache_dtype":  # what --state-dtypes varies: refused if given, not shown
            action.help = argparse.SUPPRESS
    from hybridserve.evaluation.drift import DRIFT_ENGINE_DEFAULTS

    p.set_defaults(handler=run, **DRIFT_ENGINE_DEFAULTS)


class ProgressBars:
    """One tqdm bar per run on stderr (a new label closes the last bar), and a line when a run ends."""

    def __init__(self, bars: bool) -> None:
        self.bars = bars
        self.label: str | None = None
        self.bar: Any = None

    def __call__(self, label: str, done: int, total: int) -> None:
        if label != self.label:
            self.close()
            self.label = label
            if self.bars:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, desc=label, unit="tok", dynamic_ncols=True, leave=False)
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
        if done >= total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.label is not None:
            print(f"drift: {self.label}: done", file=sys.stderr, flush=True)
            self.label = None


def read_text(path: str | None) -> str | None:
    """The text of ``--text`` (None: the shipped one); ValueError naming the file when it cannot be read."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--text {path!r} cannot be read as UTF-8 text: {exc}") from None


def run(args: argparse.Namespace) -> int:
    from hybridserve.evaluation.drift import DriftSettings, measure_drift
    from hybridserve.evaluation.drift_figures import format_table
    from hybridserve.evaluation.drift_plot import PLOT_INSTALL_HINT, plot_available, write_plot

    settings = DriftSettings(prompt_tokens=args.prompt_tokens, generate_tokens=args.generate_tokens,
                             bucket=args.bucket, seed=args.seed)
    names = [n.strip() for n in args.state_dtypes.split(",") if n.strip()]
    text = read_text(args.text)
    if args.plot is not None and not plot_available():
        print(f"warning: --plot {args.plot}: matplotlib is not installed, so no plot will be drawn "
              f"({PLOT_INSTALL_HINT}); the table and JSON are still written", file=sys.stderr)
    progress = ProgressBars(args.progress and sys.stderr.isatty())
    try:
        report = measure_drift(args.model, names, text, settings, engine_kwargs(args),
                               text_source=args.text, progress=progress)
    finally:
        progress.close()
    print(format_table(report))
    if args.json is not None:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    if args.plot is not None:
        try:
            write_plot(report, args.plot)
        except RuntimeError as exc:
            print(f"error: --plot {args.plot}: {exc}", file=sys.stderr)
            return 1
    return 0

"""State-precision drift: how far storing the recurrent ("temporal") state in another dtype moves a model's
logprobs from float32 state, position by position.

A reference engine with float32 state generates a greedy continuation of a prompt; then every engine, the
reference included, scores the same sequence (prompt + continuation) teacher-forced, with prompt logprobs, so
positions align. Each run is one engine built through the public API (``LLM``) with
``mamba_ssm_cache_dtype`` set: any state dtype the engine accepts works here; an entry ``SSM:CONV`` sets the
run's conv-state dtype (``mamba_cache_dtype``) too.

The state dtype only decides what is stored between steps (the kernels compute in float32), so the step size
decides how often a state is rounded: with ``max_num_batched_tokens=1`` (the default here) the sequence is
scored one token per step and the state is stored after every token, as decoding does; with a larger budget
it is stored only at the ends of prefill chunks, as a served prompt's prefill does.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from hybridserve.evaluation.drift_figures import Scores, position_buckets, position_drift, summary
from hybridserve.evaluation.drift_figures import figures as bucket_figures
from hybridserve.outputs import RequestOutput
from hybridserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

REFERENCE_STATE_DTYPE = "float32"
#: the text scored when none is given: plain English prose written for this report (a few thousand words)
DEFAULT_TEXT = Path(__file__).with_name("drift_text.txt")
REPORT_SCHEMA = "hybridserve.drift/1"
#: the report's name for the shipped model (``hybridserve/default_model``)
SHIPPED_MODEL_NAME = "hybridserve/default_model"
#: engine options of every run unless given: one token per step (the state stored after every token, as
#: decoding does), one sequence at a time (one captured decode batch size), a pool one long sequence fits in
DRIFT_ENGINE_DEFAULTS: dict[str, Any] = {"max_num_batched_tokens": 1, "max_num_seqs": 1, "cache_memory": "256MiB"}

#: progress(label, done, total): called as a run advances (label names the run, e.g. "bfloat16 state: scoring")
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class DriftSettings:
    """What is measured: ``prompt_tokens`` of the text, ``generate_tokens`` generated greedily with float32
    state, the figures per bucket of ``bucket`` positions; ``seed`` is every request's seed (the engine's
    stochastic rounding of a quantized state is keyed on it)."""

    prompt_tokens: int = 520
    generate_tokens: int = 520
    bucket: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        for name, flag, low in (("prompt_tokens", "--prompt-tokens", 2), ("generate_tokens", "--generate-tokens", 0),
                                ("bucket", "--bucket", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}={value!r} ({flag}) must be an integer >= {low}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed={self.seed!r} (--seed) must be an integer")

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.generate_tokens


#: separates a run's recurrent-state dtype from its conv-state dtype in a --state-dtypes entry ("int8:int8")
CONV_SEPARATOR = ":"


def run_dtypes(name: str) -> dict[str, str]:
    """The dtype options of one --state-dtypes entry: ``SSM`` sets ``mamba_ssm_cache_dtype``; ``SSM:CONV`` sets
    ``mamba_cache_dtype`` (the conv state) too, for that run only (over the shared engine options; the float32
    reference keeps theirs)."""
    ssm, sep, conv = name.partition(CONV_SEPARATOR)
    return {"mamba_ssm_cache_dtype": ssm, **({"mamba_cache_dtype": conv} if sep else {})}


def check_state_dtypes(names: Sequence[str], engine_options: dict[str, Any]) -> list[str]:
    """``names`` as the engine spells them (aliases resolved), each checked by ``EngineConfig`` itself, so that
    whatever ``mamba_ssm_cache_dtype`` (and after a ``:``, ``mamba_cache_dtype``) accepts is accepted here;
    ValueError naming a bad or repeated one."""
    from hybridserve.config import EngineConfig

    if not names:
        raise ValueError("--state-dtypes is empty: name at least one recurrent-state dtype, e.g. bfloat16")
    EngineConfig(**engine_options)  # a bad engine option fails with its own message first
    canonical: list[str] = []
    for name in names:
        dtypes = run_dtypes(name)
        try:
            config = EngineConfig(**{**engine_options, **dtypes})
        except ValueError as exc:
            raise ValueError(f"--state-dtypes: {name!r} is not a recurrent-state dtype the engine accepts, nor an "
                             f"SSM{CONV_SEPARATOR}CONV pair of them ({exc})") from None
        resolved = config.mamba_ssm_cache_dtype
        if "mamba_cache_dtype" in dtypes:
            resolved += CONV_SEPARATOR + config.mamba_cache_dtype
        if resolved in canonical:
            raise ValueError(f"--state-dtypes names {resolved!r} twice")
        canonical.append(resolved)
    return canonical


def run_options(engine_options: dict[str, Any] | None) -> dict[str, Any]:
    """The engine options every run shares: ``DRIFT_ENGINE_DEFAULTS`` under the given ones, with no state dtype
    (each run sets its own; a given one is refused, as the report is what varies it)."""
    options = {**DRIFT_ENGINE_DEFAULTS, **(engine_options or {})}
    state = options.pop("mamba_ssm_cache_dtype", "auto")
    if state != "auto":
        raise ValueError(f"mamba_ssm_cache_dtype={state!r} (--mamba-ssm-cache-dtype) is what the drift report "
                         "varies: list the dtypes in --state-dtypes (float32 state is the reference)")
    options.pop("enable_progress_bar", None)
    return options


def prompt_ids_from_text(tokenize: Callable[[str], list[int]], text: str, prompt_tokens: int) -> list[int]:
    """The first ``prompt_tokens`` tokens of ``text``; ValueError when the text is shorter. Only a prefix of a
    long text is tokenized: one about twice as long as needed (doubled until it is), so that a tokenizer never
    sees much more than the model's length."""
    chars = prompt_tokens * 8  # English runs at ~4 characters per token
    while True:
        ids = tokenize(text[:chars])
        if len(ids) >= prompt_tokens + 8 or chars >= len(text):  # a margin: the cut may split the last word
            break
        chars *= 2
    if len(ids) < prompt_tokens:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than --prompt-tokens {prompt_tokens}: give a "
                         "longer text (--text FILE) or fewer --prompt-tokens")
    return ids[:prompt_tokens]


def greedy_params(seed: int, **fields: Any) -> SamplingParams:
    """Greedy sampling with every logit adjustment off (a model's generation_config.json defaults do not apply:
    each field is set)."""
    return SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, seed=seed,
                          detokenize=False, **fields)


def run_request(llm: Any, request_id: str, ids: list[int], params: SamplingParams, label: str,
                progress: Progress | None) -> RequestOutput:
    """Run one request alone on ``llm``'s engine, reporting progress (scored positions, or generated tokens)."""
    engine = llm.engine
    engine.add_request(request_id, ids, params)
    total = params.max_tokens if params.max_tokens else len(ids) - 1
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if progress is not None:
                done = len(out.outputs[0].token_ids) if params.max_tokens else len(out.prompt_logprobs or [1]) - 1
                progress(label, done, total)
            if out.finished:
                final = out
    if final is None or final.error is not None:
        raise RuntimeError(f"{label}: the request failed: {final.error if final is not None else 'no output'}")
    return final


def scores_of(out: RequestOutput, ids: list[int]) -> Scores:
    """The target logprob and the most likely token at every position of a prompt-logprobs run over ``ids``."""
    entries = out.prompt_logprobs
    assert entries is not None and len(entries) == len(ids), "prompt logprobs cover the whole sequence"
    targets, tops = [], []
    for i in range(1, len(ids)):
        entry = entries[i]
        assert entry is not None
        targets.append(entry[ids[i]].logprob)
        tops.append(next(tid for tid, lp in entry.items() if lp.rank == 1))  # the top-k token comes first
    return Scores(targets, tops)


@dataclass
class ScoredRun:
    """One engine's scores of the sequence, with the dtypes it resolved, its state bytes per sequence and the
    seconds the scoring took."""

    scores: Scores
    dtypes: dict[str, str]
    state_bytes_per_sequence: int
    seconds: float

    def info(self) -> dict[str, Any]:
        return {"dtypes": self.dtypes, "state_bytes_per_sequence": self.state_bytes_per_sequence,
                "seconds": round(self.seconds, 3)}


def score_run(llm: Any, ids: list[int], settings: DriftSettings, label: str, progress: Progress | None) -> ScoredRun:
    """Score ``ids`` teacher-forced on ``llm`` (prompt logprobs over the whole sequence, nothing generated)."""
    start = time.perf_counter()
    out = run_request(llm, f"drift-score-{label}", ids, greedy_params(settings.seed, max_tokens=0, prompt_logprobs=1),
                      f"{label}: scoring", progress)
    return ScoredRun(scores_of(out, ids), llm.engine.dtypes.as_names(),
                     int(llm.cache_layout()["state_bytes_per_sequence"]), time.perf_counter() - start)


def environment() -> dict[str, Any]:
    """The CPU (model name, architecture, ISA level in force) and the versions the figures were measured with."""
    import torch

    from hybridserve import __version__
    from hybridserve.kernels import isa

    info = isa.cpu_info()
    return {"cpu": {"model": info.model, "arch": info.arch, "isa_in_force": isa.level_in_force()},
            "versions": {"hybridserve": __version__, "torch": torch.__version__}}


def measure_drift(model: str | None, state_dtypes: Sequence[str], prompt: str | list[int] | None = None,
                  settings: DriftSettings | None = None, engine_options: dict[str, Any] | None = None,
                  text_source: str | None = None, progress: Progress | None = None) -> dict[str, Any]:
    """The drift report of ``model`` (the shipped one when None) for each of ``state_dtypes`` against float32
    state, as a JSON-ready dict (docs/state_precision.md, "The drift report").

    ``prompt`` is a text (its first ``settings.prompt_tokens`` tokens are used; the shipped text when None) or
    token ids (used as given: exactly ``prompt_tokens`` of them). ``engine_options`` are ``LLM`` keyword
    arguments shared by every run (``DRIFT_ENGINE_DEFAULTS`` under them); ``text_source`` names the text in the
    report. ValueError, before any engine starts, for a bad setting or state dtype."""
    from hybridserve.default_model import default_model_path
    from hybridserve.entrypoints.llm import LLM

    settings = settings or DriftSettings()
    options = run_options(engine_options)
    names = check_state_dtypes(state_dtypes, options)
    if isinstance(prompt, list) and len(prompt) != settings.prompt_tokens:
        raise ValueError(f"got {len(prompt)} prompt token ids for --prompt-tokens {settings.prompt_tokens}")
    if prompt is None:
        prompt, text_source = DEFAULT_TEXT.read_text(encoding="utf-8"), text_source or "drift_text.txt (shipped)"
    model_path = model or default_model_path()

    def engine(state_dtype: str) -> Any:
        return LLM(model_path, enable_progress_bar=False, **{**options, **run_dtypes(state_dtype)})

    llm = engine(REFERENCE_STATE_DTYPE)
    try:
        limit = llm.engine.max_model_len
        if settings.total_tokens > limit:
            raise ValueError(f"--prompt-tokens {settings.prompt_tokens} + --generate-tokens {settings.generate_tokens} "
                             f"= {settings.total_tokens} tokens exceed max_model_len={limit} (--max-model-len; "
                             "the model's max_position_embeddings caps it)")
        prompt_ids = (list(prompt) if isinstance(prompt, list)
                      else prompt_ids_from_text(llm.engine.detokenizer.encode, prompt, settings.prompt_tokens))
        label = f"{REFERENCE_STATE_DTYPE} state (reference)"
        continuation: list[int] = []
        if settings.generate_tokens:
            out = run_request(llm, "drift-generate", prompt_ids,
                              greedy_params(settings.seed, max_tokens=settings.generate_tokens, ignore_eos=True),
                              f"{label}: greedy continuation", progress)
            continuation = list(out.outputs[0].token_ids)
        ids = prompt_ids + continuation
        reference = score_run(llm, ids, settings, label, progress)
        architecture = type(llm.engine.model).__name__
    finally:
        llm.engine.shutdown()
        del llm
    runs: dict[str, ScoredRun] = {}
    for name in names:
        llm = engine(name)
        try:
            runs[name] = score_run(llm, ids, settings, f"{name} state", progress)
        finally:
            llm.engine.shutdown()
            del llm
        if (runs[name].state_bytes_per_sequence == reference.state_bytes_per_sequence
                and runs[name].dtypes["mamba_ssm_cache_dtype"] != REFERENCE_STATE_DTYPE):
            logger.warning("%s state takes as many bytes as float32 state: this model has no temporal state, so "
                           "--mamba-ssm-cache-dtype changes nothing in it", name)
    label = SHIPPED_MODEL_NAME if model is None else model_path  # the shipped one: the same name on every machine
    return build_report(label, model is None, architecture, settings, options, text_source, ids, reference, runs)


def build_report(model: str, shipped: bool, architecture: str, settings: DriftSettings, options: dict[str, Any],
                 text_source: str | None, ids: list[int], reference: ScoredRun,
                 runs: dict[str, ScoredRun]) -> dict[str, Any]:
    """The report dict: settings, environment, the reference run, per state dtype its summary, per bucket of
    positions each dtype's figures, and the scored token ids."""
    drift = {name: position_drift(reference.scores, run.scores) for name, run in runs.items()}
    buckets = []
    for bucket in position_buckets(settings.prompt_tokens, len(ids), settings.bucket):
        buckets.append({"start": bucket.start, "end": bucket.end, "phase": bucket.phase,
                        "figures": {name: bucket_figures(*drift[name], bucket.start, bucket.end) for name in runs}})
    return {
        "schema": REPORT_SCHEMA,
        "model": model,
        "shipped_model": shipped,
        "architecture": architecture,
        "reference_state_dtype": REFERENCE_STATE_DTYPE,
        "settings": {**asdict(settings), **{k: v if isinstance(v, (int, float, bool, type(None))) else str(v)
                                            for k, v in options.items()}, "text": text_source},
        **environment(),
        "reference": reference.info(),
        "state_dtypes": {name: {**run.info(), **summary(*drift[name], settings.prompt_tokens)}
                         for name, run in runs.items()},
        "buckets": buckets,
        "token_ids": ids,
    }

"""``hybridserve generate``: stream generated text for one or more prompts."""

from __future__ import annotations

import argparse
import sys

from hybridserve.entrypoints.engine_args import HelpFormatter, add_engine_args, engine_kwargs


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from prompts (streams to stdout)", formatter_class=HelpFormatter,
                       description="Generate text. With no --model, the small model shipped with hybridserve.")
    p.add_argument("prompts", nargs="+", metavar="PROMPT", help="text to continue (several run as one batch)")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    add_engine_args(p)
    # sampling flags left out take the model's generation_config.json defaults (--generation-config), else the
    # engine's (shown in brackets)
    p.add_argument("--max-tokens", type=int, default=None,
                   help="most tokens generated per prompt (default: the model's max_new_tokens, else 64)")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 is greedy (default: the model's, else 0)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: keep the most likely tokens up to "
                                                              "this probability mass, 1: all (default: the model's, "
                                                              "else 1)")
    p.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens, 0: all (default: the "
                                                            "model's, else 0)")
    p.add_argument("--min-p", type=float, default=None,
                   help="drop tokens below min-p times the top probability (default: the model's, else 0)")
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request seed (reproducible sampling)")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--stop-token-ids", type=int, nargs="*", default=None, help="token ids that end generation")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--logprobs", type=int, default=None, help="print top-k logprobs of each generated token")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="> 1 discourages tokens already in the prompt or the output, 1: off (default: the model's, "
                        "else 1)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted once from every token already generated, in [-2, 2]")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted per occurrence from every token already generated, in [-2, 2]")
    p.set_defaults(handler=run, cache_memory="512MiB")


#: what ``generate`` samples with when neither a flag nor the model's generation_config.json sets a field: greedy,
#: 64 tokens
CLI_FALLBACKS = {"temperature": 0.0, "max_tokens": 64}


def engine_kwargs_for(args: argparse.Namespace) -> dict:
    """The engine options of ``generate``: never more sequences than prompts run at once (a smaller max_num_seqs
    captures fewer decode batch sizes: one, for one prompt, instead of 1, 2, 4, ..., 64, which is most of a cold
    start's engine setup)."""
    return {**engine_kwargs(args), "max_num_seqs": min(args.max_num_seqs, len(args.prompts))}


def flag_sampling_fields(args: argparse.Namespace) -> dict:
    """The model-defaultable sampling fields the flags set (the others are left unset)."""
    flags = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
             "top_k": args.top_k, "min_p": args.min_p, "repetition_penalty": args.repetition_penalty}
    return {name: value for name, value in flags.items() if value is not None}


def with_cli_fallbacks(params, model_defaults: dict):
    """``params`` with ``CLI_FALLBACKS`` in the fields that neither a flag nor the model's generation config sets
    (those the model sets are left to the engine, which applies them)."""
    return params.with_defaults({name: value for name, value in CLI_FALLBACKS.items() if name not in model_defaults})


def run(args: argparse.Namespace) -> int:
    from hybridserve.config import EngineConfig
    from hybridserve.default_model import default_model_path
    from hybridserve.engine.llm_engine import LLMEngine
    from hybridserve.sampling_params import SamplingParams

    params = SamplingParams(seed=args.sampling_seed, stop=args.stop, stop_token_ids=args.stop_token_ids,
                            ignore_eos=args.ignore_eos, logprobs=args.logprobs, presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty, **flag_sampling_fields(args))
    engine = LLMEngine(EngineConfig(model=args.model or default_model_path(), enable_progress_bar=False,
                                    **engine_kwargs_for(args)))
    params = with_cli_fallbacks(params, engine.generation_defaults.sampling)
    ids = [engine.detokenizer.encode(p) for p in args.prompts]
    for i, (prompt, prompt_ids) in enumerate(zip(args.prompts, ids)):
        engine.add_request(f"cli-{i}", prompt_ids, params, prompt=prompt)
    single = len(args.prompts) == 1
    printed: dict[str, int] = {}
    if single:
        sys.stdout.write(args.prompts[0])
        sys.stdout.flush()
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            if single:
                sys.stdout.write(text[printed.get(out.request_id, 0):])
                sys.stdout.flush()
                printed[out.request_id] = len(text)
            if out.finished:
                finals[out.request_id] = out
    if single:
        sys.stdout.write("\n")
    else:
        for i, prompt in enumerate(args.prompts):
            print(f"[{i}] {prompt}{finals[f'cli-{i}'].outputs[0].text}")
    if args.logprobs is not None:
        for rid, out in sorted(finals.items()):
            for pos, entry in enumerate(out.outputs[0].logprobs or []):
                ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)
                print(f"{rid} #{pos}: " + ", ".join(f"{lp.decoded_token!r}={lp.logprob:.3f}" for _, lp in ranked),
                      file=sys.stderr)
    return 0

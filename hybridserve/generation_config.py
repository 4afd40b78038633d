"""A checkpoint's ``generation_config.json``: its end-of-sequence ids and its recommended sampling defaults.

``--generation-config`` (``EngineConfig.generation_config``) chooses where the sampling defaults come from:

* ``auto`` (default): the model folder's ``generation_config.json``, if it has one;
* ``vllm``: none; every request field left unset keeps the engine's own default (``SamplingParams``);
* a folder: that folder's ``generation_config.json`` (the folder must hold one).

The defaults are the fields ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and
``max_new_tokens`` (as ``max_tokens``) that the file sets; ``"do_sample": false`` in the file makes the default
greedy (temperature 0), as in transformers. They apply only to the fields a request leaves unset: an explicit
value always wins (:meth:`GenerationDefaults.apply`). The end-of-sequence ids of the model folder's file are read
whatever the setting (they say when the model has finished, not how to sample).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from hybridserve.sampling_params import MODEL_DEFAULT_FIELDS, SamplingParams

FILE_NAME = "generation_config.json"
#: the settings of ``--generation-config`` that are not a folder
NAMED_SETTINGS = ("auto", "vllm")
#: generation_config.json field -> SamplingParams field
_SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass(frozen=True)
class GenerationDefaults:
    """The sampling defaults a checkpoint recommends (``sampling``: SamplingParams field -> value) and the file
    they came from (None: no file, or ``--generation-config vllm``)."""

    sampling: dict[str, Any] = field(default_factory=dict)
    source: str | None = None

    def apply(self, params: SamplingParams) -> SamplingParams:
        """``params`` with these defaults in the fields it leaves unset (a copy; ``params`` itself when none
        applies)."""
        missing = {name: value for name, value in self.sampling.items() if not params.is_set(name)}
        return params.with_defaults(missing) if missing else params

    def describe(self) -> str:
        """One line for the start-up log: which defaults come from where."""
        if not self.sampling:
            where = f"{self.source} sets none" if self.source else "no generation_config.json is used"
            return f"default sampling parameters: the engine's ({where})"
        values = ", ".join(f"{k}={v!r}" for k, v in self.sampling.items())
        return (f"default sampling parameters have been overridden by {self.source}: {values} (a request's own "
                "values win; --generation-config vllm ignores the file)")


def check_generation_config_setting(value: Any) -> str:
    """``generation_config``: ``auto``, ``vllm`` or an existing folder; ValueError naming the value and the flag."""
    if isinstance(value, str) and value.lower() in NAMED_SETTINGS:
        return value.lower()
    if isinstance(value, (str, os.PathLike)) and os.path.isdir(value):
        return os.fspath(value)
    raise ValueError(f"generation_config={value!r} is not valid (--generation-config): allowed values are auto (the "
                     "model folder's generation_config.json), vllm (ignore it: the engine's defaults) or an existing "
                     "folder that holds a generation_config.json")


def read_generation_config(folder: str, required: bool = False) -> Any | None:
    """transformers' ``GenerationConfig`` of ``folder``'s generation_config.json; None when the file is missing
    (ValueError instead when ``required``); ValueError naming the file when it cannot be read."""
    path = os.path.join(folder, FILE_NAME)
    if not os.path.isfile(path):
        if required:
            raise ValueError(f"--generation-config {folder}: that folder has no {FILE_NAME}")
        return None
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(folder)
    except Exception as exc:  # noqa: BLE001 - transformers reports bad files with assorted exception types
        raise ValueError(f"{path} could not be read: {type(exc).__name__}: {exc}") from None


def generation_eos_ids(model_folder: str) -> list[int]:
    """The end-of-sequence ids ``model_folder``'s generation_config.json lists (none without the file)."""
    config = read_generation_config(model_folder)
    return token_id_list(getattr(config, "eos_token_id", None), os.path.join(model_folder, FILE_NAME))


def token_id_list(value: Any, where: str) -> list[int]:
    """An ``eos_token_id`` entry (None, an id or a list of ids) as a list; ValueError naming ``where`` otherwise."""
    if value is None:
        return []
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{where}: eos_token_id={value!r} is not valid: it must be a token id or a list of them")
    return values


def load_generation_defaults(setting: str, model_folder: str) -> GenerationDefaults:
    """The sampling defaults under ``setting`` (see the module docstring); ValueError naming the file when it
    cannot be read or one of its values is not a valid sampling parameter."""
    if setting == "vllm":
        return GenerationDefaults()
    folder = model_folder if setting == "auto" else setting
    config = read_generation_config(folder, required=setting != "auto")
    path = os.path.join(folder, FILE_NAME)
    if config is None:
        return GenerationDefaults()
    sampling = {ours: getattr(config, theirs) for theirs, ours in _SAMPLING_FIELDS.items()
                if getattr(config, theirs, None) is not None}
    if getattr(config, "do_sample", None) is False:
        sampling["temperature"] = 0.0  # transformers' meaning: greedy, whatever temperature says
    assert set(sampling) <= set(MODEL_DEFAULT_FIELDS)
    try:
        SamplingParams(**sampling)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return GenerationDefaults(sampling, path)

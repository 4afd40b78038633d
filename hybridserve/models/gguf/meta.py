"""A GGUF file's metadata read by architecture-relative key, and the sizes every config builder
(``models/gguf/configs.py``) reads the same way."""

from __future__ import annotations

from typing import Any


class Meta:
    """Metadata of one file, read by architecture-relative key (``block_count`` -> ``<arch>.block_count``)."""

    def __init__(self, values: dict[str, Any], shapes: dict[str, tuple[int, ...]], file: str) -> None:
        self.values, self.shapes, self.tensor_names, self.file = values, shapes, set(shapes), file
        self.arch = str(values.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(f"{self.arch}.{key}", default)

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"{self.file}: metadata key {self.arch}.{key} is missing (a {self.arch} file needs it)")
        return value

    def per_layer(self, key: str, layers: int) -> list[int]:
        """A value llama.cpp writes either once or per layer, as a list of ``layers`` ints."""
        value = self.need(key)
        return [int(v) for v in value] if isinstance(value, list) else [int(value)] * layers

    def main_layers(self) -> int:
        """The model's layers: ``block_count`` less the multi-token-prediction layers llama.cpp's converter appends
        after them (``nextn_predict_layers``), which the loader skips."""
        return int(self.need("block_count")) - int(self.get("nextn_predict_layers", 0) or 0)

    def has(self, tensor: str) -> bool:
        return tensor in self.tensor_names

    def common(self) -> dict[str, Any]:
        """Keys every family shares: vocabulary, special tokens, tied embeddings (no ``output.weight``)."""
        tokens = self.values.get("tokenizer.ggml.tokens")
        vocab = self.get("vocab_size") or (len(tokens) if tokens else None)
        if vocab is None:
            raise ValueError(f"{self.file}: no {self.arch}.vocab_size and no tokenizer.ggml.tokens")
        out: dict[str, Any] = {"vocab_size": int(vocab), "tie_word_embeddings": not self.has("output.weight")}
        for key in ("bos", "eos", "pad"):
            token_id = self.values.get(f"tokenizer.ggml.{key}_token_id")
            if token_id is not None:
                out[f"{key}_token_id"] = int(token_id)
        return out

    def rope(self) -> dict[str, Any]:
        base = self.get("rope.freq_base")
        return {} if base is None else {"rope_parameters": {"rope_type": "default", "rope_theta": float(base)}}


def ssm_sizes(m: Meta) -> tuple[int, int, int]:
    """hidden size, SSM inner size and SSM heads (llama.cpp's ``ssm.time_step_rank`` for Mamba2 layers)."""
    return int(m.need("embedding_length")), int(m.need("ssm.inner_size")), int(m.need("ssm.time_step_rank"))


def rms_eps(m: Meta) -> float:
    return float(m.get("attention.layer_norm_rms_epsilon", 1e-5))

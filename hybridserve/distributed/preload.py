"""What the forkserver imports once, before it forks any worker: the rank worker and what it builds with
(``engine/worker.py``), transformers' config classes, safetensors and every model family (each worker then
starts without importing them)."""

import importlib

import safetensors.torch  # noqa: F401
from transformers import AutoConfig  # noqa: F401
from transformers.models.auto import configuration_auto  # noqa: F401

import hybridserve.distributed.worker  # noqa: F401
import hybridserve.engine.worker  # noqa: F401
from hybridserve.models import registry

for _module in sorted({family.module_path for family in registry.families()}):
    importlib.import_module(_module)

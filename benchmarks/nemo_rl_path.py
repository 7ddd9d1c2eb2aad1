"""What a process needs before it imports NeMo RL's vendored units (tests/third_party/nemo_rl_dtensor,
commit 7ea279a): that tree first on `sys.path`, and stand-ins in `sys.modules` for modules those
units import but never call here, so neither is installed:
- `nemo_rl.utils.logger` (imports mlflow, wandb, swanlab, matplotlib, TensorBoard): a module with its
  one imported name, `Logger`;
- Megatron-Bridge (NeMo RL's Megatron model builder, pinned to a commit of Megatron-LM this project
  does not run): `megatron.bridge.models.model_provider.ModelProviderMixin`,
  `megatron.bridge.training.config.ConfigContainer` and `megatron.bridge.training.state.GlobalState`,
  which `nemo_rl.models.megatron.config` uses in type annotations only, and
  `megatron.bridge.training.utils.packed_seq_utils.get_packed_seq_cp_partition_indices`, which its
  data module calls only at context parallel size > 1 (the stand-in raises).
Importing this module installs them (once); it imports nothing of NeMo RL itself.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

VENDORED = Path(__file__).resolve().parents[1] / "tests" / "third_party" / "nemo_rl_dtensor"


def _stand_in(name: str, **attributes: Any) -> None:
    if name not in sys.modules:
        module = types.ModuleType(name)
        module.__dict__.update(attributes)
        sys.modules[name] = module


def _context_parallel_only(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("Megatron-Bridge is not installed: get_packed_seq_cp_partition_indices (context parallel size > 1) cannot run")


if str(VENDORED) not in sys.path:
    sys.path.insert(0, str(VENDORED))
_stand_in("nemo_rl.utils.logger", Logger=type("Logger", (), {"__module__": "nemo_rl.utils.logger"}))
for _package in ("megatron.bridge", "megatron.bridge.models", "megatron.bridge.training", "megatron.bridge.training.utils"):
    _stand_in(_package)
_stand_in("megatron.bridge.models.model_provider", ModelProviderMixin=type("ModelProviderMixin", (), {}))
_stand_in("megatron.bridge.training.config", ConfigContainer=type("ConfigContainer", (), {}))
_stand_in("megatron.bridge.training.state", GlobalState=type("GlobalState", (), {}))
_stand_in("megatron.bridge.training.utils.packed_seq_utils", get_packed_seq_cp_partition_indices=_context_parallel_only)

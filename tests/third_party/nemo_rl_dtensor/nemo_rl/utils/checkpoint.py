# Copyright (c) 2025, NVIDIA CORPORATION.  All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Checkpoint management utilities for the rl algorithm loop.

It handles logic at the algorithm level. Each RL Actor is expected to have its
own checkpoint saving function (called by the algorithm loop).
"""

import glob
import json
import os
import re
import shutil
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import (
    Any,
    Callable,
    Literal,
    Mapping,
    NotRequired,
    Optional,
    TypedDict,
    Union,
)

import numpy as np
import torch
import yaml
from pydantic import BaseModel

PathLike = Union[str, "os.PathLike[Any]"]


def _load_megatron_common_state_dict(iteration_dir: Path) -> dict[str, Any]:
    """Load common state from either legacy or current MCore checkpoints."""
    # Keep the optional MCore dependency out of DTensor and Automodel imports.
    try:
        from megatron.core.dist_checkpointing import load_common_state_dict
    except ImportError as error:
        raise RuntimeError(
            "Megatron-Core is required to inspect optimizer state in the distributed "
            f"checkpoint at {iteration_dir}. Install NeMo-RL with the `mcore` extra."
        ) from error

    # MCore accepts Path today but deprecates it in favor of str.
    return load_common_state_dict(str(iteration_dir))


class PretrainedCheckpointConfig(TypedDict):
    """Configuration for restoring initial weights from a pre-existing Megatron checkpoint.

    When set, the policy will restore its initial weights from this checkpoint
    instead of loading them from ``model_name``. Supported by the Megatron backend
    only; DTensor backends continue to use HuggingFace weights via ``model_name``.

    Attributes:
        path: Filesystem path to the checkpoint to load.

            * For ``"megatron_bridge"`` format: may be either a **specific
              iteration directory** that contains a ``run_config.yaml`` file
              (e.g. ``/checkpoints/iter_0005000/``) or a **checkpoint root
              directory** that contains ``iter_*`` subdirectories.  When a
              root directory is given the latest ``iter_*`` subdirectory is
              used automatically.
            * For ``"megatron_lm"`` format: may be the checkpoint root directory
              (containing ``iter_*`` subdirectories and a
              ``latest_checkpointed_iteration.txt`` tracker file) or a specific
              iteration directory (e.g. ``/mlm_checkpoints/iter_0005000/``).
              The checkpoint must use the ``torch_dist`` format (i.e. contain a
              ``metadata.json`` file); the legacy ``torch`` format is not
              supported.

        format: Checkpoint format.  Use ``"megatron_bridge"`` for checkpoints
            saved by megatron-bridge (e.g. produced by a prior NeMo-RL run) and
            ``"megatron_lm"`` for checkpoints saved by upstream Megatron-LM.

    """

    path: str
    format: Literal["megatron_bridge", "megatron_lm"]


class CheckpointingConfig(TypedDict):
    """Configuration for checkpoint management.

    Attributes:
    enabled (bool): Whether checkpointing is enabled.
    checkpoint_dir (PathLike): Directory where checkpoints will be saved.
    metric_name (str | None): Name of the metric to use for determining best checkpoints.
        Must be of the form "val:<metric_name>" or "train:<metric_name>" to indicate whether
        the metric should be taken from the validation or training metrics.
    higher_is_better (bool): Whether higher values of the metric indicate better performance.
    keep_top_k (Optional[int]): Number of best checkpoints to keep. If None, all checkpoints are kept.
    ft_keep_latest_k (Optional[int]): Number of most recent checkpoints to keep for crash recovery.
    ft_save_period (Optional[int]): How often to save fault-tolerance checkpoints, in steps.
        When set, a checkpoint is saved every ft_save_period steps for crash recovery.
        Requires ft_keep_latest_k to control how many of these are retained.
    model_save_format (str | None): Format for saving model (v2 allowed values: "torch_save" or "safetensors", v1 allowed values: None).
    save_consolidated (bool): Whether to save consolidated checkpoints (for HF compatibility).
    model_cache_dir (str): Directory for model cache (for safetensors format).
    model_repo_id (str): Repository ID for the model (for safetensors format).
    is_peft (bool): Whether the model uses PEFT.
    save_optimizer (bool): Whether to save optimizer state with checkpoints.
    """

    enabled: bool
    checkpoint_dir: PathLike
    metric_name: str | None
    higher_is_better: bool
    save_period: int
    keep_top_k: NotRequired[int]
    ft_keep_latest_k: NotRequired[int | None]
    ft_save_period: NotRequired[int]
    checkpoint_must_save_by: NotRequired[str | None]
    pretrained_checkpoint: NotRequired[PretrainedCheckpointConfig]
    save_optimizer: NotRequired[bool]  # Default: True
    # New nemo-automodel integration fields
    model_save_format: NotRequired[str | None]  # Default: "safetensors"
    save_consolidated: NotRequired[bool]  # Default: False
    model_cache_dir: NotRequired[str]  # Default: ""
    model_repo_id: NotRequired[str]  # Default: ""
    is_peft: NotRequired[bool]  # Default: False
    peft_config: NotRequired[Any]  # Default: None
    is_async: NotRequired[bool]  # Default: False


class CheckpointManager:
    """Manages model checkpoints during training.

    This class handles creating checkpoint dirs, saving training info, and
    configurations. It also provides utilities for keeping just the top-k checkpoints.
    The checkpointing structure looks like this:
    ```
    checkpoint_dir/
        step_0/
            training_info.json
            config.yaml
            policy.py (up to the algorithm loop to save here)
            policy_optimizer.py (up to the algorithm loop to save here)
            ...
        step_1/
            ...
    ```

    Attributes: Derived from the CheckpointingConfig.
    """

    def __init__(self, config: CheckpointingConfig):
        """Initialize the checkpoint manager.

        Args:
            config (CheckpointingConfig)
        """
        self.checkpoint_dir = Path(config["checkpoint_dir"])
        self.metric_name: str | None = config["metric_name"]
        self.higher_is_better = config["higher_is_better"]
        self.keep_top_k = config["keep_top_k"]
        self.save_period: int = config["save_period"]
        self.ft_keep_latest_k: int | None = config.get("ft_keep_latest_k", None)
        self.save_optimizer = config["save_optimizer"]

        # Store nemo-automodel specific config options
        self.model_save_format = config.get("model_save_format", "safetensors")
        self.save_consolidated = config.get("save_consolidated", False)
        self.model_cache_dir = config.get("model_cache_dir", "")
        self.model_repo_id = config.get("model_repo_id", "")
        self.is_peft = config.get("is_peft", False)

        # Async finalization state
        self._finalize_thread: Optional[threading.Thread] = None
        self._pending_checkpoint_path: Optional[Path] = None
        self._finalize_error: Optional[Exception] = None
        self._delete_executor = ThreadPoolExecutor(max_workers=1)

    @staticmethod
    def get_resume_paths(
        last_checkpoint_path: Optional[PathLike],
        *,
        model_component: Literal["policy", "value"] = "policy",
    ) -> tuple[Optional[Path], Optional[Path]]:
        """Get weights and optimizer paths for resuming from a checkpoint.

        Args:
            last_checkpoint_path: Path to the last checkpoint, or None if starting fresh.
            model_component: Model subtree to resolve. Policy is the default for
                backward compatibility with algorithms that only checkpoint a policy.

        Returns:
            Tuple of (weights_path, optimizer_path). Both are None if no checkpoint.
            optimizer_path is None if checkpoint exists but optimizer state was not saved.
        """
        if last_checkpoint_path:
            component_path = Path(last_checkpoint_path) / model_component
            weights_path = component_path / "weights"
            optimizer_path = component_path / "optimizer"

            # DTensor path
            if optimizer_path.exists():
                return weights_path, optimizer_path

            # Megatron path. MCore's public loader supports both legacy checkpoints,
            # which store common state in common.pt, and current torch_dist
            # checkpoints, which embed it as a common_state ShardedObject.
            iteration_dir = weights_path / "iter_0000000"
            is_megatron_checkpoint = (iteration_dir / "common.pt").exists() or (
                iteration_dir / "metadata.json"
            ).exists()
            if is_megatron_checkpoint:
                common_state_dict = _load_megatron_common_state_dict(iteration_dir)
                if "optimizer" in common_state_dict:
                    # In Megatron, optimizer_path is only a flag to indicate that the optimizer
                    # state is embedded in the weights_path. We will actually load the optimizer
                    # state from the weights_path.
                    return weights_path, optimizer_path

            warnings.warn(
                f"Optimizer state not found at {optimizer_path} (DTensor path), and no embedded "
                f"optimizer state detected under {weights_path} (Megatron path). "
                "Optimizer will be freshly initialized.",
                stacklevel=2,
            )
            optimizer_path = None
            return weights_path, optimizer_path
        return None, None

    def init_tmp_checkpoint(
        self,
        step: int,
        training_info: Mapping[str, Any],
        run_config: Optional[BaseModel] = None,
    ) -> PathLike:
        """Initialize a temporary checkpoint directory.

        Creates a temporary directory for a new checkpoint and saves training info
        and configuration. The directory is named 'tmp_step_{step}' and will be renamed
        to 'step_{step}' when the checkpoint is completed.
        We do it this way to allow the algorithm loop to save any files it wants to save
        in a safe, temporary directory.

        Args:
            step (int): The training step number.
            training_info (dict[str, Any]): Dictionary containing training metrics and info.
            run_config (Optional[BaseModel]): Optional configuration for the training run.

        Returns:
            PathLike: Path to the temporary checkpoint directory.
        """
        save_dir = self.checkpoint_dir / f"tmp_step_{step}"
        # Remove a stale tmp_step_{step} left behind by an interrupted prior save
        # so the new save starts clean.
        if save_dir.exists():
            t0 = time.monotonic()
            shutil.rmtree(save_dir)
            elapsed = time.monotonic() - t0
            print(f"Removed stale {save_dir.name} in {elapsed:.2f}s")
        save_dir.mkdir(parents=True, exist_ok=True)

        # save training info
        with open(save_dir / "training_info.json", "w") as f:
            # make any numpy items serializable
            serializable_training_info = dict(training_info)
            for k, v in serializable_training_info.items():
                if isinstance(v, torch.Tensor) or isinstance(v, np.ndarray):
                    serializable_training_info[k] = v.item()
            json.dump(serializable_training_info, f)

        # save config
        if run_config is not None:
            with open(save_dir / "config.yaml", "w") as f:
                yaml.safe_dump(run_config.model_dump(), f)

        return Path(os.path.abspath(save_dir))

    def _rename_checkpoint(self, checkpoint_path: PathLike) -> None:
        """Rename tmp_step_N to step_N.

        If step_N already exists (defensive guard for edge cases, e.g. resuming
        training), performs a pseudo-atomic swap via an intermediate old_step_N
        directory.
        """
        checkpoint_path = Path(checkpoint_path)
        step = checkpoint_path.name.split("_")[2]
        to_checkpoint_path = checkpoint_path.parent / f"step_{step}"
        if to_checkpoint_path.exists():
            old_checkpoint_path = checkpoint_path.parent / f"old_step_{step}"
            os.rename(to_checkpoint_path, old_checkpoint_path)
            os.rename(checkpoint_path, to_checkpoint_path)
            if old_checkpoint_path.exists():
                shutil.rmtree(old_checkpoint_path)
        else:
            os.rename(checkpoint_path, to_checkpoint_path)

    def finalize_checkpoint(self, checkpoint_path: PathLike) -> None:
        """Complete a checkpoint synchronously (rename + delete old).

        This is the original synchronous API, preserved for backward
        compatibility. For async-aware usage, prefer begin_finalization() +
        finalize_pending().

        Args:
            checkpoint_path (PathLike): Path to the temporary checkpoint directory.
        """
        self._rename_checkpoint(checkpoint_path)
        self.remove_old_checkpoints()

    def begin_finalization(
        self,
        checkpoint_path: PathLike,
        wait_fn: Optional[Callable[[], None]] = None,
    ) -> None:
        """Start background finalization of a checkpoint.

        Spawns a daemon thread that calls wait_fn (blocks until async writers
        finish), renames tmp_step_N to step_N, then queues old-checkpoint
        deletion. All writes to checkpoint_path must be complete before calling
        this. If a previous finalization is still active, blocks until it
        completes.

        Args:
            checkpoint_path: Path to tmp_step_N directory from init_tmp_checkpoint().
            wait_fn: Callable that blocks until all async writes are complete.
                For Megatron async save: policy.finalize_async_save.
                For sync saves: None (rename immediately).
        """
        self.finalize_pending()
        self._pending_checkpoint_path = Path(checkpoint_path)
        self._finalize_error = None

        def _finalize():
            try:
                if wait_fn is not None:
                    wait_fn()
                self._rename_checkpoint(checkpoint_path)
                # Prune old checkpoints off the critical path. Surface any
                # failure via a done-callback so a broken delete is not silently
                # swallowed (the discarded Future would otherwise hide it).
                delete_future = self._delete_executor.submit(
                    self.remove_old_checkpoints
                )
                delete_future.add_done_callback(self._warn_on_delete_failure)
            except Exception as e:
                self._finalize_error = e
            finally:
                self._pending_checkpoint_path = None

        self._finalize_thread = threading.Thread(target=_finalize, daemon=True)
        self._finalize_thread.start()

    def finalize_pending(self) -> None:
        """Block until the in-flight rename completes. Does NOT wait for deletion.

        Re-raises any exception that occurred in the background thread.
        No-op if nothing is pending. Safe to call multiple times.
        """
        if self._finalize_thread is not None:
            self._finalize_thread.join()
            self._finalize_thread = None
        if self._finalize_error is not None:
            err = self._finalize_error
            self._finalize_error = None
            raise RuntimeError("Background checkpoint finalization failed") from err

    def shutdown(self) -> None:
        """Block until rename + all queued deletions complete. Call at training exit.

        Safe to call multiple times.
        """
        self.finalize_pending()
        self._delete_executor.shutdown(wait=True)
        self._delete_executor = ThreadPoolExecutor(max_workers=1)

    @staticmethod
    def _warn_on_delete_failure(future: "Future[None]") -> None:
        """Surface background old-checkpoint deletion errors as warnings.

        Deletion is best-effort cleanup that runs off the critical path, so a
        failure should not abort training — but it must not be silent either.
        """
        exc = future.exception()
        if exc is not None:
            warnings.warn(
                f"Failed to prune old checkpoints in the background: {exc!r}. "
                "Training is unaffected, but stale checkpoints may remain on disk.",
                stacklevel=2,
            )

    def __enter__(self) -> "CheckpointManager":
        """Enter a context that guarantees shutdown() flushes on exit."""
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> Literal[False]:
        """Flush pending finalizations when leaving the context.

        If an exception is already propagating out of the ``with`` block, the
        flush is best-effort and never masks the original exception. On a normal
        exit, finalization errors propagate so a failed final checkpoint is not
        silently dropped. Always returns ``False`` so exceptions are re-raised.
        """
        if exc_type is not None:
            try:
                self.shutdown()
            except Exception:
                warnings.warn(
                    "Checkpoint finalization failed while handling an exception; "
                    "the original exception will be re-raised.",
                    stacklevel=2,
                )
            return False
        self.shutdown()
        return False

    @property
    def has_pending_finalization(self) -> bool:
        """Whether a background finalization is in-flight."""
        return self._pending_checkpoint_path is not None

    def remove_old_checkpoints(self, exclude_latest: bool = True) -> None:
        """Remove checkpoints that exceed the configured retention limits.

        Retention rules are applied as a union — a checkpoint survives if any
        rule retains it:

        Periodic retention: save_period-aligned checkpoints (step % save_period == 0)
        are always retained. If keep_top_k is set, only the top-k best among them
        are kept; otherwise all periodic checkpoints survive indefinitely.

        keep_top_k: limits periodic checkpoint retention to the top-k best.
        The "best" are determined by:
        - If a metric is provided: the metric value and the higher_is_better setting.
          When multiple checkpoints share the same metric value, more recent
          checkpoints (higher step numbers) are preferred.
        - If no metric is provided: recency. The most recent k are kept.

        ft_keep_latest_k: retains the most recent k checkpoints for crash recovery.
        Applied to all checkpoints regardless of save_period alignment.
        Purely recency-based — metrics are not considered.

        Args:
            exclude_latest (bool): Whether to protect the most recent checkpoint
                from deletion.
        """
        checkpoint_history = _load_checkpoint_history(self.checkpoint_dir)
        if not checkpoint_history:
            return
        if self.keep_top_k is None and self.ft_keep_latest_k is None:
            return

        latest_step = max(step for step, _, _ in checkpoint_history)
        protected_steps: set[int] = set()

        if exclude_latest:
            protected_steps.add(latest_step)

        periodic_history = [
            (s, p, m) for s, p, m in checkpoint_history if s % self.save_period == 0
        ]

        if self.keep_top_k is not None:
            # keep_top_k limits which periodic checkpoints survive
            if self.metric_name is None:
                periodic_history.sort(key=lambda x: x[0], reverse=True)
            else:
                # sort by metric value first, then by step number (for equal metrics, prefer more recent)
                if self.higher_is_better:
                    # For higher_is_better=True: higher metric values first, then higher step numbers
                    periodic_history.sort(
                        key=lambda x: (x[2].get(self.metric_name, -float("inf")), x[0]),
                        reverse=True,
                    )
                else:
                    # For higher_is_better=False: lower metric values first, then higher step numbers for equal values
                    periodic_history.sort(
                        key=lambda x: (x[2].get(self.metric_name, float("inf")), -x[0]),
                    )
            protected_steps.update(s for s, _, _ in periodic_history[: self.keep_top_k])
        else:
            # Without keep_top_k, all periodic checkpoints are retained
            protected_steps.update(s for s, _, _ in periodic_history)

        # ft_keep_latest_k: retain the most recent k checkpoints for crash recovery
        if self.ft_keep_latest_k is not None:
            by_step = sorted(checkpoint_history, key=lambda x: x[0], reverse=True)
            protected_steps.update(s for s, _, _ in by_step[: self.ft_keep_latest_k])

        for step, path, _ in checkpoint_history:
            if step not in protected_steps:
                print(f"Removing checkpoint {path} (step {step})")
                shutil.rmtree(path)

    def get_best_checkpoint_path(self) -> Optional[str]:
        """Get the path to the best checkpoint based on the metric.

        Returns the path to the checkpoint with the best metric value. If no checkpoints
        exist, returns None. If some checkpoints are missing the metric, they are filtered
        out with a warning. If no checkpoints have the metric, returns the latest checkpoint.

        Returns:
            Optional[str]: Path to the best checkpoint, or None if no checkpoints exist.
        """
        checkpoint_history = _load_checkpoint_history(self.checkpoint_dir)
        if len(checkpoint_history) == 0:
            return None

        # Filter checkpoints that have the metric
        valid_checkpoints = [c for c in checkpoint_history if self.metric_name in c[2]]
        ignored_count = len(checkpoint_history) - len(valid_checkpoints)

        if ignored_count > 0:
            ignored_steps = [
                c[0] for c in checkpoint_history if self.metric_name not in c[2]
            ]
            warnings.warn(
                f"Ignoring {ignored_count} checkpoint(s) at step(s) {ignored_steps} that do not have "
                f"metric '{self.metric_name}'. Consider enabling val_at_end or adjusting val_period "
                f"to align with max_steps."
            )

        if len(valid_checkpoints) == 0:
            warnings.warn(
                f"No checkpoints contain metric '{self.metric_name}'. Returning latest checkpoint. "
                f"Consider enabling val_at_end or adjusting val_period to align with max_steps."
            )
            return self.get_latest_checkpoint_path()

        # Sort by metric value first, then by step number so that when multiple
        # checkpoints share the best metric value the most recent one (highest step)
        # is returned. This matches the tie-breaking used by remove_old_checkpoints,
        # which keeps the more recent checkpoint on equal metrics.
        if self.higher_is_better:
            valid_checkpoints.sort(
                key=lambda x: (x[2][self.metric_name], x[0]), reverse=True
            )
        else:
            valid_checkpoints.sort(key=lambda x: (x[2][self.metric_name], -x[0]))
        return str(valid_checkpoints[0][1])

    def get_latest_checkpoint_path(self) -> Optional[str]:
        """Get the path to the latest checkpoint.

        Returns the path to the checkpoint with the highest step number.

        Returns:
            Optional[str]: Path to the latest checkpoint, or None if no checkpoints exist.
        """
        # find checkpoint directory with highest step number
        step_dirs = [
            x
            for x in glob.glob(str(self.checkpoint_dir / "step_*"))
            if re.fullmatch(r"step_\d+", Path(x).name)
        ]
        step_dirs.sort(key=lambda x: int(Path(x).name.split("_")[1]))
        if len(step_dirs) == 0:
            return None
        return str(step_dirs[-1])

    def load_training_info(
        self, checkpoint_path: Optional[PathLike] = None
    ) -> Optional[dict[str, Any]]:
        """Load the training info from a checkpoint.

        Args:
            checkpoint_path (Optional[PathLike]): Path to the checkpoint. If None,
                returns None.

        Returns:
            Optional[dict[str, Any]]: Dictionary containing the training info, or None if
                checkpoint_path is None.
        """
        if checkpoint_path is None:
            return None
        with open(Path(checkpoint_path) / "training_info.json", "r") as f:
            return json.load(f)


def _load_checkpoint_history(
    checkpoint_dir: Path,
) -> list[tuple[int, PathLike, dict[str, Any]]]:
    """Load the history of checkpoints and their metrics.

    Args:
        checkpoint_dir (Path): Directory containing the checkpoints.

    Returns:
        list[tuple[int, PathLike, dict[str, Any]]]: List of tuples containing
            (step_number, checkpoint_path, info) for each checkpoint.
    """
    checkpoint_history: list[tuple[int, PathLike, dict[str, Any]]] = []

    # Find all step directories
    step_dirs = [
        x
        for x in glob.glob(str(checkpoint_dir / "step_*"))
        if re.fullmatch(r"step_\d+", Path(x).name)
    ]

    for step_dir in step_dirs:
        info_file = Path(step_dir) / "training_info.json"
        if info_file.exists():
            with open(info_file) as f:
                info: dict[str, Any] = json.load(f)
                step = int(Path(step_dir).name.split("_")[1])
                checkpoint_history.append((step, step_dir, info))

    return checkpoint_history

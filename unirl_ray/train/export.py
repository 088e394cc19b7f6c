"""Export the trained model as a ``from_pretrained`` folder, optionally registered in MLflow.

``export_model`` is collective: every train rank calls it; the FSDP2-sharded module is gathered
to full CPU tensors on rank 0 only (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``)
and rank 0 writes the folder. The live training module is only read: rank 0 rebuilds a plain copy
of the bundle (``type(bundle).from_config(bundle.config)``: the demo model is rebuilt from its
seed, a real model is loaded again from its folder), loads the gathered weights into the copy's
trainable module and lets the bundle write itself. So a model family adds export with one method,
``save_pretrained(directory) -> str`` (write every component; return the trainable module's
folder), next to the ``from_config`` / ``config`` every bundle has. Rank 0 holds one extra copy of
every component plus the gathered weights in CPU memory while exporting.

With LoRA (peft adapters injected by the backend) the copy gets the adapter the live module applies
(its active one; inactive ones such as an EMA shadow are left out), then:

- ``merge_lora=True``: the adapters are merged into the base weights (peft's ``merge_and_unload``);
  the folder loads without peft.
- ``merge_lora=False``: the folder holds the base weights, and ``lora_adapter/`` the adapters in
  PEFT format (``adapter_model.safetensors`` + ``adapter_config.json``), loadable with
  ``PeftModel.from_pretrained(base_module, "<folder>/lora_adapter")``.

Every export also writes ``unirl_export.json`` (what the folder holds, relative paths). The folder
is written next to its destination as ``<dir>.partial-<pid>`` and renamed into place at the end, so
a failed export never leaves a half-written folder under the requested name.

``register_exported_model`` (driver) uploads a folder as an MLflow 3 logged model of a run and
registers it as a new version of a registered model.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the driver-side helpers (check_export_dir, register_exported_model) need no torch
    import torch
    from torch import nn

log = logging.getLogger(__name__)

ADAPTER_DIR = "lora_adapter"
"""Sub-folder of the PEFT adapter when exporting with ``merge_lora=False``."""
INFO_FILE = "unirl_export.json"
"""File in every exported folder describing what it holds (an ``ExportInfo``, paths relative)."""
_ADAPTER_NAME = "default"  # peft's default adapter name: the exported adapter is saved under it


@dataclass(frozen=True, kw_only=True)
class ExportInfo:
    """What an export wrote (absolute paths; ``unirl_export.json`` stores them relative to ``path``)."""

    path: str
    """The exported folder."""
    model_path: str
    """Folder of the trained module (its class's ``from_pretrained`` target): ``path`` or a sub-folder."""
    adapter_path: str | None
    """PEFT adapter folder (LoRA with ``merge_lora=False``), else ``None``."""
    bundle: str
    """Bundle class that wrote the folder, e.g. ``CausalLMBundle``."""
    trainable_attr: str
    """Bundle attribute of the trained module (``model``, ``transformer``)."""
    lora: bool
    """The trained module carries LoRA adapters."""
    merged_lora: bool
    """LoRA adapters were merged into the exported weights."""
    policy_version: int | None = None
    """Train steps behind the exported weights (the stack's policy version), when known."""

    def to_json(self) -> dict[str, Any]:
        """The info with ``model_path`` / ``adapter_path`` relative to ``path`` (what ``INFO_FILE`` holds)."""
        data = asdict(self)
        data.pop("path")
        data["model_path"] = os.path.relpath(self.model_path, self.path)
        if self.adapter_path is not None:
            data["adapter_path"] = os.path.relpath(self.adapter_path, self.path)
        return data

    @classmethod
    def read(cls, path: str) -> "ExportInfo":
        """Read ``<path>/unirl_export.json`` of an exported folder."""
        path = os.path.abspath(path)
        with open(os.path.join(path, INFO_FILE), encoding="utf-8") as f:
            data = json.load(f)
        data["model_path"] = os.path.normpath(os.path.join(path, data["model_path"]))
        if data.get("adapter_path") is not None:
            data["adapter_path"] = os.path.normpath(os.path.join(path, data["adapter_path"]))
        return cls(path=path, **data)


# ---------------------------------------------------------------------------------------- validation
def check_export_dir(directory: str, *, overwrite: bool = False) -> str:
    """The absolute export folder; ``ValueError`` for a URI, a file, or a non-empty folder without ``overwrite``."""
    if not isinstance(directory, (str, os.PathLike)) or not str(directory).strip():
        raise ValueError(f"export directory must be a non-empty path, got {directory!r}")
    directory = str(directory)
    if "://" in directory:
        raise ValueError(
            f"export directory {directory!r} is a URI; export writes a local folder (on a multi-node cluster a "
            "shared file system path): export there, then register it in MLflow with register_model_name=..."
        )
    path = os.path.abspath(os.path.expanduser(directory))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"export directory {path!r} is an existing file; pass a folder path")
    if os.path.isdir(path) and os.listdir(path) and not overwrite:
        raise ValueError(
            f"export directory {path!r} exists and is not empty; pass overwrite=True to replace it or choose a new folder"
        )
    return path


def is_previous_export(directory: str) -> bool:
    """True when ``directory`` holds an earlier export (its ``unirl_export.json``)."""
    return os.path.isfile(os.path.join(os.path.abspath(os.path.expanduser(directory)), INFO_FILE))


# ------------------------------------------------------------------------------------- train ranks
def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def gather_full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: every weight of ``module`` (frozen ones too) as full CPU tensors on rank 0; ``{}`` elsewhere.

    Names are the module's own (with LoRA: ``....q_proj.base_layer.weight``, ``....lora_A.default.weight``).
    Works on an FSDP2-sharded module and, without a process group, on a plain one.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(module, options=options)
    return state if _rank() == 0 else {}


def trainable_attr_of(bundle: Any, module: nn.Module) -> str:
    """The bundle attribute holding ``module`` (the backend wraps the bundle's module in place)."""
    names = [name for name, value in vars(bundle).items() if value is module]
    if len(names) != 1:
        raise ValueError(
            f"cannot tell which attribute of {type(bundle).__name__} is the trained module (matches: {names}); "
            "the backend must train a module that is an attribute of the bundle"
        )
    return names[0]


def active_adapter(module: nn.Module) -> tuple[str, Any] | None:
    """``(name, peft LoraConfig)`` of the LoRA adapter ``module`` applies in its forward; ``None`` without adapters.

    Only the active adapter is exported (a module may also hold inactive ones, e.g. an EMA shadow).
    """
    configs = getattr(module, "peft_config", None) or {}
    if not configs:
        return None
    from peft.tuners.tuners_utils import BaseTunerLayer

    active = {name for m in module.modules() if isinstance(m, BaseTunerLayer) for name in m.active_adapters}
    if len(active) != 1 or not active <= set(configs):
        raise ValueError(
            f"export writes the one LoRA adapter the model applies, but it applies {sorted(active)} "
            f"(adapters: {sorted(configs)}); activate exactly one before exporting"
        )
    name = active.pop()
    return name, configs[name]


def export_model(
    bundle: Any,
    backend: Any,
    directory: str,
    *,
    merge_lora: bool = True,
    overwrite: bool = False,
    policy_version: int | None = None,
) -> ExportInfo | None:
    """Collective (every train rank): gather ``backend.module`` and write ``directory`` on rank 0.

    Returns the ``ExportInfo`` on rank 0 and ``None`` on the other ranks. The checks that can
    fail on rank 0 alone (the folder) run after the gather, so they cannot leave the others waiting.
    """
    module = backend.module
    if module is None:
        raise ValueError("the backend has no module yet: call backend.setup(...) before exporting")
    attr = trainable_attr_of(bundle, module)
    adapter = active_adapter(module)
    state = gather_full_state(module)
    if _rank() != 0:
        return None
    if adapter is not None:
        state = _only_adapter(state, keep=adapter[0], drop=set(module.peft_config) - {adapter[0]})
    return write_export(
        bundle,
        attr,
        state,
        directory,
        peft_config=None if adapter is None else adapter[1],
        merge_lora=merge_lora,
        overwrite=overwrite,
        policy_version=policy_version,
    )


def _only_adapter(state: dict[str, torch.Tensor], *, keep: str, drop: set[str]) -> dict[str, torch.Tensor]:
    """``state`` without the weights of adapters ``drop``, adapter ``keep`` renamed to peft's ``default``."""
    out = {}
    for key, value in state.items():
        parts = key.split(".")
        # adapter weights are named <layer>.lora_<bank>.<adapter>[.weight]
        where = [i for i in range(1, len(parts)) if parts[i - 1].startswith("lora_") and parts[i] in drop | {keep}]
        if where and parts[where[0]] in drop:
            continue
        if where:
            parts[where[0]] = _ADAPTER_NAME
        out[".".join(parts)] = value
    return out


# ---------------------------------------------------------------------------------------- rank 0
def write_export(
    bundle: Any,
    trainable_attr: str,
    state: dict[str, torch.Tensor],
    directory: str,
    *,
    peft_config: Any = None,
    merge_lora: bool = True,
    overwrite: bool = False,
    policy_version: int | None = None,
) -> ExportInfo:
    """Rank 0: write a copy of ``bundle`` whose trainable module holds ``state`` (see the module docstring).

    ``state`` uses the live module's names with the adapter named ``default``; ``peft_config`` is
    the peft ``LoraConfig`` of that adapter (``None``: no LoRA). ``bundle`` itself is not modified.
    """
    final = check_export_dir(directory, overwrite=overwrite)
    if peft_config is None and not merge_lora:
        log.warning("export: merge_lora=False has no effect, the model has no LoRA adapters (full weights written)")
    staging = f"{final}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        log.info("export: rebuilding %s on rank 0 to write it with the trained weights", type(bundle).__name__)
        fresh = type(bundle).from_config(bundle.config)
        module = getattr(fresh, trainable_attr)
        adapter_dir = None
        if peft_config is None:
            _load_exact(module, state)
        else:
            adapter_dir = _apply_lora(module, state, peft_config, merge_lora=merge_lora, staging=staging)
        model_dir = os.path.abspath(fresh.save_pretrained(staging))
        info = ExportInfo(
            path=final,
            model_path=os.path.normpath(os.path.join(final, os.path.relpath(model_dir, staging))),
            adapter_path=None if adapter_dir is None else os.path.join(final, ADAPTER_DIR),
            bundle=type(bundle).__name__,
            trainable_attr=trainable_attr,
            lora=peft_config is not None,
            merged_lora=peft_config is not None and merge_lora,
            policy_version=policy_version,
        )
        if adapter_dir is not None:
            _set_adapter_base_path(adapter_dir, info.model_path)
        with open(os.path.join(staging, INFO_FILE), "w", encoding="utf-8") as f:
            json.dump(info.to_json(), f, indent=2)
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.replace(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("export: wrote %s (model in %s)", final, info.model_path)
    return info


def _load_exact(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` into ``module``; every weight must be covered and nothing left over."""
    result = module.load_state_dict(state, strict=False)
    shared = _shared_names(module)
    missing = [k for k in result.missing_keys if k not in shared]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"the gathered weights do not match a fresh {type(module).__name__}: missing {missing[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}; the bundle's from_config must rebuild the trained architecture"
        )


def _shared_names(module: nn.Module) -> set[str]:
    """Names of parameters that alias an earlier one (tied weights), which a state dict may omit."""
    seen: set[int] = set()
    aliases = set()
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            aliases.add(name)
        seen.add(id(param))
    return aliases


def _apply_lora(
    module: nn.Module, state: dict[str, torch.Tensor], peft_config: Any, *, merge_lora: bool, staging: str
) -> str | None:
    """Give ``module`` the same adapters, load ``state``, then merge or save the adapters (PEFT format).

    Leaves ``module`` a plain module (no peft layers) holding merged or base weights; returns the
    adapter folder when the adapters were saved separately.
    """
    from peft import get_peft_model

    config = copy.deepcopy(peft_config)
    config.inference_mode = False
    # autocast_adapter_dtype=False: keep adapters in the model's dtype, as the backend's injection does
    peft_model = get_peft_model(module, config, adapter_name=_ADAPTER_NAME, autocast_adapter_dtype=False)
    _load_exact(module, state)  # peft injects in place: ``module`` has the live module's names
    if merge_lora:
        peft_model.merge_and_unload(safe_merge=True)
        return None
    adapter_dir = os.path.join(staging, ADAPTER_DIR)
    peft_model.save_pretrained(adapter_dir, selected_adapters=[_ADAPTER_NAME])
    peft_model.unload()
    return adapter_dir


def _set_adapter_base_path(adapter_dir: str, model_path: str) -> None:
    """Record the exported base module's folder as the adapter's ``base_model_name_or_path``."""
    config_path = os.path.join(adapter_dir, "adapter_config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config["base_model_name_or_path"] = model_path
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)


# ----------------------------------------------------------------------------------------- driver
@dataclass(frozen=True, kw_only=True)
class RegisteredExport:
    """An export registered in MLflow."""

    name: str
    """Registered model name."""
    version: int
    """The new version of it."""
    model_id: str
    """MLflow logged model holding the folder (``models:/<model_id>``)."""
    run_id: str
    """Run the logged model belongs to."""
    artifact_uri: str
    """Where MLflow stored the folder."""

    @property
    def uri(self) -> str:
        """``models:/<name>/<version>``: ``mlflow.artifacts.download_artifacts(uri)`` returns the folder."""
        return f"models:/{self.name}/{self.version}"


def register_exported_model(
    path: str, *, name: str, tracking_uri: str, run_id: str, registry_uri: str | None = None
) -> RegisteredExport:
    """Upload exported folder ``path`` to run ``run_id`` as an MLflow logged model; register it as ``name``.

    The folder keeps its layout (download ``models:/<name>/<version>`` and call ``from_pretrained``
    on it); the logged model gets the export's facts as params. The registry is ``registry_uri``,
    else env ``MLFLOW_REGISTRY_URI``, else the tracking store. Raises ``ValueError`` when ``path``
    is not an export readable here (on a multi-node cluster export to a shared file system).
    """
    from mlflow import MlflowClient
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import ALREADY_EXISTS, RESOURCE_ALREADY_EXISTS, ErrorCode

    if not name or not isinstance(name, str):
        raise ValueError(f"register_model_name must be a non-empty string, got {name!r}")
    if not is_previous_export(path):
        raise ValueError(
            f"{path!r} has no {INFO_FILE} on this machine: the export is written by train rank 0; on a "
            "multi-node cluster export to a folder the driver can read (a shared file system)"
        )
    info = ExportInfo.read(path)
    registry_uri = registry_uri or os.environ.get("MLFLOW_REGISTRY_URI") or tracking_uri
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=registry_uri)
    run = client.get_run(run_id)
    params = {k: str(v) for k, v in info.to_json().items()}
    logged = client.create_logged_model(
        run.info.experiment_id, name=name, source_run_id=run_id, params=params, tags={"unirl.bundle": info.bundle}
    )
    try:
        client.log_model_artifacts(logged.model_id, path)
    except BaseException:
        client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
        raise
    logged = client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
    client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step=0)])  # listed under the run's models
    try:
        client.create_registered_model(name)
    except MlflowException as exc:
        if exc.error_code not in (ErrorCode.Name(RESOURCE_ALREADY_EXISTS), ErrorCode.Name(ALREADY_EXISTS)):
            raise
    # source = the stored folder: a ``models:/<id>`` source makes MLflow's SQL registry resolve the
    # logged model through the process-global tracking URI instead of this client's (and the SQL
    # registry does not keep model_id), so the logged model's id is also a version tag
    version = client.create_model_version(
        name,
        source=logged.artifact_location,
        run_id=run_id,
        tags={"unirl.logged_model_id": logged.model_id},
        model_id=logged.model_id,
    )
    return RegisteredExport(
        name=name,
        version=int(version.version),
        model_id=logged.model_id,
        run_id=run_id,
        artifact_uri=logged.artifact_location,
    )

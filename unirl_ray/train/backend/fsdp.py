"""``FSDPBackend``: owns the trainable model on a train rank.

Order of construction (``setup``), as the seed prescribes: pick the trainable module from the
bundle (full fine-tuning trains all of it except what its ``frozen_parameters()`` names, if it has that
method: e.g. Janus' understanding tower and VQ model, which no RL loss reaches); structural injection with the same seed on every rank (LoRA, or the NFT adapter pair of
``EmaLoraConfig``; the mirror-EMA plan of ``EmaFullConfig``); a frozen reference copy when the
algorithm needs one and no adapter can be switched off; FSDP2 ``fully_shard`` on every configured
block class then on the root; the mirror-EMA shadows (cloned from the shards); then the optimizer
and LR schedule. Without an initialised process group (a single process, e.g. unit tests or the
bare benchmark) the module is used unwrapped.

Besides training, the backend switches weights for sampling and evaluation (``reference``,
``shadow_policy``, ``ema_weights``), hands its device memory to a colocated engine and takes it
back (``offload`` / ``onload``), and saves / restores everything an exact resume needs (``save`` /
``load``: weights, optimizer, EMA shadows, per-rank RNG states, schedule).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
from collections.abc import Callable
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from unirl_ray.config.checks import check_choice
from unirl_ray.train.backend import checkpoint, dcp_io
from unirl_ray.train.backend.ema import AdapterEma, MirrorEma, exchange_, local
from unirl_ray.train.backend.lora import inject_lora, tuner_layers
from unirl_ray.train.backend.offload import StorageOffloader, canonical_device, own_storage
from unirl_ray.train.backend.wrap import (
    apply_activation_checkpointing,
    apply_fsdp,
    build_mesh,
    fsdp_modules,
    gathered_forwards,
    reshard_all,
)
from unirl_ray.train.configs import (
    EmaFullConfig,
    EmaLoraConfig,
    EmaTiming,
    FSDPConfig,
    LoraConfig,
    LrSchedulerConfig,
    OptimizerConfig,
    TrainTopology,
    check_backend_config,
)

log = logging.getLogger(__name__)

class FSDPBackend:
    """The trainable model, its optimizer / schedule, its EMA shadows, and its checkpoint."""

    def __init__(
        self,
        *,
        block_class_names: list[str],
        trainable_attr: str,
        fsdp_cfg: FSDPConfig | None = None,
        optimizer_cfg: OptimizerConfig | None = None,
        lr_scheduler_cfg: LrSchedulerConfig | None = None,
        lora_cfg: LoraConfig | None = None,
        ema_lora_cfg: EmaLoraConfig | None = None,
        ema_full_cfg: EmaFullConfig | None = None,
        seed: int = 0,
        bundle: Any = None,
    ) -> None:
        if not block_class_names:
            raise ValueError("FSDPBackend.block_class_names is empty: name the transformer block class(es) to shard")
        configs = dict(fsdp_cfg=fsdp_cfg, optimizer_cfg=optimizer_cfg, lr_scheduler_cfg=lr_scheduler_cfg,
                       lora_cfg=lora_cfg, ema_lora_cfg=ema_lora_cfg, ema_full_cfg=ema_full_cfg)
        for name, value in configs.items():
            check_backend_config(name, value)
        if lora_cfg is not None and ema_lora_cfg is not None:
            raise ValueError(
                "FSDPBackend got both lora_cfg and ema_lora_cfg: EmaLoraConfig already injects the LoRA adapters "
                "(a trainable one and its EMA shadow). Drop lora_cfg and put rank/alpha/target_modules in ema_lora_cfg."
            )
        self.block_class_names = list(block_class_names)
        self.trainable_attr = trainable_attr
        self.fsdp_cfg = fsdp_cfg or FSDPConfig()
        self.optimizer_cfg = optimizer_cfg or OptimizerConfig()
        self.lr_scheduler_cfg = lr_scheduler_cfg or LrSchedulerConfig()
        self.lora_cfg = lora_cfg
        self.ema_lora_cfg = ema_lora_cfg
        self.ema_full_cfg = ema_full_cfg
        self.seed = seed
        self.bundle = bundle
        self.module: nn.Module | None = None
        self.reference_module: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.optimizer_steps = 0
        self.topology = TrainTopology()
        self.device = torch.device("cpu")
        self.adapter_ema: AdapterEma | None = None
        self.mirror_ema: MirrorEma | None = None
        self._offloader: StorageOffloader | None = None
        self._ema_swapped = False

    # ------------------------------------------------------------------ setup
    def setup(self, *, topology: TrainTopology, device: torch.device, needs_reference: bool = False) -> None:
        """Build the trainable module on ``device``; collective when a process group exists."""
        if self.bundle is None:
            raise ValueError("FSDPBackend needs bundle=... (the trainer passes the built bundle)")
        module = getattr(self.bundle, self.trainable_attr, None)
        if not isinstance(module, nn.Module):
            raise ValueError(
                f"FSDPBackend.trainable_attr={self.trainable_attr!r}: the bundle has no nn.Module attribute by that name"
            )
        self.topology, self.device = topology, canonical_device(device)
        self._check_block_classes(module)
        module.to(device)
        module.requires_grad_(False)
        if needs_reference and not self._has_adapters:
            self.reference_module = copy.deepcopy(module).eval()
        torch.manual_seed(self.seed)  # identical adapter init on every rank
        if self.lora_cfg is not None:
            inject_lora(module, self.lora_cfg)
        elif self.ema_lora_cfg is not None:
            self.adapter_ema = AdapterEma.inject(module, self.ema_lora_cfg)
        else:
            module.requires_grad_(True)
            for param in getattr(module, "frozen_parameters", lambda: [])():  # parts the RL losses never reach
                param.requires_grad_(False)
        module.to(device)
        own_storage([module, self.reference_module])  # a colocated layout frees it between steps
        if self.ema_full_cfg is not None:
            self.mirror_ema = MirrorEma.plan(module, self.ema_full_cfg)
        self._wrapped = self._shards()
        if self._wrapped:
            mesh = build_mesh(self.fsdp_cfg, self.device)
            for m in (module, self.reference_module):
                if m is not None:
                    apply_fsdp(m, cfg=self.fsdp_cfg, mesh=mesh, device=self.device, block_class_names=self.block_class_names)
        else:
            if self.fsdp_cfg.activation_checkpointing:
                apply_activation_checkpointing(module, self.block_class_names)
            if self.fsdp_cfg.cpu_offload:
                log.warning("FSDPConfig.cpu_offload is ignored: no process group, the module is used unsharded on %s", device)
        self.module = module
        if self.mirror_ema is not None:
            self.mirror_ema.materialize(module)
        self._offloader = StorageOffloader(self.device)
        for m in (module, self.reference_module):
            if m is not None:
                m.register_forward_pre_hook(self._refuse_when_offloaded, prepend=True)
        self._build_optimizer()

    def _shards(self) -> bool:
        """Whether to wrap with FSDP2. A single rank in full precision without CPU offload runs the
        module unwrapped: FSDP2 would only add per-block hooks and copies there (nothing to shard)."""
        if not self._distributed:
            return False
        cfg = self.fsdp_cfg
        single = dist.get_world_size() == 1 and not cfg.cpu_offload and cfg.param_dtype == "float32"
        if single:
            log.info("one train rank in float32: the module runs without the FSDP2 wrap (nothing to shard)")
        return not single

    @property
    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def _rank(self) -> int:
        return dist.get_rank() if self._distributed else 0

    @property
    def _has_adapters(self) -> bool:
        return self.lora_cfg is not None or self.ema_lora_cfg is not None

    def _check_block_classes(self, module: nn.Module) -> None:
        present = {type(m).__name__ for m in module.modules()}
        missing = [name for name in self.block_class_names if name not in present]
        if missing:
            import difflib

            hints = {n: difflib.get_close_matches(n, present, n=3) for n in missing}
            raise ValueError(
                f"FSDPBackend.block_class_names {missing} not found in {type(module).__name__}; "
                f"closest classes in the model: {hints}. Set backend.block_class_names to the model's block class."
            )

    def _build_optimizer(self) -> None:
        params = [p for p in self.module.parameters() if p.requires_grad]
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        cfg = self.optimizer_cfg
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        # fused=False would pick torch's slowest (single-tensor) loop: leave it unset for the foreach default
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=cfg.betas, eps=cfg.eps,
                                           **({"fused": True} if cfg.fused else {}))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.lr_scheduler_cfg.factor)

    # --------------------------------------------------------------- training
    def trainable_parameters(self) -> Iterator[nn.Parameter]:
        return (p for p in self.module.parameters() if p.requires_grad)

    @contextlib.contextmanager
    def reference(self) -> Iterator[nn.Module]:
        """The frozen reference policy: adapters disabled (LoRA) or the initial copy (full)."""
        self._require_onloaded("reference()")
        if self._has_adapters:
            layers = tuner_layers(self.module)
            flags = [(p, p.requires_grad) for p in self.module.parameters()]
            for layer in layers:
                layer.enable_adapters(False)
            try:
                yield self.module
            finally:
                for layer in layers:
                    layer.enable_adapters(True)
                for p, flag in flags:  # peft re-marks the active adapter trainable; keep what trains
                    if p.requires_grad != flag:
                        p.requires_grad_(flag)
        elif self.reference_module is not None:
            yield self.reference_module
        else:
            raise RuntimeError("no reference model was built: setup(needs_reference=True) is required")

    @contextlib.contextmanager
    def sampling(self) -> Iterator[nn.Module]:
        """Keep gathered parameters across the many no-grad forwards of sampling, then reshard.

        Decoding calls the model once per token; resharding after each call would all-gather the
        weights again every time. No-grad forwards inside also skip FSDP2's per-call hooks
        (``wrap.gathered_forwards``). Every sharded module is resharded on exit (the root's reshard
        does not reach its blocks).
        """
        self._require_onloaded("sampling()")
        sharded = fsdp_modules(self.module)
        for m in sharded:
            m.set_reshard_after_forward(False)
        try:
            with gathered_forwards(self.module):
                yield self.module
        finally:
            for m in sharded:
                m.set_reshard_after_forward(self.fsdp_cfg.reshard_after_forward)
                m.reshard()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self, max_grad_norm: float | None) -> dict[str, float]:
        """Clip, step, advance the schedule (and an EMA timed per optimizer step); returns
        ``grad_norm`` (pre-clip) and ``lr``."""
        self._require_live_weights("optimizer_step()")
        if max_grad_norm is not None and not max_grad_norm > 0:  # torch would scale every gradient by a negative factor
            raise ValueError(f"max_grad_norm must be > 0 or None (no clipping), got {max_grad_norm!r}")
        params = list(self.trainable_parameters())
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=float("inf") if max_grad_norm is None else max_grad_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        if not torch.isfinite(norm):  # the same total norm on every rank: every rank stops here
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(
                f"the gradient norm is {float(norm)} before optimizer step {self.optimizer_steps + 1}: the optimizer "
                "did not step (clipping cannot repair a non-finite gradient). Look at this step's rewards, "
                "advantages and learning rate; the weights are those of the last step"
            )
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        self.update_ema(timing="optimizer_step")
        return {"grad_norm": float(norm), "lr": float(lr)}

    # -------------------------------------------------------------------- EMA
    def update_ema(self, *, timing: EmaTiming) -> dict[str, float]:
        """Apply the EMA updates configured with this ``timing`` (``rollout_end``: once per train
        step, called by ``TrainStack.train``; ``optimizer_step``: by ``optimizer_step``).
        Returns the decays used, e.g. ``{"train/ema_lora_decay": 0.001}``."""
        check_choice("update_ema(timing=...)", timing, EmaTiming)
        out: dict[str, float] = {}
        for key, ema in (("lora", self.adapter_ema), ("full", self.mirror_ema)):
            if ema is not None and ema.cfg.timing == timing:
                self._require_live_weights("update_ema()")
                out[f"train/ema_{key}_decay"] = ema.update()
        return out

    @contextlib.contextmanager
    def shadow_policy(self) -> Iterator[nn.Module]:
        """The NFT "old" policy: forwards inside use the shadow (EMA) adapter, the trainable
        adapter again after. Switches the active adapter only; no weight moves."""
        if self.adapter_ema is None:
            raise ValueError("shadow_policy() needs the NFT adapter pair: set backend.ema_lora_cfg (EmaLoraConfig)")
        self._require_onloaded("shadow_policy()")
        with self.adapter_ema.shadow_active() as module:
            yield module

    @contextlib.contextmanager
    def ema_weights(self) -> Iterator[nn.Module]:
        """Evaluate or export with the EMA weights: inside, the trainable weights of the live module
        hold the EMA values (the mirror EMA when configured, else the NFT shadow adapter); on exit
        they are swapped back exactly. Swaps local shards in place (no communication); gathered
        copies are dropped on entry and exit so forwards see the swapped shards."""
        ema = self.mirror_ema or self.adapter_ema
        if ema is None:
            raise ValueError("ema_weights() needs an EMA: set backend.ema_full_cfg (EmaFullConfig) or backend.ema_lora_cfg")
        self._require_live_weights("ema_weights()")
        pairs = ema.pairs()
        reshard_all(self.module)
        exchange_(pairs)
        self._ema_swapped = True
        try:
            yield self.module
        finally:
            reshard_all(self.module)
            exchange_(pairs)
            self._ema_swapped = False

    # --------------------------------------------------------- onload/offload
    def offloaded(self) -> bool:
        """True while the backend's device memory is handed back (between offload and onload)."""
        return self._offloader is not None and self._offloader.offloaded

    def offload(self) -> int:
        """Free this rank's device memory for a colocated engine: parameters (frozen ones too),
        gradients, optimizer state, EMA shadows and buffers are copied to host memory and their
        device storages released. Returns the bytes freed (0 when already offloaded)."""
        if self.offloaded():
            return 0
        reshard_all(self.module)
        if self.reference_module is not None:
            reshard_all(self.reference_module)
        return self._offloader.offload(self._device_tensors())

    def onload(self) -> int:
        """Bring everything ``offload`` moved back onto the device, bit for bit. Returns the bytes restored."""
        return self._offloader.onload() if self._offloader is not None else 0

    def device_bytes(self) -> int:
        """Bytes of the distinct device storages the train state (parameters, gradients, optimizer
        state, EMA shadows, buffers) currently holds on this rank's device."""
        seen: dict[int, int] = {}
        for tensor in self._device_tensors():
            if tensor is None:
                continue
            t = local(tensor)
            if t.device == self.device:
                storage = t.untyped_storage()
                seen.setdefault(storage.data_ptr(), storage.nbytes())
        return sum(seen.values())

    def _device_tensors(self) -> Iterator[torch.Tensor | None]:
        for m in (self.module, self.reference_module):
            if m is None:
                continue
            for p in m.parameters():
                yield p
                yield p.grad
            yield from m.buffers()
        for state in self.optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))
        if self.mirror_ema is not None:
            yield from self.mirror_ema.shadow.values()

    def _require_onloaded(self, what: str) -> None:
        if self.offloaded():
            raise RuntimeError(f"FSDPBackend is offloaded (backend.offload()): call backend.onload() before {what}")

    def _require_live_weights(self, what: str) -> None:
        self._require_onloaded(what)
        if self._ema_swapped:
            raise RuntimeError(f"{what} inside ema_weights(): the live weights are swapped out; leave the block first")

    def _refuse_when_offloaded(self, module: nn.Module, args: Any) -> None:
        self._require_onloaded(f"a forward of {type(module).__name__}")

    # ------------------------------------------------------------- checkpoint
    def _dcp_state(self) -> dict[str, Any]:
        """Tensor state in DCP form: trainable weights (+ NFT shadow adapter), optimizer state,
        mirror-EMA shadows, and this rank's RNG states under its own key."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        # Frozen parameters are kept here only to pick the shadow adapter out; sharded state dicts
        # hold references, not gathered copies, so this costs nothing.
        model = get_model_state_dict(self.module, options=StateDictOptions(ignore_frozen_params=False))
        names = self._trainable_names() | (self.adapter_ema.shadow_names() if self.adapter_ema else set())
        state: dict[str, Any] = {"model": {k: v for k, v in model.items() if k in names}}
        optim = get_optimizer_state_dict(self.module, self.optimizer, options=StateDictOptions(ignore_frozen_params=True))
        state["optim"] = optim["state"]
        if self.mirror_ema is not None:
            state["ema"] = dict(self.mirror_ema.shadow)
        state["rng"] = {checkpoint.rng_key(self._rank): checkpoint.rng_state(self.device)}
        return state

    def _trainable_names(self) -> set[str]:
        return {name for name, p in self.module.named_parameters() if p.requires_grad}

    def save(self, directory: str) -> dict[str, Any]:
        """Collective: write this rank's DCP shards; returns small JSON-able backend state."""
        self._require_live_weights("save()")
        os.makedirs(directory, exist_ok=True)
        dcp_io.save(self._dcp_state(), directory)
        return self._save_meta()

    def save_async(self, directory: str) -> tuple[dict[str, Any], Callable[[], None]]:
        """``save`` in two parts: this rank's shards are copied to CPU memory before this returns (training
        may change the weights right after); the returned function writes the copy (collective over the
        checkpoint group: a background thread of every rank calls it). Returns the backend state (as of
        now) and that function."""
        self._require_live_weights("save()")
        os.makedirs(directory, exist_ok=True)
        staged = dcp_io.stage(self._dcp_state())
        return self._save_meta(), functools.partial(dcp_io.save_staged, staged, directory)

    def _save_meta(self) -> dict[str, Any]:
        return {
            "optimizer_steps": self.optimizer_steps,
            "scheduler": checkpoint.scheduler_state(self.scheduler),
            "ema_updates": {
                "lora": self.adapter_ema.updates if self.adapter_ema else None,
                "full": self.mirror_ema.updates if self.mirror_ema else None,
            },
            "world_size": dist.get_world_size() if self._distributed else 1,
        }

    def load(self, directory: str, meta: dict[str, Any]) -> None:
        """Collective: restore weights, optimizer, EMA shadows (any world size, DCP reshards), this
        rank's RNG states (when the checkpoint has this rank's) and the schedule."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        self._require_live_weights("load()")
        checkpoint.init_adamw_state(self.optimizer)
        state = self._dcp_state()
        shadow_names = self.adapter_ema.shadow_names() if self.adapter_ema else set()
        restart = checkpoint.drop_absent(state, dcp_io.stored_keys(directory), rank=self._rank, adapter_shadow=shadow_names)
        dcp_io.load(state, directory)
        options = StateDictOptions(ignore_frozen_params=False, strict=False)
        set_model_state_dict(self.module, state["model"], options=options)
        optim_options = StateDictOptions(ignore_frozen_params=True, strict=False)
        full = get_optimizer_state_dict(self.module, self.optimizer, options=optim_options)
        full["state"] = state["optim"]
        set_optimizer_state_dict(self.module, self.optimizer, full, options=optim_options)
        self.optimizer_steps = int(meta["optimizer_steps"])
        checkpoint.load_scheduler_state(self.scheduler, meta, self.lr_scheduler_cfg.factor)
        updates = meta.get("ema_updates") or {}
        for key, ema in (("lora", self.adapter_ema), ("full", self.mirror_ema)):
            if ema is None:
                continue
            if key in restart:
                log.warning("checkpoint %s has no %s EMA shadow: the EMA restarts from the loaded weights", directory, key)
                ema.updates = 0
                ema.reset_to_live()
            else:
                ema.updates = int(updates.get(key) or 0)
        if "rng" in state:
            checkpoint.set_rng_state(state["rng"][checkpoint.rng_key(self._rank)], self.device)

    def full_trainable_state_dict(self, snapshot: bool = True) -> dict[str, torch.Tensor]:
        """Collective: the full (unsharded) trainable weights on rank 0, CPU; ``{}`` elsewhere.
        Inside ``ema_weights()`` these are the EMA weights (same names).

        A snapshot: it never shares memory with the live parameters. (Unsharded on the CPU, torch would
        hand out the parameters themselves; a later step would then change the snapshot, and turning
        it into numpy for the object store would pin the parameters' storage, which ``offload`` must free.)
        ``snapshot=False`` skips that copy for a caller that reads the tensors before the next step and
        never through numpy (the weight sync's ``stage_weights``).

        An unwrapped module (one float32 rank, or no process group) hands out its trainable parameters
        by name, without DCP's state-dict machinery (the same names and values; DCP's per-tensor
        planning took 7-25 ms for the few hundred LoRA adapters of a 100M-500M model)."""
        self._require_onloaded("full_trainable_state_dict()")
        names = self._trainable_names()
        if getattr(self, "_wrapped", True):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
            state = get_model_state_dict(self.module, options=options)
        else:
            state = {k: p.detach().cpu() for k, p in self.module.named_parameters() if k in names}
        live = {local(t).untyped_storage().data_ptr() for t in self._device_tensors() if t is not None}
        return {k: v.clone() if snapshot and v.untyped_storage().data_ptr() in live else v
                for k, v in state.items() if k in names}

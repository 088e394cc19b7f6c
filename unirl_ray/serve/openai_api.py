"""An OpenAI-compatible HTTP API over a trained model, as a FastAPI app: a causal LM (Hugging Face ``generate``)
or a text-to-image pipeline (diffusers).

Routes: ``GET /v1/models``; for a causal LM ``POST /v1/completions`` and ``POST /v1/chat/completions`` (both with
``"stream": true`` as server-sent events ending in ``data: [DONE]``); for a text-to-image model
``POST /v1/images/generations`` (base64 PNGs, ``size`` as ``WxH``; ``seed``, ``num_inference_steps`` and
``guidance_scale`` as extras). ``load_policy`` picks the kind from the folder. The official ``openai`` client
talks to it unchanged. Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for a
request the model cannot serve (a bad field, a prompt longer than the model's context, streaming with ``n > 1``,
a size the model cannot draw, a route of the other kind of model), 401 for a missing or wrong API key (when the
app has one), 404 for another model's name.

This module needs no Ray: ``create_app(policy)`` is a plain FastAPI app (run it with uvicorn, or test it with
the ``openai`` client); ``unirl_ray.serve.deployment`` puts it behind Ray Serve.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import hmac
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

MAX_N = 16
"""Most choices one request may ask for (``n``)."""


class APIError(Exception):
    """An error answered in OpenAI's shape with ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


# ------------------------------------------------------------------------------------------------ policy
IMAGE_BUNDLES = ("SD3Bundle",)
"""Exports served on ``/v1/images/generations`` (text-to-image pipelines)."""


def model_folder(folder: str) -> tuple[str, str, Any, Literal["text", "image"]]:
    """``(folder, model_path, export_info, kind)`` of a folder the policy app can serve: an export of a causal LM
    or a Hugging Face model folder (``kind`` ``"text"``: ``model_path`` holds ``config.json``), or an export of a
    text-to-image model or a diffusers pipeline folder (``"image"``: ``model_path`` holds ``model_index.json``);
    ``export_info`` is the ``ExportInfo`` of an export, else ``None``. ValueError saying what the folder is
    instead."""
    from unirl_ray.train.export import ExportInfo, is_previous_export

    folder = os.path.abspath(os.path.expanduser(folder))
    if not os.path.isdir(folder):
        raise ValueError(f"model folder {folder!r} does not exist (pass an exported folder, a Hugging Face model "
                         "folder, or an MLflow URI such as models:/<name>/<version>)")
    info = ExportInfo.read(folder) if is_previous_export(folder) else None
    if info is not None and info.bundle not in ("CausalLMBundle", *IMAGE_BUNDLES):
        raise ValueError(f"{folder!r} holds a {info.bundle} export; the policy app serves causal LMs (CausalLMBundle "
                         f"exports and Hugging Face *ForCausalLM folders) and text-to-image pipelines "
                         f"({', '.join(IMAGE_BUNDLES)} exports and diffusers pipeline folders)")
    if (info is not None and info.bundle in IMAGE_BUNDLES) or \
            (info is None and os.path.isfile(os.path.join(folder, "model_index.json"))):
        if not os.path.isfile(os.path.join(folder, "model_index.json")):
            raise ValueError(f"{folder!r} has no model_index.json: not a diffusers pipeline folder")
        return folder, folder, info, "image"
    model_path = info.model_path if info is not None else folder
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise ValueError(f"{model_path!r} has no config.json: neither an exported folder (unirl_export.json), a "
                         "Hugging Face model folder nor a diffusers pipeline folder (model_index.json)")
    return folder, model_path, info, "text"


def load_policy(folder: str, *, name: str | None = None, torch_dtype: str = "float32") -> TextPolicy | ImagePolicy:
    """The policy for ``folder`` (see ``model_folder``): a ``TextPolicy`` or an ``ImagePolicy``."""
    kind = model_folder(folder)[3]
    return (TextPolicy if kind == "text" else ImagePolicy)(folder, name=name, torch_dtype=torch_dtype)


@dataclass(frozen=True)
class Choice:
    """One generated continuation."""

    text: str
    finish_reason: Literal["stop", "length"]
    completion_tokens: int


class TextPolicy:
    """A causal LM folder loaded for generation: an export of this project (``unirl_export.json``: LoRA adapters
    kept apart are merged on load) or any Hugging Face ``*ForCausalLM`` folder with its tokenizer.

    ``generate`` / ``stream`` run one request at a time (a lock: the model and torch's global RNG, which ``seed``
    sets, are shared by the threads of a server).
    """

    def __init__(self, folder: str, *, name: str | None = None, torch_dtype: str = "float32") -> None:
        from unirl_ray.models.causal_lm import CausalLMBundle, CausalLMConfig

        folder, model_path, info, kind = model_folder(folder)
        if kind != "text":
            raise ValueError(f"{folder!r} is a text-to-image pipeline: serve it with ImagePolicy (load_policy picks it)")
        bundle = CausalLMBundle.from_config(CausalLMConfig(pretrained_model_path=model_path, torch_dtype=torch_dtype))
        model = bundle.model
        if info is not None and info.adapter_path is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, info.adapter_path).merge_and_unload()
        self.model = model.eval()
        self.tokenizer = bundle.tokenizer
        self.name = name or os.path.basename(folder.rstrip(os.sep))
        self.policy_version = info.policy_version if info is not None else None
        self.context_length = int(getattr(self.model.config, "max_position_embeddings", 0) or 0) or None
        self.created = int(time.time())
        self._lock = threading.Lock()

    # -------------------------------------------------------------------------------- prompts
    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, f"model {self.name!r} has no chat template: use /v1/completions", param="messages")
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # noqa: BLE001 - a template that rejects these messages (roles, order)
            raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from None
        if hasattr(ids, "keys"):  # a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def text_prompt_ids(self, prompt: str) -> list[int]:
        return [int(t) for t in self.tokenizer(prompt, add_special_tokens=True)["input_ids"]]

    def check_length(self, prompt_ids: list[int], max_tokens: int) -> None:
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        if self.context_length is not None and len(prompt_ids) + max_tokens > self.context_length:
            raise APIError(400, f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                                f"model's context length ({self.context_length}); shorten the prompt or lower "
                                "max_tokens", param="max_tokens", code="context_length_exceeded")

    # ---------------------------------------------------------------------------- generation
    def _prepare(self, prompt_ids: list[int], max_tokens: int, temperature: float, top_p: float,
                 stop: list[str]) -> tuple[Any, dict[str, Any]]:
        """The input tensor and ``generate``'s keyword arguments of one request (its length checked)."""
        import torch

        self.check_length(prompt_ids, max_tokens)
        inputs = torch.tensor([prompt_ids], dtype=torch.long, device=self.model.device)
        kwargs: dict[str, Any] = {"max_new_tokens": max_tokens, "pad_token_id": self.tokenizer.pad_token_id,
                                  "eos_token_id": self.tokenizer.eos_token_id, "attention_mask": torch.ones_like(inputs)}
        if temperature > 0:
            kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if stop:
            kwargs.update(stop_strings=stop, tokenizer=self.tokenizer)
        return inputs, kwargs

    def _finish(self, new_ids: list[int], max_tokens: int, stop: list[str]) -> Choice:
        eos = self.tokenizer.eos_token_id
        ended = bool(new_ids) and new_ids[-1] == eos
        text = self.tokenizer.decode(new_ids[:-1] if ended else new_ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
        if cut >= 0:
            return Choice(text[:cut], "stop", len(new_ids))
        return Choice(text, "stop" if ended or len(new_ids) < max_tokens else "length", len(new_ids))

    def generate(self, prompt_ids: list[int], *, max_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 n: int = 1, stop: list[str] | None = None, seed: int | None = None) -> list[Choice]:
        """``n`` continuations of ``prompt_ids`` (sampled at ``temperature`` > 0, greedy at 0)."""
        import torch

        stop = list(stop or [])
        inputs, kwargs = self._prepare(prompt_ids, max_tokens, temperature, top_p, stop)
        choices = []
        with self._lock, torch.no_grad():
            if seed is not None:
                torch.manual_seed(seed)
            for _ in range(n):
                out = self.model.generate(inputs, **kwargs)
                choices.append(self._finish(out[0, len(prompt_ids):].tolist(), max_tokens, stop))
        return choices

    def stream(self, prompt_ids: list[int], *, max_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
               stop: list[str] | None = None, seed: int | None = None) -> Iterator[str | Choice]:
        """The text of one continuation as it is generated (pieces), then its ``Choice`` (the whole text)."""
        import torch

        stop = list(stop or [])
        inputs, kwargs = self._prepare(prompt_ids, max_tokens, temperature, top_p, stop)
        token_streamer, cancelled = _hf_helpers()
        streamer = token_streamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=600)
        result: dict[str, Any] = {}
        cancel = threading.Event()  # the caller went away (a client that disconnects mid-stream): stop generating
        kwargs["stopping_criteria"] = [cancelled(cancel)]

        def run() -> None:
            try:
                with torch.no_grad():
                    if seed is not None:
                        torch.manual_seed(seed)
                    out = self.model.generate(inputs, streamer=streamer, **kwargs)
                result["ids"] = out[0, len(prompt_ids):].tolist()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                result["error"] = exc
                streamer.end()

        with self._lock:
            thread = threading.Thread(target=run, name="policy-generate", daemon=True)
            thread.start()
            try:
                sent = yield from self._pieces(streamer, stop)
            finally:  # also when the consumer closes this generator early: the next request finds the model free
                cancel.set()
                thread.join(timeout=600)
            if "error" in result:
                raise result["error"]
        choice = self._finish(result["ids"], max_tokens, stop)
        rest = choice.text[len(sent):] if choice.text.startswith(sent) else ""
        if rest:
            yield rest
        yield choice

    @staticmethod
    def _pieces(streamer: Any, stop: list[str]) -> Iterator[str]:
        """Yield the streamer's text, holding back what may begin a stop string; returns the text yielded."""
        sent = ""  # text handed out so far; a piece that may begin a stop string waits for the next one
        pending = ""
        hold = max((len(s) - 1 for s in stop), default=0)
        for piece in streamer:
            pending += piece
            if any(s in pending for s in stop):
                break
            ready = pending[:len(pending) - hold] if hold else pending
            if ready:
                sent += ready
                pending = pending[len(ready):]
                yield ready
        return sent


@functools.cache
def _hf_helpers() -> tuple[type, type]:
    """``(TokenStreamer, Cancelled)``, built on first use (transformers is heavy to import)."""
    import torch
    from transformers import StoppingCriteria, TextIteratorStreamer

    class TokenStreamer(TextIteratorStreamer):
        """Hands out the text of every new token at once (transformers' streamers wait for a space), except a
        trailing incomplete character (a multi-byte one split across tokens), which waits for its next token."""

        def put(self, value) -> None:
            if len(value.shape) > 1:
                value = value[0]
            if self.skip_prompt and self.next_tokens_are_prompt:
                self.next_tokens_are_prompt = False
                return
            self.token_cache.extend(value.tolist())
            text = self.tokenizer.decode(self.token_cache, **self.decode_kwargs)
            if not text.endswith("\ufffd") and len(text) > self.print_len:
                self.on_finalized_text(text[self.print_len:])
                self.print_len = len(text)

    class Cancelled(StoppingCriteria):
        """Ends generation once its event is set."""

        def __init__(self, cancel: threading.Event) -> None:
            self.cancel = cancel

        def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
            return torch.full((input_ids.shape[0],), self.cancel.is_set(), dtype=torch.bool, device=input_ids.device)

    return TokenStreamer, Cancelled


# -------------------------------------------------------------------------------------------- requests
class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")  # fields of OpenAI's API that this server does not use

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise APIError(400, "stop strings must not be empty", param="stop")
        return stops


class CompletionRequest(_Request):
    prompt: str | list[str]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise APIError(400, f"content parts of type {part.get('type')!r} are not supported by a text model",
                               param="messages")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class ImagePolicy:
    """A text-to-image pipeline loaded for ``/v1/images/generations``: an export of this project (``SD3Bundle``:
    a diffusers pipeline folder; LoRA adapters kept apart are merged into the transformer on load) or any
    diffusers pipeline folder, loaded with ``diffusers.DiffusionPipeline.from_pretrained``. One request at a
    time (a lock); a request's ``seed`` fixes its images."""

    def __init__(self, folder: str, *, name: str | None = None, torch_dtype: str = "float32") -> None:
        from diffusers import DiffusionPipeline

        from unirl_ray.core.dtypes import TORCH_DTYPES

        folder, model_path, info, kind = model_folder(folder)
        if kind != "image":
            raise ValueError(f"{folder!r} is a causal LM: serve it with TextPolicy (load_policy picks it)")
        pipe = DiffusionPipeline.from_pretrained(model_path, dtype=TORCH_DTYPES[torch_dtype])
        if info is not None and info.adapter_path is not None:
            from peft import PeftModel

            pipe.transformer = PeftModel.from_pretrained(pipe.transformer, info.adapter_path).merge_and_unload()
        pipe.set_progress_bar_config(disable=True)
        self.pipe = pipe
        self.name = name or os.path.basename(folder.rstrip(os.sep))
        self.policy_version = info.policy_version if info is not None else None
        sample = getattr(getattr(pipe, "transformer", None), "config", None)
        factor = int(getattr(pipe, "vae_scale_factor", 8) or 8)
        side = int(getattr(sample, "sample_size", 0) or 0) * factor
        self.default_size = (side, side) if side else (512, 512)
        """(width, height) of a request that names no ``size``: the transformer's native resolution."""
        self.multiple = factor * int(getattr(sample, "patch_size", 1) or 1)
        """Width and height must be multiples of this (the VAE's factor times the transformer's patch)."""
        self.created = int(time.time())
        self._lock = threading.Lock()

    def check_size(self, width: int, height: int) -> None:
        for what, value in (("width", width), ("height", height)):
            if value <= 0 or value % self.multiple or value > 4096:
                raise APIError(400, f"size: {what} {value} must be a positive multiple of {self.multiple} "
                               f"(at most 4096) for model {self.name!r}", param="size")

    def generate(self, prompt: str, *, n: int, width: int, height: int, seed: int | None,
                 num_inference_steps: int | None, guidance_scale: float | None) -> list[bytes]:
        """``n`` PNG images of ``prompt``."""
        import io

        import torch

        self.check_size(width, height)
        kwargs: dict[str, Any] = {}
        if num_inference_steps is not None:
            kwargs["num_inference_steps"] = num_inference_steps
        if guidance_scale is not None:
            kwargs["guidance_scale"] = guidance_scale
        with self._lock:
            generator = torch.Generator().manual_seed(seed if seed is not None else int.from_bytes(os.urandom(4), "big"))
            images = self.pipe(prompt, num_images_per_prompt=n, width=width, height=height, generator=generator,
                               output_type="pil", **kwargs).images
        out = []
        for image in images:
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            out.append(buffer.getvalue())
        return out


class ImageRequest(BaseModel):
    """``POST /v1/images/generations`` (OpenAI's fields, plus ``seed``, ``num_inference_steps`` and
    ``guidance_scale`` as extras)."""

    model_config = ConfigDict(extra="ignore")
    model: str
    prompt: str = Field(min_length=1)
    n: int = Field(1, ge=1, le=MAX_N)
    size: str | None = None
    response_format: Literal["b64_json", "url"] = "b64_json"
    seed: int | None = None
    num_inference_steps: int | None = Field(None, ge=1, le=1000)
    guidance_scale: float | None = Field(None, ge=0)


# ------------------------------------------------------------------------------------------------ app
_PROCESS: dict[str, Any] = {}
"""The policy (``"policy"``) and API key (``"api_key"``) of this process, for an app without its own: a Serve
replica (``unirl_ray.serve.deployment``) sets them. Serve runs a copy of the ingress app, so the handlers below
are module-level functions (pickled by reference) that look the policy up here or in ``request.app.state``."""


def _get(request: Request, key: str) -> Any:
    return getattr(request.app.state, key, _PROCESS.get(key))


def _policy(request: Request) -> TextPolicy | ImagePolicy:
    policy = _get(request, "policy")
    if policy is None:
        raise APIError(503, "the model is not loaded yet", kind="server_error")
    return policy


def _event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    message = f"{where}: {first.get('msg', 'invalid request')}" if where else str(first.get("msg", exc))
    return APIError(400, message, param=where or None).response()


def api_key_rejection(request: Request, api_key: str | None) -> JSONResponse | None:
    """The 401 answer to ``request`` when ``api_key`` is set and the request does not carry it as
    ``Authorization: Bearer <key>`` (compared in constant time), else ``None``."""
    if api_key is None:
        return None
    given = request.headers.get("authorization", "")
    token = given[7:] if given.lower().startswith("bearer ") else ""
    if hmac.compare_digest(token.encode(), str(api_key).encode()):
        return None
    return APIError(401, "missing or wrong API key (send Authorization: Bearer <key>)",
                    kind="authentication_error", code="invalid_api_key").response()


async def _auth(request: Request, call_next):
    return api_key_rejection(request, _get(request, "api_key")) or await call_next(request)


def _check_model(policy: TextPolicy | ImagePolicy, name: str) -> None:
    if name != policy.name:
        raise APIError(404, f"the model {name!r} does not exist here; this server has {policy.name!r}",
                       param="model", code="model_not_found")


def _usage(prompt_tokens: int, choices: list[Choice]) -> dict[str, int]:
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


async def _answer(request: Request, req: _Request, prompt_ids: list[int], chat: bool):
    policy = _policy(request)
    stops = req.stops()
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens or _get(request, "default_max_tokens") \
        or DEFAULT_MAX_TOKENS
    policy.check_length(prompt_ids, max_tokens)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    if req.stream:
        if req.n != 1:
            raise APIError(400, "streaming supports n=1 only", param="n")
        return StreamingResponse(_stream(policy, req, prompt_ids, max_tokens, stops, rid, created, chat),
                                 media_type="text/event-stream")
    choices = await asyncio.to_thread(policy.generate, prompt_ids, max_tokens=max_tokens, temperature=req.temperature,
                                      top_p=req.top_p, n=req.n, stop=stops, seed=req.seed)
    body = [({"index": i, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason}
             if chat else {"index": i, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason})
            for i, c in enumerate(choices)]
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": policy.name, "choices": body, "usage": _usage(len(prompt_ids), choices)}


async def _stream(policy: TextPolicy, req: _Request, prompt_ids: list[int], max_tokens: int, stops: list[str],
                  rid: str, created: int, chat: bool):
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
        if chat:
            d: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if delta:
                d["content"] = delta
            choice = {"index": 0, "delta": d, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
        return {"id": rid, "object": kind, "created": created, "model": policy.name, "choices": [choice]}

    if chat:
        yield _event(chunk(None, None, first=True))
    pieces = policy.stream(prompt_ids, max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                           stop=stops, seed=req.seed)
    done = object()
    while True:
        item = await asyncio.to_thread(next, pieces, done)
        if item is done:
            break
        if isinstance(item, Choice):
            final = chunk(None, item.finish_reason)
            final["usage"] = _usage(len(prompt_ids), [item])
            yield _event(final)
        else:
            yield _event(chunk(item, None))
    yield "data: [DONE]\n\n"


async def list_models(request: Request) -> dict[str, Any]:
    policy = _policy(request)
    return {"object": "list", "data": [{"id": policy.name, "object": "model", "created": policy.created,
                                        "owned_by": "unirl_ray"}]}


def _text_policy(request: Request, name: str) -> TextPolicy:
    policy = _policy(request)
    _check_model(policy, name)
    if not isinstance(policy, TextPolicy):
        raise APIError(400, f"model {policy.name!r} generates images: use /v1/images/generations", param="model")
    return policy


async def completions(request: Request, req: CompletionRequest):
    policy = _text_policy(request, req.model)
    prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    if len(prompts) != 1:
        raise APIError(400, f"send one prompt per request (got {len(prompts)})", param="prompt")
    return await _answer(request, req, policy.text_prompt_ids(prompts[0]), chat=False)


async def chat_completions(request: Request, req: ChatRequest):
    policy = _text_policy(request, req.model)
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    return await _answer(request, req, policy.chat_prompt_ids(messages), chat=True)


async def images_generations(request: Request, req: ImageRequest):
    policy = _policy(request)
    _check_model(policy, req.model)
    if not isinstance(policy, ImagePolicy):
        raise APIError(400, f"model {policy.name!r} generates text: use /v1/chat/completions or /v1/completions",
                       param="model")
    if req.response_format != "b64_json":
        raise APIError(400, "response_format 'url' is not supported: this server returns images inline (b64_json)",
                       param="response_format")
    width, height = policy.default_size
    if req.size is not None:
        try:
            width, height = (int(v) for v in req.size.lower().split("x"))
        except ValueError:
            raise APIError(400, f"size must look like 512x512 (width x height), got {req.size!r}", param="size") from None
    policy.check_size(width, height)
    images = await asyncio.to_thread(policy.generate, req.prompt, n=req.n, width=width, height=height, seed=req.seed,
                                     num_inference_steps=req.num_inference_steps, guidance_scale=req.guidance_scale)
    return {"created": int(time.time()), "data": [{"b64_json": base64.b64encode(png).decode("ascii")} for png in images]}


DEFAULT_MAX_TOKENS = 256
"""``max_tokens`` of a request that names none."""


def make_app(title: str = "unirl_ray policy") -> FastAPI:
    """The app's routes, error handlers and API-key check, without a policy (``create_app`` or a Serve replica
    supplies it)."""
    app = FastAPI(title=title)
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_invalid)
    app.middleware("http")(_auth)
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/images/generations", images_generations, methods=["POST"])
    return app


def create_app(policy: TextPolicy | ImagePolicy, *, api_key: str | None = None,
               default_max_tokens: int = DEFAULT_MAX_TOKENS) -> FastAPI:
    """The OpenAI-compatible FastAPI app over ``policy``; requests must carry ``Authorization: Bearer <api_key>``
    when ``api_key`` is set."""
    app = make_app(f"unirl_ray policy {policy.name}")
    app.state.policy = policy
    app.state.api_key = api_key
    app.state.default_max_tokens = default_max_tokens
    return app

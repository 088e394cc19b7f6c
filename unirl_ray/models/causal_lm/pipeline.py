"""``CausalLMPipeline``: batched sampling with recorded log-probs, and their exact recomputation.

Sampling (``sample``) is a hand-written KV-cache loop rather than ``generate`` because the train
ranks are FSDP2-sharded and every rank must run the same number of forward calls: the loop always
runs exactly ``max_new_tokens`` forward calls (one over the prompts, then one per new token), with
no early stop. Rows that emitted a stop token keep feeding ``<pad>`` under attention mask 0 and
are cut at their stop token afterwards.

Log-probs are those of the temperature-scaled distribution ``softmax(logits / temperature)``, in
float32, both while sampling and in ``token_log_probs``, so that before any update the recomputed
values equal the recorded ones up to float rounding. With ``top_p < 1`` tokens are drawn from the
nucleus (renormalised) but the recorded log-prob is still that of the full temperature-scaled
distribution (what vLLM reports and what ``token_log_probs`` can differentiate): it differs from
the true behaviour log-prob by the log of the nucleus mass, so importance ratios are slightly off.

Every sample draws from its own ``torch.Generator`` seeded with its seed (inverse-CDF sampling
from one uniform per row and step): a sample depends only on its prompt, its seed and the weights,
not on which other prompts share the batch or how much left padding it got.

Shapes: ``B`` batch, ``P`` longest prompt, ``N = max_new_tokens``, ``L`` longest prompt + completion,
``V`` vocabulary.
"""

from __future__ import annotations

import functools
import logging
from typing import Annotated, Any

import torch

from unirl_ray.config.checks import Bound, PositiveInt, check_choice
from unirl_ray.core.sample import TextPart
from unirl_ray.models.causal_lm.bundle import CausalLMBundle

Temperature = Annotated[float, Bound(gt=0, why="log-probs are those of softmax(logits / T)")]
TopP = Annotated[float, Bound(gt=0, le=1, why="1 disables nucleus sampling")]

logger = logging.getLogger(__name__)


@functools.cache
def _cache_key() -> str:
    """The name of the KV cache in a causal LM's call and output: transformers >= 5.2x renamed the model's
    ``past_key_values`` argument / output field to ``cache`` (the old name still works but warns); whichever this
    version defines (read on first use: importing this module does not import transformers)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def _module_device(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


def nucleus_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the smallest set whose probability reaches ``top_p`` (probs: [B, V]).

    The most likely token is always kept; the result is not renormalised (the sampler does not need it).
    """
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


def draw_tokens(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: [B] token ids from unnormalised ``weights`` [B, V] and ``uniforms`` [B] in [0, 1).

    Token ``i`` is chosen with probability ``weights[i] / sum(weights)``; zero-weight tokens are never chosen.
    """
    cdf = weights.cumsum(dim=-1)
    target = (uniforms.to(cdf) * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return idx.clamp_max(weights.shape[-1] - 1)


def next_token_log_probs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``targets`` [B, L] under ``softmax(logits / temperature)`` ([B, L, V]) and that distribution's
    entropy, both [B, L] float32 with grad."""
    logits = logits.float() / temperature
    log_norm = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[..., None]).squeeze(-1) - log_norm
    entropy = log_norm - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, entropy


class CausalLMPipeline:
    """Sampling / log-prob recomputation around a ``CausalLMBundle`` (see the module docstring)."""

    def __init__(
        self,
        bundle: CausalLMBundle,
        *,
        max_prompt_tokens: PositiveInt = 64,
        max_new_tokens: PositiveInt = 32,
        temperature: Temperature = 1.0,
        top_p: TopP = 1.0,
        use_chat_template: bool = True,
        system_prompt: str | None = None,
    ) -> None:
        self.bundle = bundle
        self.tokenizer = bundle.tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.use_chat_template = use_chat_template
        self.system_prompt = system_prompt
        self.validate()
        self.pad_token_id = int(self.tokenizer.pad_token_id)
        self.stop_token_ids = self._stop_token_ids()
        self._warned_truncation = False

    # ------------------------------------------------------------------ setup
    def validate(self) -> None:
        """Raise ``ValueError`` with a fix for bad lengths / temperature / top_p / template settings
        (the ranges are in the annotations: a recipe's values are checked on the driver)."""
        for name, annotation in (("max_prompt_tokens", PositiveInt), ("max_new_tokens", PositiveInt),
                                 ("temperature", Temperature), ("top_p", TopP)):
            check_choice(f"pipeline.{name}", getattr(self, name), annotation)
        if self.use_chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("use_chat_template=True but the tokenizer has no chat_template; set use_chat_template=False")
        if self.tokenizer.pad_token_id is None or self.tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer needs a pad_token and an eos_token")
        limit = getattr(getattr(self.bundle.model, "config", None), "max_position_embeddings", None)
        if isinstance(limit, int) and self.max_prompt_tokens + self.max_new_tokens > limit:
            raise ValueError(
                f"max_prompt_tokens + max_new_tokens = {self.max_prompt_tokens + self.max_new_tokens} exceeds the "
                f"model's max_position_embeddings ({limit}); lower one of them"
            )

    def _stop_token_ids(self) -> torch.Tensor:
        """[S] ids that end a completion: the tokenizer's EOS plus the model's generation-config EOS ids."""
        ids = {int(self.tokenizer.eos_token_id)}
        gen_cfg = getattr(self.bundle.model, "generation_config", None)
        extra = getattr(gen_cfg, "eos_token_id", None)
        if isinstance(extra, int):
            ids.add(extra)
        elif extra is not None:
            ids.update(int(i) for i in extra)
        return torch.tensor(sorted(ids), dtype=torch.long)

    # ------------------------------------------------------------------ prompts
    def encode_prompts(self, prompts: list[str]) -> list[list[int]]:
        """Token ids per prompt (chat template when enabled), keeping the last ``max_prompt_tokens``."""
        out = []
        for prompt in prompts:
            if self.use_chat_template:
                messages = [{"role": "user", "content": prompt}]
                if self.system_prompt is not None:
                    messages.insert(0, {"role": "system", "content": self.system_prompt})
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            else:
                ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
            if not ids:
                if self.tokenizer.bos_token_id is None:
                    raise ValueError(f"prompt {prompt!r} encodes to no tokens and the tokenizer has no bos_token")
                ids = [int(self.tokenizer.bos_token_id)]
            if len(ids) > self.max_prompt_tokens:
                if not self._warned_truncation:
                    logger.warning(
                        "CausalLMPipeline: a prompt has %d tokens > max_prompt_tokens=%d; keeping its last tokens "
                        "(raise max_prompt_tokens to keep whole prompts)",
                        len(ids),
                        self.max_prompt_tokens,
                    )
                    self._warned_truncation = True
                ids = ids[-self.max_prompt_tokens :]
            out.append([int(i) for i in ids])
        return out

    # ------------------------------------------------------------------ sampling
    @torch.no_grad()
    def sample(
        self, prompts: list[str], seeds: list[int], *, module: torch.nn.Module | None = None
    ) -> list[tuple[TextPart, str]]:
        """One completion per (prompt, seed): ``(TextPart, decoded text)`` pairs, in order.

        Runs exactly ``max_new_tokens`` forward calls of ``module`` (default: the bundle's model).
        """
        if len(prompts) != len(seeds):
            raise ValueError(f"got {len(prompts)} prompts but {len(seeds)} seeds; pass one seed per prompt")
        if not prompts:
            return []
        return self.sample_ids(self.encode_prompts(prompts), seeds, module=module)

    @torch.no_grad()
    def sample_ids(
        self, prompt_ids: list[list[int]], seeds: list[int], *, module: torch.nn.Module | None = None,
        prefill_context: Any = None,
    ) -> list[tuple[TextPart, str]]:
        """``sample`` from contexts given as token ids (token in, token out: an agent's next turn continues
        from the exact ids of everything before it). Each context must be 1..``max_prompt_tokens`` ids: it is
        never truncated here (a caller whose context outgrew the limit ends its trajectory instead).
        ``prefill_context`` goes to ``_prefill`` (a vision-language subclass passes the contexts' images)."""
        if len(prompt_ids) != len(seeds):
            raise ValueError(f"got {len(prompt_ids)} contexts but {len(seeds)} seeds; pass one seed per context")
        if not prompt_ids:
            return []
        for ids in prompt_ids:
            if not 0 < len(ids) <= self.max_prompt_tokens:
                raise ValueError(f"a context of {len(ids)} token ids does not fit pipeline.max_prompt_tokens="
                                 f"{self.max_prompt_tokens} (it needs 1..max_prompt_tokens ids; contexts are never "
                                 "truncated: end the trajectory or raise max_prompt_tokens)")
        prompt_ids = [[int(i) for i in ids] for ids in prompt_ids]
        module = self.bundle.model if module is None else module
        tokens, log_probs, lengths = self._decode(module, prompt_ids, seeds, prefill_context)
        outputs = []
        for b, ids in enumerate(prompt_ids):
            n = int(lengths[b])
            completion = tokens[b, :n].clone()
            visible = completion[~torch.isin(completion, self.stop_token_ids)]
            text = self.tokenizer.decode(visible.tolist(), skip_special_tokens=True)
            part = TextPart(
                prompt_ids=torch.tensor(ids, dtype=torch.long),
                completion_ids=completion,
                log_probs=log_probs[b, :n].clone(),
                loss_mask=torch.ones(n, dtype=torch.float32),
                text=text,
                num_tokens=n,
            )
            outputs.append((part, text))
        return outputs

    def _decode(
        self, module: torch.nn.Module, prompt_ids: list[list[int]], seeds: list[int], prefill_context: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """KV-cache loop: tokens [B, N], log-probs [B, N] (float32, CPU), lengths [B] (up to and incl. the stop token)."""
        device = _module_device(module)
        batch, n_new = len(prompt_ids), self.max_new_tokens
        width = max(len(ids) for ids in prompt_ids)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((batch, width), dtype=torch.long)
        for b, ids in enumerate(prompt_ids):  # left padding: every row's next token sits in the last column
            input_ids[b, width - len(ids) :] = torch.tensor(ids)
            attention[b, width - len(ids) :] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        positions, next_position, prefill_inputs = self._prefill(module, input_ids, attention, prefill_context)
        generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
        stop_ids = self.stop_token_ids.to(device)

        tokens = torch.full((batch, n_new), self.pad_token_id, dtype=torch.long, device=device)
        log_probs = torch.zeros((batch, n_new), dtype=torch.float32, device=device)
        lengths = torch.full((batch,), n_new, dtype=torch.long, device=device)
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        cache = None
        step_ids, step_positions = input_ids, positions
        for t in range(n_new):
            out = module(
                input_ids=step_ids,
                attention_mask=attention,
                position_ids=step_positions,
                use_cache=True,
                **{_cache_key(): cache},
                **(prefill_inputs if t == 0 else {}),
            )
            cache = getattr(out, _cache_key())
            logp_all = torch.log_softmax(self._mask_logits(out.logits[:, -1]).float() / self.temperature, dim=-1)
            uniforms = torch.stack([torch.rand((), generator=g) for g in generators])
            token = draw_tokens(nucleus_filter(logp_all.exp(), self.top_p), uniforms)
            token = token.masked_fill(finished, self.pad_token_id)
            tokens[:, t] = token
            log_probs[:, t] = logp_all.gather(-1, token[:, None]).squeeze(-1).masked_fill(finished, 0.0)
            just_stopped = ~finished & torch.isin(token, stop_ids)
            lengths = torch.where(just_stopped, t + 1, lengths)
            # the token fed next is real for rows that were still generating when it was drawn
            attention = torch.cat([attention, (~finished).long()[:, None]], dim=1)
            finished = finished | just_stopped
            step_ids, step_positions = token[:, None], self._step_positions(next_position)
            next_position = next_position + 1
        return tokens.cpu(), log_probs.cpu(), lengths.cpu()

    def _prefill(self, module: torch.nn.Module, input_ids: torch.Tensor, attention: torch.Tensor, context: Any = None
                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """Position ids of the left-padded prompts [B, W], each row's next position [B], and extra inputs of the
        first forward call (a vision-language subclass adds its images, ``context``, and 3D positions)."""
        return (attention.cumsum(-1) - 1).clamp_min(0), attention.sum(-1), {}

    def _step_positions(self, next_position: torch.Tensor) -> torch.Tensor:
        """Position ids of the tokens fed after the prompt, from each row's next position [B]."""
        return next_position[:, None]

    # ------------------------------------------------------------------ training
    def collate(self, parts: list[TextPart]) -> dict[str, torch.Tensor]:
        """Right-padded prompt + completion sequences of ``parts`` (CPU tensors).

        Returns ``input_ids`` [B, L], ``attention_mask`` [B, L], ``position_ids`` [B, L], and, aligned
        with the shifted targets ``input_ids[:, 1:]``: ``completion_mask`` [B, L-1] (float, the parts'
        ``loss_mask`` on their completion tokens) and ``old_log_probs`` [B, L-1] (the parts' recorded
        ``log_probs``, 0 elsewhere); ``segment_ids`` [B, L-1] long (the turn of each completion token from
        the parts' ``segments``, 0 for a one-turn part, -1 outside completions and on untrained tokens between
        turns) only when some part has several turns.
        """
        if not parts:
            raise ValueError("collate needs at least one TextPart")
        for p in parts:
            if p.is_light:
                raise ValueError("collate needs full TextParts (with prompt_ids / completion_ids), not light copies")
        seq_lens = [len(p.prompt_ids) + len(p.completion_ids) for p in parts]
        batch, length = len(parts), max(seq_lens)
        input_ids = torch.full((batch, length), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((batch, length), dtype=torch.long)
        completion_mask = torch.zeros((batch, length - 1), dtype=torch.float32)
        old = torch.zeros((batch, length - 1), dtype=torch.float32)
        multi_turn = any(p.segments is not None for p in parts)
        segments = torch.full((batch, length - 1), -1, dtype=torch.long)
        for b, (p, n) in enumerate(zip(parts, seq_lens)):
            n_prompt, n_completion = len(p.prompt_ids), len(p.completion_ids)
            input_ids[b, :n] = torch.cat([p.prompt_ids.long(), p.completion_ids.long()])
            attention[b, :n] = 1
            targets = slice(n_prompt - 1, n_prompt - 1 + n_completion)
            mask = p.loss_mask if p.loss_mask is not None else torch.ones(n_completion)
            completion_mask[b, targets] = mask.float()
            if p.log_probs is not None:
                old[b, targets] = p.log_probs.float()
            segments[b, targets] = p.segments.long() if p.segments is not None else 0
        positions = torch.arange(length).expand(batch, length).clone()
        out = {
            "input_ids": input_ids,
            "attention_mask": attention,
            "position_ids": positions,
            "completion_mask": completion_mask,
            "old_log_probs": old,
        }
        if multi_turn:
            out["segment_ids"] = segments
        return out

    def token_log_probs(
        self, module: torch.nn.Module, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-prob of every next token and the entropy of its distribution, both [B, L-1] float32, with grad.

        Position ``j`` scores ``input_ids[:, j + 1]`` under ``softmax(logits_j / temperature)`` (the
        nucleus is not applied; see the module docstring). Only positions under ``completion_mask`` matter.
        """
        device = _module_device(module)
        input_ids = batch["input_ids"].to(device)
        out = module(
            input_ids=input_ids,
            attention_mask=batch["attention_mask"].to(device),
            position_ids=batch["position_ids"].to(device),
            use_cache=False,
            **self._extra_inputs(batch, device),
        )
        return next_token_log_probs(self._mask_logits(out.logits[:, :-1]), input_ids[:, 1:], self.temperature)

    def _extra_inputs(self, batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
        """Model inputs of a ``collate`` batch beyond ids, mask and positions (a vision-language subclass: its images)."""
        return {}

    def _mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] of the sampled distribution: as they are here; a subclass gives tokens the policy may
        never emit probability 0 (a vision-language model's image placeholders), the same way when sampling and
        when recomputing, so that the recorded and recomputed log-probs stay those of one distribution."""
        return logits

    def teacher_forced_log_probs(
        self, module: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        """[B, L-1] float32 log-prob (temperature 1, with grad) of ``input_ids[:, j + 1]`` given the tokens before it.

        For supervised losses over rows that may pack several sequences: no attention mask is passed, so
        ``position_ids`` [B, L] restarting at 0 mark where each sequence starts and the model's
        packed-sequence attention (transformers ``masking_utils``) keeps sequences from attending to each
        other; a right-padded tail must start its own run of positions at 0. Positions across a
        sequence boundary hold a meaningless value: the caller masks them out.
        """
        device = _module_device(module)
        input_ids = input_ids.to(device)
        out = module(input_ids=input_ids, position_ids=position_ids.to(device), use_cache=False)
        logits = out.logits[:, :-1].float()
        return -torch.nn.functional.cross_entropy(logits.transpose(1, 2), input_ids[:, 1:], reduction="none")

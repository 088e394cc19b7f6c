"""Causal-LM family: char tokenizer, tiny model, KV-cache sampling loop, log-prob recomputation."""

import subprocess
import sys

import pytest
import torch

from unirl_ray.models.causal_lm import CausalLMBundle, CausalLMConfig, CausalLMPipeline, TinyLMConfig
from unirl_ray.models.causal_lm.pipeline import draw_tokens, nucleus_filter
from unirl_ray.models.causal_lm.tokenizer import CHAR_VOCAB, SPECIAL_TOKENS, build_char_tokenizer

PROMPTS = ["hi", "a much longer prompt than the others", "xyz"]


@pytest.fixture(scope="module")
def bundle():
    return CausalLMBundle.from_config(CausalLMConfig())


@pytest.fixture(scope="module")
def tied_bundle():
    return CausalLMBundle.from_config(CausalLMConfig(tiny=TinyLMConfig(seed=3, tie_word_embeddings=True)))


def masked_max_diff(a, b, mask):
    return (a - b)[mask.bool()].abs().max().item()


# ----------------------------------------------------------------------------------------------- tokenizer / config


def test_tokenizer_round_trip_and_chat_template(tmp_path):
    from transformers import AutoTokenizer

    tok = build_char_tokenizer()
    text = "".join(CHAR_VOCAB)  # every printable ASCII character plus newline, spaces included
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(range(len(SPECIAL_TOKENS), len(SPECIAL_TOKENS) + len(CHAR_VOCAB)))
    assert tok.decode(ids) == text
    assert tok.encode("é", add_special_tokens=False) == [tok.unk_token_id]
    assert (tok.pad_token_id, tok.eos_token_id) == (0, SPECIAL_TOKENS.index("<|end|>"))

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == "<|bos|><|system|>be brief<|end|><|user|>2+2?<|end|><|assistant|>"

    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert loaded.encode(text, add_special_tokens=False) == ids
    assert loaded.decode(ids) == text
    assert loaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == rendered
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.bos_token_id) == (
        tok.pad_token_id,
        tok.eos_token_id,
        tok.bos_token_id,
    )


def test_config_is_import_light_and_validates_paths(tmp_path):
    code = (
        "import sys; from unirl_ray.models.causal_lm import CausalLMConfig; CausalLMConfig(); "
        "print('transformers' in sys.modules, 'tokenizers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]

    with pytest.raises(ValueError, match="does not exist"):
        CausalLMConfig(pretrained_model_path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no config.json"):
        CausalLMConfig(pretrained_model_path=str(tmp_path))
    with pytest.raises(ValueError, match="torch_dtype"):
        CausalLMConfig(torch_dtype="float64")
    with pytest.raises(ValueError, match="multiple of num_attention_heads"):
        TinyLMConfig(hidden_size=60, num_attention_heads=8)
    assert CausalLMConfig(seed=5).tiny.seed == 5 and CausalLMConfig().is_demo


# ----------------------------------------------------------------------------------------------- model / bundle


def test_tiny_model_builds_seeded_and_tied(bundle, tied_bundle):
    model = bundle.model
    assert bundle.is_demo and type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.vocab_size == len(bundle.tokenizer) == TinyLMConfig().vocab_size
    assert model.config.hidden_size // model.config.num_attention_heads == 32
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert tied_bundle.model.lm_head.weight is tied_bundle.model.model.embed_tokens.weight

    state = torch.get_rng_state()
    again = CausalLMBundle.from_config(CausalLMConfig())
    other = CausalLMBundle.from_config(CausalLMConfig(seed=1))
    assert torch.equal(torch.get_rng_state(), state)  # building does not consume the global RNG
    w = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(again.model.state_dict()[w], model.state_dict()[w])
    assert not torch.equal(other.model.state_dict()[w], model.state_dict()[w])


def test_bundle_save_and_load_from_folder(bundle, tmp_path):
    bundle.save_pretrained(str(tmp_path))
    loaded = CausalLMBundle.from_config(CausalLMConfig(pretrained_model_path=str(tmp_path)))
    assert not loaded.is_demo
    ids = torch.tensor([[2, 5, 72, 73, 3, 6]])
    with torch.no_grad():
        assert torch.allclose(loaded.model(input_ids=ids).logits, bundle.model(input_ids=ids).logits, atol=1e-6)
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == (
        "<|bos|><|user|>x<|end|>"
    )
    text = "two words\nand a line"  # whitespace survives (AutoTokenizer alone would pick a byte-level BPE)
    assert loaded.tokenizer(text)["input_ids"] == bundle.tokenizer(text)["input_ids"]
    assert loaded.tokenizer.decode(loaded.tokenizer(text)["input_ids"]) == text


# ----------------------------------------------------------------------------------------------- sampling


def count_forward_calls(model):
    calls = []
    handle = model.register_forward_hook(lambda *_: calls.append(1))
    return calls, handle


def test_sample_shapes_masks_and_exact_forward_count(bundle):
    pipe = CausalLMPipeline(bundle, max_new_tokens=12, system_prompt="sys")
    calls, handle = count_forward_calls(bundle.model)
    try:
        outputs = pipe.sample(PROMPTS, [0, 1, 2])
    finally:
        handle.remove()
    assert len(calls) == 12
    encoded = pipe.encode_prompts(PROMPTS)
    assert encoded[0] == bundle.tokenizer.encode("<|bos|><|system|>sys<|end|><|user|>hi<|end|><|assistant|>")
    for (part, text), ids in zip(outputs, encoded):
        n = len(part.completion_ids)
        assert 1 <= n <= 12 and part.prompt_ids.tolist() == ids
        assert part.log_probs.shape == part.loss_mask.shape == (n,)
        assert torch.equal(part.loss_mask, torch.ones(n)) and (part.log_probs < 0).all()
        assert (part.completion_ids[:-1] != bundle.tokenizer.eos_token_id).all()  # only the last may be EOS
        body = part.completion_ids[:-1] if part.completion_ids[-1] == bundle.tokenizer.eos_token_id else part.completion_ids
        assert text == part.text == bundle.tokenizer.decode(body.tolist(), skip_special_tokens=True)


def test_eos_stops_a_row_but_not_the_loop(bundle):
    """Row 0 is forced to EOS at its 3rd token; the loop still runs max_new_tokens calls and row 1 is unaffected."""
    pipe = CausalLMPipeline(bundle, max_new_tokens=8, use_chat_template=False)
    eos, n_special = bundle.tokenizer.eos_token_id, len(SPECIAL_TOKENS)
    step = []

    def steer(_module, _inputs, logits):
        logits = logits.clone()
        logits[:, -1, :n_special] = -1e4  # plain characters only, so the text is predictable
        if len(step) == 2 and logits.shape[0] == 2:
            logits[0, -1, eos] = 1e4
        step.append(1)
        return logits

    handle = bundle.model.lm_head.register_forward_hook(steer)
    try:
        (p0, t0), (p1, _) = pipe.sample(["ab", "a longer one"], [4, 5])
        step.clear()
        (alone, _) = pipe.sample(["a longer one"], [5])[0]
    finally:
        handle.remove()
    assert len(step) == 8
    assert len(p0.completion_ids) == 3 and p0.completion_ids[-1] == eos
    assert len(t0) == 2 and t0 == bundle.tokenizer.decode(p0.completion_ids[:2].tolist())
    assert torch.equal(p0.loss_mask, torch.ones(3))
    assert len(p1.completion_ids) == 8 and torch.equal(p1.completion_ids, alone.completion_ids)
    assert torch.allclose(p1.log_probs, alone.log_probs, atol=1e-5)


def test_all_rows_finished_still_runs_every_forward_call(bundle):
    pipe = CausalLMPipeline(bundle, max_new_tokens=6)
    eos = bundle.tokenizer.eos_token_id

    def force_eos(_module, _inputs, logits):
        logits = logits.clone()
        logits[..., eos] = 1e4
        return logits

    handle = bundle.model.lm_head.register_forward_hook(force_eos)
    calls, count_handle = count_forward_calls(bundle.model)
    try:
        outputs = pipe.sample(["p", "q"], [0, 1])
    finally:
        handle.remove()
        count_handle.remove()
    assert len(calls) == 6
    for part, text in outputs:
        assert part.completion_ids.tolist() == [eos] and text == "" and part.loss_mask.tolist() == [1.0]
        assert abs(part.log_probs.item()) < 1e-4


@pytest.mark.parametrize("tied", [False, True])
def test_recomputed_log_probs_equal_sampled(bundle, tied_bundle, tied):
    b = tied_bundle if tied else bundle
    pipe = CausalLMPipeline(b, max_new_tokens=10, temperature=0.7)
    parts = [part for part, _ in pipe.sample(PROMPTS + ["q"], [3, 4, 5, 6])]
    batch = pipe.collate(parts)
    L = batch["input_ids"].shape[1]
    assert batch["completion_mask"].shape == batch["old_log_probs"].shape == (4, L - 1)
    assert batch["completion_mask"].sum().item() == sum(len(p.completion_ids) for p in parts)
    logp, entropy = pipe.token_log_probs(b.model, batch)
    assert logp.requires_grad and logp.shape == entropy.shape == (4, L - 1)
    assert masked_max_diff(logp, batch["old_log_probs"], batch["completion_mask"]) < 1e-5
    assert (entropy[batch["completion_mask"].bool()] > 0).all()
    # a target sits right after its context: row 0's first completion token is scored at prompt_len - 1
    p0 = parts[0]
    assert batch["input_ids"][0, len(p0.prompt_ids)] == p0.completion_ids[0]
    assert batch["completion_mask"][0, len(p0.prompt_ids) - 1] == 1 and batch["completion_mask"][0, len(p0.prompt_ids) - 2] == 0


def test_sample_independent_of_batch_composition_and_padding(bundle):
    pipe = CausalLMPipeline(bundle, max_new_tokens=10)
    alone = pipe.sample(["xyz"], [7])[0][0]
    mixed = pipe.sample(["a much longer prompt than the others", "xyz", "hi"], [1, 7, 2])
    same = mixed[1][0]
    assert torch.equal(alone.completion_ids, same.completion_ids)
    assert torch.allclose(alone.log_probs, same.log_probs, atol=1e-5)
    other_seed = pipe.sample(["xyz"], [8])[0][0]
    assert not torch.equal(other_seed.completion_ids, alone.completion_ids)

    # recomputation: a row's log-probs do not depend on the right padding added by longer rows
    solo_batch = pipe.collate([alone])
    solo, _ = pipe.token_log_probs(bundle.model, solo_batch)
    big_batch = pipe.collate([mixed[0][0], same])
    big, _ = pipe.token_log_probs(bundle.model, big_batch)
    n = solo.shape[1]
    assert big.shape[1] > n
    mask = solo_batch["completion_mask"][0]
    assert masked_max_diff(solo[0], big[1, :n], mask) < 1e-5


def test_top_p_draws_from_nucleus_but_records_full_log_prob(bundle):
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert torch.equal(nucleus_filter(probs, 0.7), torch.tensor([[0.5, 0.3, 0.0, 0.0]]))
    assert draw_tokens(torch.tensor([[0.0, 1.0, 0.0, 3.0]]), torch.tensor([0.2])).item() == 1
    assert draw_tokens(torch.tensor([[0.0, 1.0, 0.0, 3.0]]), torch.tensor([0.3])).item() == 3

    pipe = CausalLMPipeline(bundle, max_new_tokens=6, top_p=1e-6)  # nucleus of one token: greedy
    part = pipe.sample(["hi"], [0])[0][0]
    batch = pipe.collate([part])
    with torch.no_grad():
        logits = bundle.model(input_ids=batch["input_ids"]).logits[0, :-1]
    mask = batch["completion_mask"][0].bool()
    assert torch.equal(logits.argmax(-1)[mask], part.completion_ids)
    logp, _ = pipe.token_log_probs(bundle.model, batch)
    assert masked_max_diff(logp[0], batch["old_log_probs"][0], mask) < 1e-5
    assert (part.log_probs < 0).all()  # full-distribution log-prob, not log(1) under the nucleus


def test_pipeline_validation(bundle):
    with pytest.raises(ValueError, match="temperature"):
        CausalLMPipeline(bundle, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        CausalLMPipeline(bundle, top_p=0.0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        CausalLMPipeline(bundle, max_prompt_tokens=200, max_new_tokens=100)
    with pytest.raises(ValueError, match="one seed per prompt"):
        CausalLMPipeline(bundle).sample(["a", "b"], [0])
    pipe = CausalLMPipeline(bundle, max_prompt_tokens=5, use_chat_template=False)
    assert pipe.encode_prompts(["abcdefgh"]) == [bundle.tokenizer.encode("defgh", add_special_tokens=False)]

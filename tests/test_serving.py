"""Continuous batching (`generate_batch`, the continuous-batching manager): each request gets exactly what it gets
alone, and the transformers internals the integration depends on (modeling_dint/integrations/serving.py) are what it
was written against."""

import inspect

import pytest
import torch
import transformers
from packaging.version import Version


# Serving is integrated for transformers 5.24 (modeling_dint/integrations/serving.py): older releases skip these tests;
# a newer one runs them, and test_transformers_internals_are_those_serving_was_written_for fails until the module is
# ported.
if Version(transformers.__version__) < Version("5.24"):
    pytest.skip(
        f"continuous batching is integrated for transformers >= 5.24 (installed: {transformers.__version__})",
        allow_module_level=True,
    )

from dint_testing import V2, V2_GATED, tiny_model  # noqa: E402
from transformers import ContinuousBatchingConfig, GenerationConfig  # noqa: E402
from transformers.generation.continuous_batching import cache as continuous_batching_cache  # noqa: E402
from transformers.generation.continuous_batching import continuous_api  # noqa: E402
from transformers.generation.continuous_batching.cache_allocators import (  # noqa: E402
    FULL_ATTENTION,
    FullAttentionCacheAllocator,
)

from modeling_dint.integrations import serving  # noqa: E402
from modeling_dint.transformers_compat import installed_release  # noqa: E402


NEW_TOKENS = 10
PROMPT_LENGTHS = (5, 17, 3, 40, 9, 70, 1, 33)


def random_prompts(lengths=PROMPT_LENGTHS, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 128, (length,), generator=generator).tolist() for length in lengths]


def small_cache(**overrides) -> ContinuousBatchingConfig:
    """Pages of 8 tokens (requests span many blocks), at most 24 tokens and 3 requests per step: prompts longer than
    24 tokens are prefilled in chunks, and requests wait, then join while others decode."""
    fields = dict(page_size=8, num_blocks=96, max_batch_tokens=24, max_requests_per_batch=3, return_logprobs=True)
    fields.update(overrides)
    return ContinuousBatchingConfig(**fields)


def greedy_config(**overrides) -> GenerationConfig:
    fields = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    fields.update(overrides)
    return GenerationConfig(**fields)


def serving_model(integral: str = "mean", **overrides):
    """A tiny DINT whose next-token distributions are far from uniform (larger initial weights), so that greedy
    tokens vary along a sequence."""
    return tiny_model(integral=integral, initializer_range=0.3, **overrides)


def assert_logprobs_match_full_forward(model, prompt_ids, generated_tokens, logprobs):
    """Each generated token's log-probability equals the one a single forward pass over the request's own tokens
    gives it (the acceptance equation of the cache, per request). fp32; the tolerance covers the different reduction
    orders of a flattened step (a LlamaForCausalLM of the same size is off by 7e-6 under continuous batching)."""
    sequence = torch.tensor([prompt_ids + generated_tokens])
    with torch.no_grad():
        full_logprobs = model(sequence).logits[0].float().log_softmax(-1)
    prompt_length = len(prompt_ids)
    expected = full_logprobs[prompt_length - 1 : -1].gather(-1, torch.tensor(generated_tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(logprobs), expected, atol=5e-5, rtol=1e-5)


def generate_alone(model, prompt_ids, generation_config):
    return model.generate(torch.tensor([prompt_ids]), generation_config=generation_config)[0, len(prompt_ids) :].tolist()


@pytest.mark.parametrize(
    "integral, layout",
    [("mean", {}), ("none", {}), ("mean", V2), ("none", V2), ("mean", V2_GATED)],
    ids=["v1-mean", "v1-none", "v2-mean", "v2-none", "v2-gated-mean"],
)
def test_generate_batch_equals_generate_per_request(integral, layout):
    """Requests of different lengths, more than fit one step, long prompts prefilled in chunks: each request's
    greedy tokens are those of its own generate(), and its log-probabilities those of a full forward."""
    model = serving_model(integral, **layout)
    prompts = random_prompts()
    outputs = model.generate_batch(inputs=prompts, generation_config=greedy_config(), continuous_batching_config=small_cache())
    assert len(outputs) == len(prompts)
    for output in outputs.values():
        assert output.error is None
        assert output.generated_tokens == generate_alone(model, output.prompt_ids, greedy_config())
        assert_logprobs_match_full_forward(model, output.prompt_ids, output.generated_tokens, output.logprobs)
    # The greedy tokens vary (the check above is not passed by a constant prediction)
    assert len({token for output in outputs.values() for token in output.generated_tokens}) > 5


def test_generate_batch_without_carry_differs():
    """The control for the test above: a step that drops each request's carried integral gives other
    log-probabilities, so the equality checks the carry."""
    model = serving_model("mean")
    prompts = random_prompts(lengths=(30, 12))
    original_init = serving.DintPagedStep.__init__

    def init_without_carry(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.carry_blocks = None

    serving.DintPagedStep.__init__ = init_without_carry
    try:
        outputs = model.generate_batch(prompts, generation_config=greedy_config(), continuous_batching_config=small_cache())
    finally:
        serving.DintPagedStep.__init__ = original_init
    output = outputs[next(iter(outputs))]
    with pytest.raises(AssertionError):
        assert_logprobs_match_full_forward(model, output.prompt_ids, output.generated_tokens, output.logprobs)


def test_requests_arriving_while_others_decode():
    """The continuous-batching manager: requests added while earlier ones decode each get their own generate()."""
    model = serving_model("mean")
    prompts = random_prompts()
    manager = model.init_continuous_batching(generation_config=greedy_config(), continuous_batching_config=small_cache())
    manager.start()
    try:
        first_ids = [manager.add_request(prompt, max_new_tokens=NEW_TOKENS) for prompt in prompts[:3]]
        first_result = manager.get_result(request_id=first_ids[0], timeout=60)  # the others are mid-decode now
        later_ids = [manager.add_request(prompt, max_new_tokens=NEW_TOKENS) for prompt in prompts[3:]]
        results = {first_ids[0]: first_result}
        for request_id in first_ids[1:] + later_ids:
            results[request_id] = manager.get_result(request_id=request_id, timeout=60)
    finally:
        manager.stop(block=True, timeout=30)
    for request_id, prompt in zip(first_ids + later_ids, prompts):
        result = results[request_id]
        assert result.prompt_ids == prompt
        assert result.generated_tokens == generate_alone(model, prompt, greedy_config())


def test_sampling_with_a_seed():
    """Sampling: one request with a seed draws the tokens generate() draws from the same seed; a batch's sampled
    tokens have the log-probabilities of a full forward over each request, and the same seed gives the same tokens."""
    model = serving_model("mean")
    sampling = greedy_config(do_sample=True, top_k=0, top_p=1.0, temperature=1.0)
    prompt = random_prompts(lengths=(11,))[0]
    single = model.generate_batch([prompt], generation_config=sampling, continuous_batching_config=small_cache(seed=7))
    torch.manual_seed(7)
    assert next(iter(single.values())).generated_tokens == generate_alone(model, prompt, sampling)

    prompts = random_prompts()
    runs = [
        model.generate_batch(prompts, generation_config=sampling, continuous_batching_config=small_cache(seed=3))
        for _ in range(2)
    ]
    for request_id, output in runs[0].items():
        assert output.generated_tokens == runs[1][request_id].generated_tokens
        assert_logprobs_match_full_forward(model, output.prompt_ids, output.generated_tokens, output.logprobs)


def test_parallel_samples_fork_the_integral_state():
    """num_return_sequences > 1 forks a request's blocks after its prefill: each child's sampled tokens have the
    log-probabilities of a full forward over its own tokens."""
    model = serving_model("mean")
    sampling = greedy_config(do_sample=True, top_k=0, num_return_sequences=3)
    outputs = model.generate_batch(random_prompts(lengths=(13, 6)), generation_config=sampling, continuous_batching_config=small_cache(seed=5))
    assert len(outputs) == 6
    for output in outputs.values():
        assert_logprobs_match_full_forward(model, output.prompt_ids, output.generated_tokens, output.logprobs)


def test_softmax_integral_refuses_continuous_batching_before_any_request():
    """Refused when continuous batching starts for the model, naming the setting and what to do, not at the first
    request."""
    model = serving_model("softmax")
    with pytest.raises(ValueError, match="integral='softmax'.*without continuous batching"):
        model.init_continuous_batching(generation_config=greedy_config(), continuous_batching_config=small_cache())
    with pytest.raises(ValueError, match="integral='softmax'"):
        model.generate_batch(random_prompts(lengths=(4,)), generation_config=greedy_config(), continuous_batching_config=small_cache())


def test_transformers_internals_are_those_serving_was_written_for():
    """Fails loudly when transformers changes what modeling_dint/integrations/serving.py relies on: then re-read the
    internals listed in `serving.TRANSFORMERS_INTERNALS` and port the module."""
    assert installed_release()[:2] in serving.WRITTEN_FOR_TRANSFORMERS, (
        f"serving.py was written for transformers {serving.WRITTEN_FOR_TRANSFORMERS}; {transformers.__version__} is "
        "installed: check every entry of serving.TRANSFORMERS_INTERNALS, then add the release to WRITTEN_FOR_TRANSFORMERS."
    )
    # transformers builds the manager and the paged cache by these module names, for which DINT's subclasses stand in
    # while it builds them (then the names are transformers' own again)
    assert "ContinuousBatchingManager(" in inspect.getsource(continuous_api.ContinuousMixin.init_continuous_batching)
    assert "PagedAttentionCache(" in inspect.getsource(continuous_api.ContinuousBatchingManager._create_batch_processor)
    model = serving_model("mean")
    manager = model.init_continuous_batching(generation_config=greedy_config(), continuous_batching_config=small_cache())
    assert type(manager) is serving.DintContinuousBatchingManager
    assert continuous_api.ContinuousBatchingManager is not serving.DintContinuousBatchingManager
    assert continuous_api.PagedAttentionCache is continuous_batching_cache.PagedAttentionCache
    assert continuous_batching_cache.ATTN_TYPE_TO_ALLOCATOR["dint_attention"] is serving.DintPagedCacheAllocator
    assert list(inspect.signature(continuous_batching_cache.PagedAttentionCache.__init__).parameters)[:3] == [
        "self", "config", "continuous_batching_config"
    ]
    assert list(inspect.signature(continuous_batching_cache.PagedAttentionCache.update).parameters) == [
        "self", "key_states", "value_states", "layer_idx", "kwargs"
    ]
    assert list(inspect.signature(FullAttentionCacheAllocator.__init__).parameters) == [
        "self", "index", "config", "num_key_value_heads", "cache_dtype", "page_size", "layer_indices", "allow_block_sharing"
    ]
    for name in ("register_cache_tensor", "copy_blocks", "update"):
        assert callable(getattr(FullAttentionCacheAllocator, name))
    assert FullAttentionCacheAllocator.layer_type == FULL_ATTENTION == "full_attention"
    # The step inputs DintPagedStep reads
    from transformers.generation.continuous_batching.input_outputs import PagedAttentionArgs

    for name in ("cache", "read_index", "write_index", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_k", "block_table"):
        assert name in PagedAttentionArgs.__annotations__


def test_prefix_sharing_reuses_the_integral_state_of_shared_blocks():
    """A request whose prompt starts with the blocks of an earlier request reads their K/V and their integral state
    instead of recomputing them, and still gets its own generate()."""
    model = serving_model("mean")
    shared_prefix = random_prompts(lengths=(27,))[0]
    prompts = [shared_prefix + [5, 6, 7], shared_prefix + [9, 10]]
    manager = model.init_continuous_batching(generation_config=greedy_config(), continuous_batching_config=small_cache())
    manager.start()
    try:
        results = []
        for prompt in prompts:  # one after the other: the first request's complete blocks are cached when the second comes
            request_id = manager.add_request(prompt, max_new_tokens=NEW_TOKENS)
            results.append(manager.get_result(request_id=request_id, timeout=60))
        cache = manager.batch_processor.cache
        assert cache.use_prefix_sharing
        shared_tokens = cache.search_prefix_match("probe", prompts[1])
        assert shared_tokens == 24  # three complete pages of 8 tokens
    finally:
        manager.stop(block=True, timeout=30)
    for prompt, result in zip(prompts, results):
        assert result.generated_tokens == generate_alone(model, prompt, greedy_config())
        assert_logprobs_match_full_forward(model, prompt, result.generated_tokens, result.logprobs)

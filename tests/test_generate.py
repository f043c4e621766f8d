"""The KV-cache sampler (ppojax.rl.sampler): parity with transformers' greedy decoding, sampling statistics,
top-k / top-p / temperature, stop token and early exit.

Tiny random transformers models are built with torch, saved with save_pretrained and loaded into ppojax.
`build_tiny_hf` is shared with tests/test_forward.py and tests/test_rollout.py.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from ppojax.rl.forward import sequence_inputs  # noqa: E402
from ppojax.backends.cpu.kernels import _first_index_of_top, first_argmax  # noqa: E402
from ppojax.models.kernels import XLA  # noqa: E402
from ppojax.rl.sampler import generate, generate_jit, process_logits, sample_logits  # noqa: E402
from ppojax.models import load_pretrained  # noqa: E402

torch.set_num_threads(1)

VOCAB = 96
PAD = 95  # distinct from eos/stop (0); never the greedy choice for the prompts below (checked)
R = 10
PROMPTS = np.array([[PAD, PAD, PAD, 5, 6, 7],       # left padded, 3 real tokens
                    [8, 9, 10, 11, 12, 13],         # no padding
                    [PAD, PAD, PAD, PAD, PAD, 20]],  # 1 real token
                   dtype=np.int32)


def build_tiny_hf(kind, directory, *, seed=0, score=False):
    """A tiny random transformers model saved to `directory`; returns the torch model (eval mode).

    kind: "gpt2" or "llama" (GQA: 4 query / 2 key-value heads). initializer_range 0.2 (not 0.02) spreads the
    logits so greedy ties are impossible in float32. score=True builds the ForSequenceClassification
    (num_labels=1) variant: a reward / value model.
    """
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, initializer_range=0.2, pad_token_id=PAD, bos_token_id=0, eos_token_id=0)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, **common)
        cls = transformers.GPT2ForSequenceClassification if score else transformers.GPT2LMHeadModel
    elif kind == "llama":
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=64, **common)
        cls = transformers.LlamaForSequenceClassification if score else transformers.LlamaForCausalLM
    else:
        raise ValueError(kind)
    if score:
        config.num_labels = 1
    model = cls(config).eval()
    model.save_pretrained(directory)
    return model


class _CountingLM(nnx.Module):
    """Wraps a CausalLM and counts its forward calls on the host (prefill + one per decode step)."""

    calls = []

    def __init__(self, lm):
        self.lm, self.cfg, self.dtype = lm, lm.cfg, lm.dtype

    def __call__(self, *args, **kwargs):
        jax.debug.callback(lambda: _CountingLM.calls.append(1))
        return self.lm(*args, **kwargs)

    def logits(self, hidden):
        return self.lm.logits(hidden)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def tiny(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = build_tiny_hf(request.param, directory)
    lm, _ = load_pretrained(directory)
    graphdef, params = nnx.split(lm)
    return request.param, hf, lm, graphdef, params


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """(lm, graphdef, params) of a tiny Llama wrapped in `_CountingLM` (transparent; shares compilations)."""
    directory = tmp_path_factory.mktemp("llama_gen")
    build_tiny_hf("llama", directory)
    lm, _ = load_pretrained(directory)
    return lm, *nnx.split(_CountingLM(lm))


def hf_greedy(hf, prompts, response_length, stop_token_id=None):
    """transformers' greedy generate on the same left-padded batch (attention_mask = token != pad).

    transformers derives position ids as cumsum(mask) - 1 (pads -> 0): real tokens get 0, 1, ... exactly like
    ppojax's exclusive cumsum, and each generated token continues from the last real position.
    """
    with torch.no_grad():
        out = hf.generate(torch.tensor(prompts, dtype=torch.long), attention_mask=torch.tensor(prompts != PAD),
                          do_sample=False, max_new_tokens=response_length, pad_token_id=PAD,
                          eos_token_id=stop_token_id)
    out = out[:, prompts.shape[1]:].numpy()
    return np.pad(out, [(0, 0), (0, response_length - out.shape[1])], constant_values=PAD)  # early stop


def test_greedy_matches_transformers(tiny):
    kind, hf, _, graphdef, params = tiny
    expected = hf_greedy(hf, PROMPTS, R)
    assert not (expected == PAD).any(), "test precondition: the pad token is never generated"
    got = generate_jit(graphdef, params, jnp.asarray(PROMPTS), jax.random.key(0), response_length=R,
                       pad_token_id=PAD, greedy=True)
    np.testing.assert_array_equal(np.asarray(got), expected, err_msg=kind)

    # with a stop token: transformers' eos handling (pad after eos, early stop) is the same contract
    stop = int(expected[0, 3])  # appears in row 0 (and maybe elsewhere); rows without it run to R
    expected_stop = hf_greedy(hf, PROMPTS, R, stop_token_id=stop)
    got_stop = generate_jit(graphdef, params, jnp.asarray(PROMPTS), jax.random.key(0), response_length=R,
                            pad_token_id=PAD, greedy=True, stop_token_id=stop)
    np.testing.assert_array_equal(np.asarray(got_stop), expected_stop, err_msg=kind)
    assert (expected_stop[0, 4:] == PAD).all()


def test_top_k_1_equals_greedy(tiny_llama):
    _, graphdef, params = tiny_llama
    prompts = jnp.asarray(PROMPTS)
    greedy = generate_jit(graphdef, params, prompts, jax.random.key(0), response_length=R, pad_token_id=PAD,
                          greedy=True)
    top1 = generate_jit(graphdef, params, prompts, jax.random.key(3), response_length=R, pad_token_id=PAD,
                        temperature=0.7, top_k=1)
    np.testing.assert_array_equal(np.asarray(top1), np.asarray(greedy))


def _tv(draws, probs):
    empirical = np.bincount(draws, minlength=probs.shape[-1]) / draws.shape[0]
    return 0.5 * np.abs(empirical - probs).sum()


def _expected_tv(probs, n):
    """E[TV] of n multinomial draws from probs (normal approximation): 0.5 sum sqrt(2 p (1-p) / (pi n))."""
    return 0.5 * np.sum(np.sqrt(2 * probs * (1 - probs) / (np.pi * n)))


def test_first_token_frequencies_match_softmax(tiny_llama):
    """4000 seeded draws of the first token (vmap over keys, through the whole generate) ~ softmax(l/T)."""
    lm, graphdef, params = tiny_llama
    n, temperature = 4000, 0.7
    prompts = jnp.asarray(PROMPTS[:2])
    draw = jax.jit(jax.vmap(lambda key: generate_jit(graphdef, params, prompts, key, response_length=1,
                                                     pad_token_id=PAD, temperature=temperature)[:, 0]))
    draws = np.asarray(draw(jax.random.split(jax.random.key(0), n)))  # [n, B]
    hidden, _ = lm(*sequence_inputs(prompts, PAD))
    logits = lm.logits(hidden[:, -1])
    probs = np.asarray(jax.nn.softmax(logits / (temperature + 1e-7)))
    untempered = np.asarray(jax.nn.softmax(logits))
    for b in range(prompts.shape[0]):
        bound = 2 * _expected_tv(probs[b], n)
        assert _tv(draws[:, b], probs[b]) < bound
        assert _tv(draws[:, b], untempered[b]) > bound  # the test can tell a wrong temperature


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.8), (20, 0.6)])
def test_truncated_sampling_frequencies(top_k, top_p):
    """Draws stay inside the top-k / top-p set and follow the renormalised softmax."""
    n, temperature = 4000, 0.7
    logits = jax.random.normal(jax.random.key(1), (2, VOCAB)) * 2.0
    keys = jax.random.split(jax.random.key(2), n)
    draws = np.asarray(jax.jit(jax.vmap(lambda k: sample_logits(logits, k, temperature=temperature, top_k=top_k,
                                                               top_p=top_p)))(keys))
    weights = process_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    probs = np.asarray(jax.nn.softmax(weights))
    for b in range(2):
        allowed = np.isfinite(np.asarray(weights[b]))
        assert allowed[draws[:, b]].all()
        if top_k:
            assert allowed.sum() <= top_k
        assert _tv(draws[:, b], probs[b]) < 2 * _expected_tv(probs[b], n)


@pytest.mark.parametrize("argmax", [first_argmax, XLA.argmax], ids=["cpu", "xla"])
def test_the_kernels_argmax_is_numpys_argmax(argmax):
    """The sampler's argmax (``Kernels.argmax``: the CPU's two reductions, XLA's ``jnp.argmax``): ties go to the
    lowest index, a NaN counts as the largest (the first NaN wins), an all -inf row gives 0: numpy's answers."""
    rng = np.random.default_rng(3)
    x = rng.integers(-3, 4, size=(64, 257)).astype(np.float32)  # many ties
    x[5, 100] = np.nan
    x[6, [7, 200]] = np.nan
    x[7] = -np.inf
    x[8, :] = -np.inf
    x[8, [30, 31]] = 1.0
    x[9, 256] = np.inf
    for rows in (x, x[:, :1], x.reshape(8, 8, 257)):
        np.testing.assert_array_equal(np.asarray(jax.jit(argmax)(jnp.asarray(rows))),
                                      np.argmax(rows, axis=-1))


def test_a_maximum_the_row_does_not_hold_still_gives_the_rows_argmax():
    """When the maximum came from another copy of x that rounded differently (XLA may compute x twice), no
    element equals it: the row's index is then jnp.argmax's, never the vocabulary size."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(6, 5, 33)).astype(np.float32)
    top = x.max(-1, keepdims=True)
    top[1, 2] = np.nextafter(top[1, 2], np.inf)  # a copy that rounded up
    top[4, :] = np.nextafter(top[4, :], -np.inf)  # every row of a block rounded down: x >= top everywhere
    got = np.asarray(jax.jit(_first_index_of_top)(jnp.asarray(x), jnp.asarray(top)))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))


def test_draws_stay_in_the_vocabulary_when_xla_computes_the_noisy_logits_twice():
    """At --xla_backend_optimization_level=0 XLA:CPU computes gumbel + logits once into the maximum and
    again into the comparison, rounding the copies differently (jax 0.10): without the fallback a sixth of
    these draws were the vocabulary size. They are jax.random.categorical's draws."""
    h = jax.random.normal(jax.random.key(1), (2, 32))
    w = jax.random.normal(jax.random.key(3), (32, VOCAB)) * 0.3
    keys = jax.random.split(jax.random.key(2), 4000)
    cheap = {"xla_backend_optimization_level": 0}

    def compiled(draw):
        program = jax.jit(lambda h, w, keys: jax.vmap(lambda key: draw(h @ w, key))(keys))
        return np.asarray(program.lower(h, w, keys).compile(compiler_options=cheap)(h, w, keys))

    ours = compiled(lambda logits, key: sample_logits(logits, key, temperature=0.7))
    theirs = compiled(lambda logits, key: jax.random.categorical(key, logits / (0.7 + 1e-7)))
    assert ours.max() < VOCAB
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("top_k", [0, 7])
def test_sample_logits_draws_what_jax_random_categorical_draws(top_k):
    """Same key, same token as ``jax.random.categorical`` on the same sampler weights (-inf cut included)."""
    logits = jax.random.normal(jax.random.key(4), (8, VOCAB)) * 3.0
    keys = jax.random.split(jax.random.key(5), 300)
    ours = jax.jit(jax.vmap(lambda k: sample_logits(logits, k, temperature=0.7, top_k=top_k)))(keys)
    weights = process_logits(logits, temperature=0.7, top_k=top_k)
    theirs = jax.jit(jax.vmap(lambda k: jax.random.categorical(k, weights, axis=-1)))(keys)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    assert ours.dtype == jnp.int32


def test_top_p_keeps_smallest_set_reaching_p():
    rng = np.random.default_rng(0)
    for top_p in (0.05, 0.3, 0.5, 0.9, 0.99):
        logits = rng.normal(size=(4, 50)).astype(np.float32) * 3
        kept = np.isfinite(np.asarray(process_logits(jnp.asarray(logits), temperature=1.0, top_p=top_p)))
        for row, keep in zip(logits, kept):
            probs = np.exp(row - row.max())
            probs /= probs.sum()
            order = np.argsort(-probs)
            size = int(np.searchsorted(np.cumsum(probs[order]), top_p) + 1)  # smallest prefix with mass >= p
            expected = np.zeros_like(keep)
            expected[order[:size]] = True
            np.testing.assert_array_equal(keep, expected)
            assert probs[keep].sum() >= top_p - 1e-6
            assert probs[keep].sum() - probs[keep].min() < top_p  # dropping any kept token falls short


def test_temperature_scaling_as_spec():
    logits = jax.random.normal(jax.random.key(0), (3, VOCAB))
    process = jax.jit(process_logits, static_argnames=("temperature", "top_k", "top_p"))
    for temperature in (0.3, 0.7, 1.0, 2.0):
        np.testing.assert_allclose(process(logits, temperature=temperature), logits / (temperature + 1e-7),
                                   rtol=1e-6)
    # top_k / top_p act on the tempered distribution, top_k before top_p (transformers' order)
    cut = process(logits, temperature=0.5, top_k=10, top_p=0.5)
    assert (np.isfinite(np.asarray(cut)).sum(-1) <= 10).all()


def test_stop_token_pads_and_matches_unstopped_sampling(tiny_llama):
    """Same key: sampling with a stop token = sampling without, truncated after the stop (one key per step)."""
    _, graphdef, params = tiny_llama
    prompts, key = jnp.asarray(PROMPTS), jax.random.key(7)
    kwargs = dict(response_length=R, pad_token_id=PAD, temperature=1.0)
    free = np.asarray(generate_jit(graphdef, params, prompts, key, **kwargs))
    assert not (free == PAD).any()
    stop = int(free[1, 2])
    stopped = np.asarray(generate_jit(graphdef, params, prompts, key, stop_token_id=stop, **kwargs))
    assert_stopped_after_the_stop_token(free, stopped, stop)


def assert_stopped_after_the_stop_token(free, stopped, stop):
    """Each row of ``stopped`` is its row of ``free`` (sampled without a stop token, same key) up to and including
    the first ``stop``, then pads."""
    for row_free, row_stopped in zip(np.asarray(free), np.asarray(stopped)):
        hits = np.flatnonzero(row_free == stop)
        end = hits[0] + 1 if hits.size else len(row_free)
        np.testing.assert_array_equal(row_stopped[:end], row_free[:end])
        assert (row_stopped[end:] == PAD).all()


def test_decode_loop_exits_early_when_all_done(tiny_llama):
    _, graphdef, params = tiny_llama
    prompts = jnp.asarray(np.repeat(PROMPTS[1:2], 3, axis=0))  # identical rows: identical greedy tokens
    kwargs = dict(response_length=R, pad_token_id=PAD, greedy=True)
    _CountingLM.calls.clear()
    free = np.asarray(generate_jit(graphdef, params, prompts, jax.random.key(0), **kwargs))
    jax.effects_barrier()
    assert len(_CountingLM.calls) == R  # prefill + R-1 decode steps
    _CountingLM.calls.clear()
    stop = int(free[0, 2])
    end = int(np.flatnonzero(free[0] == stop)[0])  # first step that emits the stop token (<= 2)
    stopped = np.asarray(generate_jit(graphdef, params, prompts, jax.random.key(0), stop_token_id=stop, **kwargs))
    jax.effects_barrier()
    assert len(_CountingLM.calls) == end + 1  # prefill + `end` decode steps, then every row is done
    assert (stopped[:, end + 1:] == PAD).all() and (stopped[:, :end + 1] == free[:, :end + 1]).all()


def test_decode_segments_read_only_the_filled_slots_and_sample_the_same_tokens(tiny):
    """The decode loop cut into segments whose attention reads only the cache slots filled so far (fewer than
    the cache's P + R until the last) gives transformers' greedy tokens, and with a key the same samples and
    log-probs as one loop; a stop token still ends every segment's loop at once."""
    from ppojax.rl.sampler import decode_segments
    kind, hf, _, graphdef, params = tiny
    long_r = 24
    # slots read rounded up to 8 here (the default, 128, leaves a cache this short one loop)
    plan = decode_segments(PROMPTS.shape[1], long_r, 4, alignment=8)
    assert plan == [(7, 16), (19, 24), (24, 30)]  # 4 cuts, two reading 24 slots as one loop; P + R = 30
    assert decode_segments(PROMPTS.shape[1], R, 4, alignment=8) == [(R, 16)]  # P + R = 16: nothing to save
    assert decode_segments(512, 1024, 4) == [(257, 768), (513, 1024), (769, 1280), (1024, 1536)]
    assert decode_segments(PROMPTS.shape[1], long_r, 4) == [(long_r, 30)]
    prompts = jnp.asarray(PROMPTS)
    expected = hf_greedy(hf, PROMPTS, long_r)
    got = generate_jit(graphdef, params, prompts, jax.random.key(0), response_length=long_r, pad_token_id=PAD,
                       greedy=True, segments=4, slot_alignment=8)
    np.testing.assert_array_equal(np.asarray(got), expected, err_msg=kind)

    kwargs = dict(response_length=long_r, pad_token_id=PAD, temperature=1.0, return_logprobs=True)
    one, one_logprobs = generate_jit(graphdef, params, prompts, jax.random.key(5), **kwargs)
    cut, cut_logprobs = generate_jit(graphdef, params, prompts, jax.random.key(5), segments=4, slot_alignment=8,
                                     **kwargs)
    np.testing.assert_array_equal(np.asarray(cut), np.asarray(one))
    np.testing.assert_allclose(np.asarray(cut_logprobs), np.asarray(one_logprobs), atol=1e-5)
    stop = int(np.asarray(one)[1, 2])
    stopped = generate_jit(graphdef, params, prompts, jax.random.key(5), stop_token_id=stop, segments=4,
                           slot_alignment=8, **kwargs)[0]
    assert_stopped_after_the_stop_token(one, stopped, stop)


def test_later_decode_segments_run_no_step_once_every_row_is_done(tiny_llama):
    from ppojax.rl.sampler import decode_segments
    _, graphdef, params = tiny_llama
    prompts = jnp.asarray(np.repeat(PROMPTS[1:2], 3, axis=0))
    assert len(decode_segments(PROMPTS.shape[1], 24, 3, alignment=8)) == 3
    kwargs = dict(response_length=24, pad_token_id=PAD, greedy=True, segments=3, slot_alignment=8)
    free = np.asarray(generate_jit(graphdef, params, prompts, jax.random.key(0), **kwargs))
    stop = int(free[0, 2])
    end = int(np.flatnonzero(free[0] == stop)[0])
    _CountingLM.calls.clear()
    generate_jit(graphdef, params, prompts, jax.random.key(0), stop_token_id=stop, **kwargs)
    jax.effects_barrier()
    assert len(_CountingLM.calls) == end + 1  # prefill + `end` decode steps in the first segment, none after


def test_one_prefill_per_group_samples_what_g_prefills_sample(tiny):
    """GRPO/RLOO's G samples of a prompt: the prompt prefilled once and its keys and values repeated for its G
    rows (``group_size``) gives the same tokens, log-probs and stops as the repeated prompts prefilled row by row,
    and the prefill's work is the unique prompts': its program's FLOPs fall by about G."""
    kind, _, _, graphdef, params = tiny
    G = 3
    kwargs = dict(response_length=R, pad_token_id=PAD, temperature=1.0, return_logprobs=True)
    prompts = jnp.asarray(PROMPTS)
    repeated = jnp.repeat(prompts, G, axis=0)
    rows, rows_logprobs = generate_jit(graphdef, params, repeated, jax.random.key(7), **kwargs)
    grouped, grouped_logprobs = generate_jit(graphdef, params, prompts, jax.random.key(7), group_size=G, **kwargs)
    assert grouped.shape == (G * len(PROMPTS), R)
    np.testing.assert_array_equal(np.asarray(grouped), np.asarray(rows), err_msg=kind)
    np.testing.assert_allclose(np.asarray(grouped_logprobs), np.asarray(rows_logprobs), atol=1e-5, err_msg=kind)
    assert len({tuple(r) for r in np.asarray(grouped)[:G]}) > 1  # a group's rows draw their own tokens
    stop = int(np.asarray(rows)[1, 2])
    stopped = generate_jit(graphdef, params, prompts, jax.random.key(7), stop_token_id=stop, group_size=G,
                           **kwargs)[0]
    assert_stopped_after_the_stop_token(rows, stopped, stop)

    def prefill_flops(prompt_ids, group_size):  # the prefill alone: a response of one token
        compiled = jax.jit(lambda p: generate(graphdef, params, p, jax.random.key(0), response_length=1,
                                              pad_token_id=PAD, group_size=group_size)).lower(prompt_ids).compile()
        return compiled.cost_analysis()["flops"]

    assert prefill_flops(prompts, G) < 0.4 * prefill_flops(repeated, 1)  # G = 3: about a third


def test_the_slots_read_are_aligned_as_the_models_kernels_say(tmp_path, monkeypatch):
    """A sampler reads its cache in the slot alignment of the model's kernels (``Kernels.slot_alignment``): XLA's
    (and TPUs') 128 leaves a cache of P + 100 = 106 slots one loop reading all of it; the CPU's 32 cuts the decode
    into loops reading 32, 64, 96 and all 106 slots, the prefill its 32; the greedy tokens are those of one loop."""
    from ppojax.backends.cpu.kernels import CpuKernels
    from ppojax.models import CausalLM
    from ppojax.rl.sampler import decode_segments

    build_tiny_hf("llama", tmp_path)
    prompts, response_length = jnp.asarray(PROMPTS), 100
    assert CpuKernels().slot_alignment == 32 and XLA.slot_alignment == 128
    reads = []
    original = CausalLM.__call__

    def recording(self, input_ids, *args, cache=None, **kwargs):
        reads.append((input_ids.shape[1], cache.slots_read))
        return original(self, input_ids, *args, cache=cache, **kwargs)

    monkeypatch.setattr(CausalLM, "__call__", recording)
    tokens = {}
    for kernels in (XLA, CpuKernels()):
        reads.clear()
        graphdef, params = nnx.split(load_pretrained(tmp_path, kernels=kernels)[0])
        tokens[kernels.name] = np.asarray(jax.jit(lambda p, x: generate(
            graphdef, p, x, jax.random.key(0), response_length=response_length, pad_token_id=PAD, greedy=True,
            segments=4))(params, prompts))
        length = PROMPTS.shape[1] + response_length
        expected = {read for _, read in decode_segments(PROMPTS.shape[1], response_length, 4,
                                                        kernels.slot_alignment)}
        assert {read for s, read in reads if s == 1} == expected
        assert {read for s, read in reads if s > 1} == {min(length, kernels.slot_alignment)}  # the prefill's
    assert {read for s, read in reads if s == 1} == {32, 64, 96, 106}
    np.testing.assert_array_equal(tokens["cpu"], tokens["xla"])

"""Forward passes shared by rollout and loss (ppojax.rl.forward) against an independent torch reference that
follows TRL's code: input_ids with pad -> 0, attention_mask = token != pad, position_ids = exclusive cumsum,
logits[:, P-1:-1] / (T + 1e-7), log_softmax + gather; values and rewards via TRL's get_reward indexing."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from ppojax.rl.forward import (logprobs_from_hidden, response_logprobs, response_values,  # noqa: E402
                            sequence_inputs, sequence_scores)
from ppojax.models import load_pretrained  # noqa: E402
from tests.test_generate import PAD, build_tiny_hf  # noqa: E402

P, R, T = 5, 8, 0.7
STOP = 0
# prompts (left padded) + responses: one stopped early (pad after the stop), one full, one starting to stop.
QUERY_RESPONSES = np.array([
    [PAD, PAD, 3, 4, 5, 10, 11, STOP, PAD, PAD, PAD, PAD, PAD],
    [6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17, 18, 19],
    [PAD, PAD, PAD, PAD, 2, STOP, PAD, PAD, PAD, PAD, PAD, PAD, PAD],
], dtype=np.int32)


def trl_inputs(query_responses):
    """TRL's `forward`: (input_ids with pad -> 0, attention_mask, position_ids) as torch tensors."""
    tokens = torch.tensor(query_responses, dtype=torch.long)
    mask = tokens != PAD
    position_ids = mask.cumsum(1) - mask.long()
    return torch.masked_fill(tokens, ~mask, 0), mask, position_ids


def trl_first_true_indices(bools):
    row_len = bools.shape[-1]
    return np.min(row_len * (~bools) + np.arange(row_len), axis=-1)


def test_sequence_inputs():
    tokens = jnp.asarray([[PAD, PAD, 3, 4, PAD, 5], [6, 7, 8, 9, 10, 11]])
    ids, mask, pos = sequence_inputs(tokens, PAD)
    np.testing.assert_array_equal(ids, [[0, 0, 3, 4, 0, 5], [6, 7, 8, 9, 10, 11]])
    np.testing.assert_array_equal(mask, [[0, 0, 1, 1, 0, 1], [1] * 6])
    np.testing.assert_array_equal(pos, [[0, 0, 0, 1, 2, 2], [0, 1, 2, 3, 4, 5]])


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_response_logprobs_match_torch_full_forward(kind, tmp_path):
    hf = build_tiny_hf(kind, tmp_path)
    lm, _ = load_pretrained(tmp_path)
    graphdef, params = nnx.split(lm)

    with torch.no_grad():
        ids, mask, pos = trl_inputs(QUERY_RESPONSES)
        logits = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    logits = logits[:, P - 1:-1].double() / (T + 1e-7)
    logp_all = torch.log_softmax(logits, -1)
    responses = torch.tensor(QUERY_RESPONSES[:, P:], dtype=torch.long)
    expected = torch.gather(logp_all, 2, responses[..., None])[..., 0].numpy()
    expected_entropy = (torch.logsumexp(logits, -1) - (logp_all.exp() * logits).sum(-1)).numpy()

    @jax.jit
    def both(params):
        model = nnx.merge(graphdef, params)
        full = response_logprobs(model, jnp.asarray(QUERY_RESPONSES), P, PAD, T, with_entropy=True)
        chunked = response_logprobs(model, jnp.asarray(QUERY_RESPONSES), P, PAD, T, chunk_size=3,
                                    with_entropy=True)  # 3 does not divide R = 8: a padded last chunk
        return full, chunked

    (logprobs, entropy), (logprobs_c, entropy_c) = both(params)
    np.testing.assert_allclose(logprobs, expected, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(entropy, expected_entropy, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(logprobs_c, logprobs, atol=1e-6)
    np.testing.assert_allclose(entropy_c, entropy, atol=1e-6)


class _LinearHead:
    """The part of a CausalLM that logprobs_from_hidden uses: ``logits(hidden) = hidden @ w``."""

    def __init__(self, w):
        self.w = w

    def logits(self, hidden):
        return hidden @ self.w


def test_chunked_gradients_equal_and_logits_never_materialised():
    """Chunking over time gives the same values and gradients, and the compiled backward keeps far less
    float32 logits memory: B * chunk * V instead of B * R * V (DESIGN: large vocabularies must fit)."""
    batch, length, dim, vocab = 2, 64, 16, 8192
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    w = jax.random.normal(k1, (dim, vocab)) * 0.3
    hidden = jax.random.normal(k2, (batch, length, dim))
    tokens = jax.random.randint(k3, (batch, length), 0, vocab)

    def loss(w, hidden, chunk_size):
        logprobs, entropy = logprobs_from_hidden(_LinearHead(w), hidden, tokens, T, chunk_size=chunk_size,
                                                 with_entropy=True)
        return logprobs.sum() + 0.1 * entropy.sum()

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)
    full_c = grad.lower(w, hidden, None).compile()
    chunked_c = grad.lower(w, hidden, 8).compile()
    for a, b in zip(jax.tree.leaves(full_c(w, hidden)), jax.tree.leaves(chunked_c(w, hidden))):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)

    full_logits_bytes = batch * length * vocab * 4
    full_mem, chunked_mem = full_c.memory_analysis(), chunked_c.memory_analysis()
    if full_mem is None or chunked_mem is None:
        pytest.skip("this backend reports no memory analysis")
    # unchunked: logits, softmax and their cotangents (several copies); chunked: less than ONE copy in total
    assert full_mem.temp_size_in_bytes > 2 * full_logits_bytes
    assert chunked_mem.temp_size_in_bytes < full_logits_bytes


@pytest.mark.parametrize("kind", ["llama"])
def test_values_and_scores_follow_trl_get_reward(kind, tmp_path):
    hf = build_tiny_hf(kind, tmp_path, seed=1, score=True)
    score_model, _ = load_pretrained(tmp_path, kind="score")
    with torch.no_grad():  # TRL's get_reward: score head on the backbone's last hidden states
        ids, mask, pos = trl_inputs(QUERY_RESPONSES)
        hidden = getattr(hf, hf.base_model_prefix)(input_ids=ids, attention_mask=mask, position_ids=pos)[0]
        full = hf.score(hidden)[..., 0].double().numpy()
    expected_values = full[:, P - 1:-1]
    last = trl_first_true_indices(QUERY_RESPONSES[:, P:] == PAD) - 1 + P
    expected_scores = full[np.arange(len(full)), last]

    values = jax.jit(lambda qr: response_values(score_model, qr, P, PAD))(jnp.asarray(QUERY_RESPONSES))
    scores = jax.jit(lambda qr: sequence_scores(score_model, qr, PAD, prompt_length=P))(
        jnp.asarray(QUERY_RESPONSES))
    np.testing.assert_allclose(values, expected_values, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(scores, expected_scores, atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(last, [P + 2, P + 7, P + 0])
    # without prompt_length: the last non-pad token of the row (the same here: no pad inside a response)
    np.testing.assert_allclose(sequence_scores(score_model, jnp.asarray(QUERY_RESPONSES), PAD), scores,
                               atol=1e-6)


def test_auto_chunk_size_fits_the_logits_budget():
    from ppojax.rl.forward import LOGITS_MEMORY_BUDGET, auto_chunk_size

    # SmolLM2 benchmark: 8 rows x 32 steps x 49,152 vocab = 50 MB of float32 logits: no chunking
    assert auto_chunk_size(8, 32, 49152) is None
    # 64 rows x 512 steps x 128,256 vocab (Llama-3) would be 16.8 GB: chunks of 8 steps (262 MB budget)
    chunk = auto_chunk_size(64, 512, 128256)
    assert chunk == LOGITS_MEMORY_BUDGET // (4 * 64 * 128256) == 8
    assert 4 * 64 * chunk * 128256 <= LOGITS_MEMORY_BUDGET < 4 * 64 * (chunk + 1) * 128256
    assert auto_chunk_size(10**6, 4, 10**6) == 1  # not even one step fits: one at a time

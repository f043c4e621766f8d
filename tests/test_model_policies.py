"""Model-level policies: rematerialisation ("none" | "full" | "dots") and precision ("float32" | "bfloat16" |
"mixed").

Remat must not change the gradient, only what the forward keeps for the backward (read from JAX's own
`print_saved_residuals` and from XLA's memory analysis of the compiled gradient). Precision: parameters and matmul
operands have the dtypes the policy names (read from the traced program), and logits and gradients stay close to
float32's."""

import contextlib
import io
import re

import jax
import jax.ad_checkpoint
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ppojax.models import CausalLM, ModelConfig, apply_causal_lm, load_pretrained
from ppojax.models.precision import PRECISIONS, precision_dtypes
from ppojax.models.remat import REMAT_POLICIES

from .test_models import left_padded_batch, make_hf, max_diff_live

LLAMA = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


def tiny_llama(**kwargs):
    cfg = ModelConfig.from_hf(LLAMA)
    return cfg, CausalLM(cfg, rngs=nnx.Rngs(0), **kwargs)


def token_logprob_loss(graphdef, params, ids, mask):
    """Mean log-probability of the next token over real positions (a PPO-like loss of the logits)."""
    logits = apply_causal_lm(graphdef, params, ids, mask)[0]
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    tok = jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    live = mask[:, 1:] & mask[:, :-1]
    return -jnp.sum(jnp.where(live, tok, 0.0)) / jnp.sum(live)


# ------------------------------------------------------------------------------------------------------ remat


@pytest.mark.parametrize("scan_layers", [True, False])
def test_remat_policies_give_the_same_gradient(scan_layers):
    ids, mask = left_padded_batch([12, 9, 4], 12)
    ids, mask = jnp.asarray(ids) % LLAMA["vocab_size"], jnp.asarray(mask)
    grads = {}
    for remat in REMAT_POLICIES:
        graphdef, params = nnx.split(tiny_llama(remat=remat, scan_layers=scan_layers)[1])
        loss, grads[remat] = jax.jit(jax.value_and_grad(token_logprob_loss, argnums=1), static_argnums=0)(
            graphdef, params, ids, mask)
        assert np.isfinite(loss)
    for remat in ("full", "dots"):
        for a, b in zip(jax.tree.leaves(grads["none"]), jax.tree.leaves(grads[remat])):
            assert np.max(np.abs(np.asarray(a) - np.asarray(b))) <= 1e-6
    assert max(float(np.abs(g).max()) for g in jax.tree.leaves(grads["none"])) > 1e-3  # a gradient that matters


def saved_per_layer(remat, b=2, s=16):
    """The shapes the forward keeps for the backward, stacked over layers by the scan: [(L, ...), ...] (L != b)."""
    cfg, model = tiny_llama(remat=remat)
    graphdef, params = nnx.split(model)
    ids, mask = jnp.ones((b, s), jnp.int32), jnp.ones((b, s), bool)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(lambda p: token_logprob_loss(graphdef, p, ids, mask), params)
    shapes = []
    for line in out.getvalue().splitlines():
        m = re.match(r"\w+\[([\d,]*)\] output of scan", line)
        shape = tuple(int(d) for d in m.group(1).split(",")) if m else ()
        if shape[:1] == (cfg.num_layers,):  # stacked per layer (the scan's final carry is not)
            shapes.append(shape)
    return cfg, shapes


def test_remat_policies_change_what_is_saved():
    b, s = 2, 16
    cfg, none = saved_per_layer("none", b, s)
    _, full = saved_per_layer("full", b, s)
    _, dots = saved_per_layer("dots", b, s)
    L, D, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    hq, hkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    # "full": only each layer's input (the residual stream)
    assert full == [(L, b, s, D)]
    # "dots": the projections' outputs (2-D dots on the B*S tokens: q, k, v, MLP up and gate; o's einsum output)
    # and no attention-probability tensor [..., G*S, S] (a key head's G query heads' rows over the S keys)
    attention_probabilities = lambda shape: shape[-1] == s and shape[-2] % s == 0  # noqa: E731
    for shape in [(L, b * s, hq), (L, b * s, hkv), (L, b * s, F)]:
        assert shape in dots, (shape, dots)
    assert not any(attention_probabilities(shape) for shape in dots)
    # "none": keeps far more, the attention probabilities among them
    assert any(attention_probabilities(shape) for shape in none)
    size = lambda shapes: sum(int(np.prod(x)) for x in shapes)  # noqa: E731
    assert size(none) > size(dots) > size(full)


def test_remat_lowers_compiled_temporary_memory():
    """XLA's own memory analysis of the compiled gradient: the policies order as they should."""
    ids, mask = jnp.ones((4, 64), jnp.int32), jnp.ones((4, 64), bool)
    temp = {}
    for remat in REMAT_POLICIES:
        graphdef, params = nnx.split(tiny_llama(remat=remat)[1])
        grad = jax.jit(jax.grad(token_logprob_loss, argnums=1), static_argnums=0)
        analysis = grad.lower(graphdef, params, ids, mask).compile().memory_analysis()
        if analysis is None:
            pytest.skip("this backend gives no memory analysis")
        temp[remat] = analysis.temp_size_in_bytes
    assert temp["none"] > temp["dots"] > temp["full"], temp


def test_remat_clear_error():
    with pytest.raises(ValueError, match=r"remat=True is not one of \('none', 'full', 'dots'\).*spelling of 'full'"):
        tiny_llama(remat=True)
    with pytest.raises(ValueError, match=r"remat='everything' is not one of"):
        tiny_llama(remat="everything")


# -------------------------------------------------------------------------------------------------- precision


def test_precision_dtypes():
    assert precision_dtypes("float32") == (jnp.float32, jnp.float32)
    assert precision_dtypes("bfloat16") == (jnp.bfloat16, jnp.bfloat16)
    assert precision_dtypes("mixed") == (jnp.bfloat16, jnp.float32)
    with pytest.raises(ValueError, match=r"precision 'fp16' is not one of \('float32', 'bfloat16', 'mixed'\)"):
        precision_dtypes("fp16")
    assert set(PRECISIONS) == {"float32", "bfloat16", "mixed"}


def all_jaxprs(jaxpr):
    """A (closed) jaxpr and every sub-jaxpr in it (scan, jit, checkpoint, custom VJP bodies), depth first."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    yield jaxpr
    for eqn in jaxpr.eqns:
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
                    yield from all_jaxprs(sub)


def dot_operand_dtypes(jaxpr) -> list[tuple]:
    """(operand dtypes, operand shapes) of every dot_general in a (closed) jaxpr, sub-jaxprs included. An operand
    converted to float32 from a 16-bit value just before the product counts as that 16-bit dtype: its values are
    16-bit ones (on the CPU the 16-bit matmuls take a float32 result, whose cotangent in the backward is such a
    conversion, see `transformer._matmul`)."""
    found = []
    for body in all_jaxprs(jaxpr):
        widened_from = {eqn.outvars[0]: eqn.invars[0].aval.dtype for eqn in body.eqns
                        if eqn.primitive.name == "convert_element_type"
                        and jnp.dtype(eqn.invars[0].aval.dtype).itemsize == 2
                        and eqn.outvars[0].aval.dtype == jnp.float32}
        found.extend((tuple(widened_from.get(v, v.aval.dtype) for v in eqn.invars),
                      tuple(v.aval.shape for v in eqn.invars))
                     for eqn in body.eqns if eqn.primitive.name == "dot_general")
    return found


@pytest.mark.parametrize("remat", ["none", "dots"])
def test_mixed_params_float32_matmuls_bfloat16(remat):
    compute, param = precision_dtypes("mixed")
    _, model = tiny_llama(dtype=compute, param_dtype=param, remat=remat)
    graphdef, params = nnx.split(model)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    ids, mask = jnp.ones((2, 8), jnp.int32), jnp.ones((2, 8), bool)
    bf16 = (jnp.dtype(jnp.bfloat16),) * 2

    def weight_dots(dots):  # the matmuls of the weights: those with a hidden-size axis (attention's have none)
        return [dtypes for dtypes, shapes in dots if any(LLAMA["hidden_size"] in shape for shape in shapes)]

    # the forward: every matmul's operands are bfloat16 (attention's too, when it runs through XLA)
    dots = dot_operand_dtypes(jax.make_jaxpr(lambda p: apply_causal_lm(graphdef, p, ids, mask)[0])(params))
    assert len(weight_dots(dots)) >= 8  # the scanned layer body (q k v o up gate down) + logits
    assert {dtypes for dtypes, _ in dots} == {bf16}
    # the gradient: every matmul of the weights runs in bfloat16 too, the logits' backward included. (The XLA
    # attention of jax.nn.dot_product_attention multiplies its float32 score cotangent with bfloat16 q / k:
    # JAX's choice, so attention's matmuls are not checked here.)
    grad = jax.grad(lambda p: token_logprob_loss(graphdef, p, ids, mask))
    dots = weight_dots(dot_operand_dtypes(jax.make_jaxpr(grad)(params)))
    assert len(dots) >= 2 * 8  # dx and dw of q k v o up gate down and the logits
    assert set(dots) == {bf16}
    logits, hidden, _ = apply_causal_lm(graphdef, params, ids, mask)
    assert logits.dtype == jnp.float32 and hidden.dtype == jnp.bfloat16


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_bfloat16_and_mixed_logits_close_to_float32(name, tmp_path):
    """Tolerance: bfloat16 keeps 8 significant bits, a relative rounding error of up to 2^-9 (0.2%) each time a
    value is rounded. A layer rounds about ten times (norm output, q/k/v, scores' probabilities, attention output,
    o, MLP up/gate/activation/down, the residual), and independent roundings add in quadrature: over 2 layers and
    the head, sqrt(~20) * 0.2% ~ 1% of the logits' size is expected. We allow 3x that: the root-mean-square error
    within 3% of the logits' root-mean-square and the largest error within 5% of the largest logit; and the error
    must be non-zero (the model really computed in bfloat16)."""
    _, path = make_hf(name, tmp_path)
    ids, mask = left_padded_batch([12, 7, 3], 12)
    run = jax.jit(lambda g, p: apply_causal_lm(g, p, ids, mask)[0], static_argnums=0)
    ref = np.asarray(run(*nnx.split(load_pretrained(path)[0])))
    rms = np.sqrt(np.mean(ref[mask] ** 2))
    for precision in ("mixed", "bfloat16"):
        compute, param = precision_dtypes(precision)
        model, _ = load_pretrained(path, dtype=compute, param_dtype=param)
        got = np.asarray(run(*nnx.split(model)))
        assert got.dtype == np.float32 and np.isfinite(got).all()
        err = (got - ref)[mask]
        assert np.sqrt(np.mean(err ** 2)) < 0.03 * rms, (precision, np.sqrt(np.mean(err ** 2)), rms)
        assert max_diff_live(got, ref, mask) < 0.05 * np.abs(ref[mask]).max()
        assert np.abs(err).max() > 0  # really computed in bfloat16


def test_mixed_gradient_float32_and_close():
    ids, mask = left_padded_batch([12, 9, 4], 12)
    ids, mask = jnp.asarray(ids) % LLAMA["vocab_size"], jnp.asarray(mask)
    grads = {}
    for precision in ("float32", "mixed"):
        compute, param = precision_dtypes(precision)
        graphdef, params = nnx.split(tiny_llama(dtype=compute, param_dtype=param)[1])
        grads[precision] = jax.jit(jax.grad(token_logprob_loss, argnums=1), static_argnums=0)(
            graphdef, params, ids, mask)
    flat = {k: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)]) for k, g in grads.items()}
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(grads["mixed"]))
    f32, mixed = flat["float32"].astype(np.float64), flat["mixed"].astype(np.float64)
    cosine = f32 @ mixed / (np.linalg.norm(f32) * np.linalg.norm(mixed))
    assert cosine > 0.99, cosine
    assert not np.array_equal(f32, mixed)


@pytest.mark.parametrize("precision", ["mixed", "bfloat16"])
def test_export_check_of_a_16_bit_policy_compares_the_weights(precision, tmp_path):
    """The export check asks whether transformers, loading the saved policy in float32, writes ppojax's greedy
    continuations. A 16-bit policy's own greedy decode may part from float32's at a near tie, which says nothing
    about the export: ppojax's side of the check decodes in float32 (the saved weights, float32 compute), and the
    policy's model is left as it was."""
    pytest.importorskip("torch")
    from ppojax.trainer.export_check import greedy_continuations_agree
    from ppojax.models import save_pretrained

    compute, param = precision_dtypes(precision)
    cfg, model = tiny_llama(dtype=compute, param_dtype=param)
    save_pretrained(model, cfg, tmp_path / "policy")
    graphdef, params = nnx.split(model)
    queries = np.random.default_rng(3).integers(3, LLAMA["vocab_size"], (8, 6)).astype(np.int32)
    queries[:, 0] = 1
    result = greedy_continuations_agree(tmp_path / "policy", graphdef, params, queries, max_new_tokens=12,
                                        pad_token_id=0, stop_token_id=None)
    assert result["agree"], result
    assert nnx.merge(graphdef, params).dtype == compute

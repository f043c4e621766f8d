"""16-bit values stored slot by slot (the KV cache, the layer scan's saved activations) by the CPU's kernels
(`ppojax.backends.cpu.kernels`, `ppojax.backends.cpu.slot_storage`).

XLA:CPU rewrites a bfloat16 dynamic-update-slice as a float32 conversion of the whole array, the update, and a
conversion back. The checks: the compiled 16-bit programs (a `remat: dots` gradient, a generation) hold no such
rewrite, while the same programs without slot storage do (so the check can fail); what is stored is the same
values (gradients and generated tokens bit for bit equal to the plain 16-bit program's); the cached decode equals
the full forward; the sampler reads its 16-bit weights as bits (no float32 copy of a stacked weight)."""

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ppojax.backends.cpu.kernels import CpuKernels
from ppojax.rl.sampler import generate
from ppojax.models import XLA, apply_causal_lm, init_cache, position_ids_from_mask
from ppojax.models.precision import precision_dtypes

from . import test_model_policies
from .test_model_policies import LLAMA, token_logprob_loss
from .test_models import left_padded_batch, max_diff_live

SIXTEEN_BIT = {"bf16", "f16"}


_KERNELS = [CpuKernels()]  # what `tiny_llama` builds with: the CPU's kernels, or (slot_storage_off) without bits


def tiny_llama(**kwargs):
    return test_model_policies.tiny_llama(kernels=_KERNELS[0], **kwargs)


@contextlib.contextmanager
def slot_storage_off(monkeypatch):
    """The plain 16-bit program: models built inside use the CPU's kernels without bits (graphdefs built before
    keep theirs)."""
    _KERNELS[0] = CpuKernels(bits=False)
    try:
        yield
    finally:
        _KERNELS[0] = CpuKernels()


def whole_array_16_bit_rewrites(hlo: str) -> list[str]:
    """The dynamic-update-slices of a compiled program (``compiled.as_text()``) whose updated array is a float32
    conversion of a 16-bit one: XLA's rewrite of a 16-bit slot write."""
    defs = {}
    found = []
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?(%\S+) = (\w+)\[[^\]]*\]\S* (\S+?)\((.*)", line)
        if not m:
            continue
        name, dtype, op, rest = m.groups()
        defs[name] = (dtype, op, rest)
        if op == "dynamic-update-slice":
            target = rest.split(",")[0].strip()
            tdtype, top, trest = defs.get(target, (None, None, ""))
            source = trest.split(")")[0].strip()
            if top == "convert" and defs.get(source, ("",))[0] in SIXTEEN_BIT:
                found.append(line.strip()[:160])
    return found


def mixed_model(remat_policy="dots"):
    compute, param = precision_dtypes("mixed")
    return tiny_llama(dtype=compute, param_dtype=param, remat=remat_policy)


def gradient_program(remat_policy="dots"):
    graphdef, params = nnx.split(mixed_model(remat_policy)[1])
    ids, mask = left_padded_batch([12, 9, 4], 12)
    ids, mask = jnp.asarray(ids) % LLAMA["vocab_size"], jnp.asarray(mask)
    grad = jax.jit(jax.grad(token_logprob_loss, argnums=1), static_argnums=0)
    return grad.lower(graphdef, params, ids, mask).compile(), (params, ids, mask)


def lora_gradient_program():
    """The adapters' gradient of a mixed policy with LoRA on q and down (their thin dots are saved too)."""
    from ppojax.models.lora import LoraSpec, with_lora

    spec = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "down_proj"))
    _, lora_graphdef, adapters, base = with_lora(mixed_model()[1], spec, jax.random.key(3))
    ids, mask = left_padded_batch([12, 9, 4], 12)
    ids, mask = jnp.asarray(ids) % LLAMA["vocab_size"], jnp.asarray(mask)

    def loss(adapters, base, ids, mask):
        return token_logprob_loss(lora_graphdef, nnx.merge_state(base, adapters), ids, mask)

    return jax.jit(jax.grad(loss)).lower(adapters, base, ids, mask).compile(), (adapters, base, ids, mask)


def generation_program():
    graphdef, params = nnx.split(mixed_model()[1])
    prompts = jnp.asarray(left_padded_batch([6, 4, 2], 6)[0]) % LLAMA["vocab_size"]
    run = jax.jit(lambda p, x, k: generate(graphdef, p, x, k, response_length=8, pad_token_id=0))
    return run.lower(params, prompts, jax.random.key(1)).compile(), (params, prompts, jax.random.key(1))


@pytest.mark.parametrize("program", [gradient_program, lora_gradient_program, generation_program],
                         ids=["gradient", "lora_gradient", "generation"])
def test_16_bit_programs_write_slots_in_place(program, monkeypatch):
    compiled, args = program()
    assert whole_array_16_bit_rewrites(compiled.as_text()) == []
    with slot_storage_off(monkeypatch):
        plain, _ = program()
        assert whole_array_16_bit_rewrites(plain.as_text())  # the check sees the rewrite where it is
        plain_out = plain(*args)
    out = compiled(*args)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(plain_out), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype.kind in "iu":  # generated tokens: the cache holds the same 16-bit keys and values
            np.testing.assert_array_equal(a, b)
        else:  # gradients: within bf16 rounding (the plain program may use an unrounded float32 product)
            assert np.abs(a - b).max() <= 2e-2 * np.abs(b).max(), (np.abs(a - b).max(), np.abs(b).max())


@pytest.mark.parametrize("remat_policy", ["dots", "full", "none"])
def test_16_bit_gradient_reaches_every_weight(remat_policy):
    """The saved bits are a bitcast for autodiff's identity: every weight still gets its gradient (a bitcast to an
    integer alone would stop it), the same under every remat policy."""
    compiled, args = gradient_program(remat_policy)
    grads = compiled(*args)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        assert float(np.abs(np.asarray(g)).max()) > 0, jax.tree_util.keystr(path)


def test_16_bit_remat_saves_bits_and_a_float32_stream():
    """`remat: dots` under `mixed` keeps the projections' outputs as uint16 bits and each layer's input as
    float32 (both written in place); nothing stacked per layer is 16-bit float."""
    cfg, model = mixed_model()
    graphdef, params = nnx.split(model)
    b, s = 2, 16
    ids, mask = jnp.ones((b, s), jnp.int32), jnp.ones((b, s), bool)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(lambda p: token_logprob_loss(graphdef, p, ids, mask), params)
    stacked = [m.groups() for m in re.finditer(r"(\w+)\[(\d+),([\d,]*)\] output of scan", out.getvalue())
               if int(m.group(2)) == cfg.num_layers]
    L, D, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    hq, hkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for shape in [f"{b * s},{hq}", f"{b * s},{hkv}", f"{b * s},{F}", f"{b * s},{D}"]:
        assert ("u16", str(L), shape) in stacked, (shape, stacked)
    assert ("f32", str(L), f"{b},{s},{D}") in stacked, stacked
    assert {dtype for dtype, _, _ in stacked} == {"u16", "f32"}, stacked


@pytest.mark.parametrize("precision", ["mixed", "bfloat16"])
def test_16_bit_cache_holds_bits_and_decodes_as_the_full_forward(precision):
    compute, param = precision_dtypes(precision)
    cfg, model = tiny_llama(dtype=compute, param_dtype=param)
    graphdef, params = nnx.split(model)
    prompt_len, steps = 8, 4
    cache = init_cache(cfg, 3, prompt_len + steps, compute, model.kernels)
    assert cache.keys.dtype == cache.values.dtype == jnp.uint16 and cache.dtype == jnp.bfloat16
    assert init_cache(cfg, 3, 4, jnp.float32, model.kernels).keys.dtype == jnp.float32  # float32 as itself
    assert init_cache(cfg, 3, 4, compute, XLA).keys.dtype == compute  # XLA's kernels store no bits
    ids_p, mask_p = left_padded_batch([8, 5, 2], prompt_len, seed=1)
    ids_p = ids_p % LLAMA["vocab_size"]
    cont = np.random.default_rng(2).integers(3, LLAMA["vocab_size"], size=(3, steps)).astype(np.int32)
    full_ids = np.concatenate([ids_p, cont], 1)
    full_mask = np.concatenate([mask_p, np.ones_like(cont, bool)], 1)
    full = np.asarray(jax.jit(lambda p: apply_causal_lm(graphdef, p, full_ids, full_mask)[0])(params))
    pos = np.asarray(position_ids_from_mask(jnp.asarray(full_mask)))
    step = jax.jit(lambda p, i, m, ps, c: apply_causal_lm(graphdef, p, i, m, ps, c)[::2])
    logits, cache = step(params, ids_p, mask_p, pos[:, :prompt_len], cache)
    got = [np.asarray(logits)]
    for t in range(prompt_len, prompt_len + steps):
        logits, cache = step(params, full_ids[:, t:t + 1], full_mask[:, t:t + 1], pos[:, t:t + 1], cache)
        got.append(np.asarray(logits))
    assert cache.keys.dtype == jnp.uint16 and int(cache.index) == prompt_len + steps
    # the same bf16 keys and values either way; only the summation order of the shorter attention rows differs
    assert max_diff_live(np.concatenate(got, 1), full, full_mask) < 0.02 * np.abs(full[full_mask]).max()


def float32_stacked_weights(hlo: str, shapes: set) -> list[str]:
    """The instructions of a compiled program that make a float32 array of a stacked weight's shape."""
    found = []
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%\S+ = f32\[([\d,]*)\]", line)
        if m and tuple(int(d) for d in m.group(1).split(",") if d) in shapes and "parameter(" not in line:
            found.append(line.strip()[:160])
    return found


@pytest.mark.parametrize("precision", ["mixed", "bfloat16"])
def test_the_sampler_reads_its_16_bit_weights_as_bits(precision, monkeypatch):
    """The rollout casts the policy's weights once to the compute dtype (`rollout._in_compute_dtype`) and the
    decode loop reads every layer's slice once per token: XLA:CPU would read a 16-bit stack through a float32
    copy of the whole stack (twice the bytes per token). The compiled sampler holds no such copy; the program
    without slot storage does; both sample the same tokens."""
    from ppojax.rl.rollout import _in_compute_dtype

    compute, param = precision_dtypes(precision)
    cfg, model = tiny_llama(dtype=compute, param_dtype=param)
    graphdef, params = nnx.split(model)
    weights = jax.jit(lambda p: _in_compute_dtype(graphdef, p))(params)
    # the stacked projection weights [L, ...] (the norms' [L, D] would share a shape with activations)
    stacked = {tuple(a.shape) for a in jax.tree.leaves(nnx.state(model.backbone.layers)) if a.ndim >= 3}
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(weights) if a.ndim > 1)
    prompts = jnp.asarray(left_padded_batch([6, 4, 2], 6)[0]) % LLAMA["vocab_size"]

    def program():
        variant_graphdef = nnx.graphdef(tiny_llama(dtype=compute, param_dtype=param)[1])  # this variant's graphdef
        run = jax.jit(lambda w, x, k: generate(variant_graphdef, w, x, k, response_length=8, pad_token_id=0))
        return run.lower(weights, prompts, jax.random.key(1)).compile()

    compiled = program()
    assert float32_stacked_weights(compiled.as_text(), stacked) == []
    with slot_storage_off(monkeypatch):
        plain = program()
        assert float32_stacked_weights(plain.as_text(), stacked)  # the check sees the copies where they are
        plain_tokens = plain(weights, prompts, jax.random.key(1))[0]
    np.testing.assert_array_equal(compiled(weights, prompts, jax.random.key(1))[0], plain_tokens)


def test_a_cached_forward_refuses_to_differentiate_16_bit_weights():
    """The bits carry no gradient: differentiating the weights through a cached (generation) forward is an error
    that says so, never a silent zero; a forward without a cache differentiates as always."""
    compute, param = precision_dtypes("bfloat16")
    cfg, model = tiny_llama(dtype=compute, param_dtype=param)
    graphdef, params = nnx.split(model)
    ids, mask = jnp.ones((2, 4), jnp.int32), jnp.ones((2, 4), bool)
    pos = position_ids_from_mask(mask)
    cache = init_cache(cfg, 2, 4, compute, model.kernels)

    def cached(p):
        return jnp.sum(apply_causal_lm(graphdef, p, ids, mask, pos, cache)[0].astype(jnp.float32))

    assert np.isfinite(float(jax.jit(cached)(params)))  # the forward itself runs
    with pytest.raises(TypeError, match="forward with a KV cache.*differentiate a forward without a cache"):
        jax.grad(cached)(params)
    grads = jax.grad(lambda p: jnp.sum(apply_causal_lm(graphdef, p, ids, mask)[0].astype(jnp.float32)))(params)
    assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in jax.tree.leaves(grads))

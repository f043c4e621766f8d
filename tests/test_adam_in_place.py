"""AdamW's step in one pass (ppojax/backends/cpu/adam_in_place.py, ppojax/backends/cpu/ffi/adam_in_place.cc) against a
float32 loop of optax's arithmetic (equal bit for bit), against optax itself (a few units in the last place: XLA fuses
multiply-adds), in place in a compiled step, and where it does not apply."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ppojax import backends
from ppojax.backends.cpu import adam_in_place
from ppojax.rl.optimizer import AdamW as OptaxAdamW, apply


@pytest.fixture(autouse=True, scope="module")
def _step_built():
    """Skips the file where the step cannot be built. Asked when its first test starts, not while the suite
    collects: every xdist worker collects every file, and the build takes seconds."""
    if why := adam_in_place.unavailable_reason():
        pytest.skip(f"in-place Adam unavailable: {why}")


def AdamW(**settings):  # noqa: N802 - the optimizer with the CPU's step, as optimizer_step_for chooses it here
    return OptaxAdamW(**settings, step=adam_in_place.InPlaceAdamStep())


def in_place(optimizer, params, state) -> bool:
    """Whether `apply` runs the CPU's step for these (the step's own trace-time test)."""
    step = getattr(optimizer, "step", None)  # an optax transformation of the user's has none: optax's step
    return step is not None and step.applies(optimizer, params, state)


SETTINGS = {"plain": {}, "clipped, decayed": {"max_grad_norm": 0.5, "weight_decay": 0.01},
            "clip not reached": {"max_grad_norm": 1e6}, "other betas": {"b1": 0.8, "b2": 0.95, "eps": 1e-6}}


def _params(rng):
    """Leaves of several shapes and sizes (one of more than a stretch of 65,536 elements, one of none)."""
    def draw(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)
    return {"policy": {"embed": draw(300, 257), "layers": {"w": draw(3, 17, 9), "norm": draw(3, 17)}, "none": draw(0)},
            "value": {"head": draw(17, 1), "bias": draw(1)}}


def _gradients(rng, params, scale=1.0):
    return jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape) * scale, jnp.float32), params)


def _reference_step(optimizer, grads, state, params, lr):
    """optax's AdamW arithmetic as a numpy loop, each operation rounded to float32; the step's scalars (the bias
    corrections, the global norm) by optax's own expressions."""
    f32 = np.float32
    index = adam_in_place.adam_state_index(state)
    adam = state[index]
    count = optax.safe_increment(adam.count)
    # compiled, as in a step (XLA's pow rounds b ** count differently compiled and op by op)
    bc1, bc2 = (np.asarray(jax.jit(lambda c, b=b: (1 - b ** c).astype(jnp.float32))(count))
                for b in (optimizer.b1, optimizer.b2))
    norm = np.asarray(jax.jit(optax.tree.norm)(grads))
    clip = bool(optimizer.max_grad_norm) and not norm < optimizer.max_grad_norm

    def one(p, g, m, v):
        p, g, m, v = (np.asarray(x) for x in (p, g, m, v))
        if clip:
            g = (g / norm) * f32(optimizer.max_grad_norm)
        m = f32(1 - optimizer.b1) * g + f32(optimizer.b1) * m
        v = f32(1 - optimizer.b2) * (g * g) + f32(optimizer.b2) * v
        u = (m / bc1) / (np.sqrt(v / bc2 + f32(0)) + f32(optimizer.eps))
        if optimizer.weight_decay:
            u = u + f32(optimizer.weight_decay) * p
        return p - f32(lr) * u, m, v
    triples = jax.tree.map(one, params, grads, adam.mu, adam.nu)
    pick = lambda k: jax.tree.map(lambda t: t[k], triples, is_leaf=lambda t: isinstance(t, tuple))  # noqa: E731
    new_adam = adam._replace(count=count, mu=pick(1), nu=pick(2))
    return pick(0), tuple(new_adam if i == index else s for i, s in enumerate(state))


def _assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name", SETTINGS)
def test_the_step_equals_a_float32_loop_of_optaxs_arithmetic(name):
    rng = np.random.default_rng(0)
    optimizer = AdamW(**SETTINGS[name])
    params = _params(rng)
    state = optimizer.init(params)
    assert in_place(optimizer, params, state)
    step = jax.jit(lambda p, s, g, lr: apply(optimizer, g, s, p, lr))
    expected = (params, state)
    for _ in range(4):
        grads = _gradients(rng, params)
        params, state = step(params, state, grads, jnp.float32(1e-2))
        expected = _reference_step(optimizer, grads, expected[1], expected[0], 1e-2)
        _assert_same((params, state), expected)


@pytest.mark.parametrize("name", SETTINGS)
def test_the_step_agrees_with_optaxs_to_a_few_units_in_the_last_place(name):
    rng = np.random.default_rng(1)
    ours, theirs = AdamW(**SETTINGS[name]), OptaxAdamW(**SETTINGS[name])
    params = _params(rng)
    a = b = (params, ours.init(params))
    assert not in_place(theirs, *b)
    step_a = jax.jit(lambda p, s, g: apply(ours, g, s, p, jnp.float32(1e-2)))
    step_b = jax.jit(lambda p, s, g: apply(theirs, g, s, p, jnp.float32(1e-2)))
    for _ in range(6):
        grads = _gradients(rng, params)
        a, b = step_a(*a, grads), step_b(*b, grads)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype == np.int32:  # Adam's step count
            assert x == y == 6
            continue
        bound = 16 * np.spacing(np.maximum(np.abs(x), np.abs(y))) + 1e-6 * np.abs(y).max(initial=0)
        assert np.all(np.abs(x - y) <= bound), np.abs(x - y).max()


def test_the_critic_warmup_keeps_the_policys_leaves_and_moments():
    """While frozen the policy's parameters and moments stay bit for bit, the critic's take the step, Adam's count
    advances; unfrozen, every leaf takes it (as optax's path with the same `kept`)."""
    rng = np.random.default_rng(2)
    optimizer = AdamW(max_grad_norm=0.5)
    params = _params(rng)
    state = optimizer.init(params)
    params, state = apply(optimizer, _gradients(rng, params), state, params, 1e-2)  # non-zero moments
    grads = _gradients(rng, params)
    kept = lambda path: path[0].key == "policy" or (len(path) > 2 and path[2].key == "policy")  # noqa: E731
    step = jax.jit(lambda frozen: apply(optimizer, grads, state, params, 1e-2, kept=kept, frozen=frozen))
    whole = jax.jit(lambda: apply(optimizer, grads, state, params, 1e-2))()
    frozen_params, frozen_state = step(jnp.bool_(True))
    adam, frozen_adam, whole_adam = (s[1] for s in (state, frozen_state, whole[1]))
    _assert_same((frozen_params["policy"], frozen_adam.mu["policy"], frozen_adam.nu["policy"]),
                 (params["policy"], adam.mu["policy"], adam.nu["policy"]))
    _assert_same((frozen_params["value"], frozen_adam.mu["value"], frozen_adam.nu["value"]),
                 (whole[0]["value"], whole_adam.mu["value"], whole_adam.nu["value"]))
    assert frozen_adam.count == whole_adam.count == 2
    _assert_same(step(jnp.bool_(False)), whole)


@pytest.mark.parametrize("with_step", ["in place", "optax"])
def test_a_critic_learning_rate_steps_the_critics_leaves_by_it(with_step):
    """With critic_lr, the critic's leaves take the step at critic_lr and the rest at lr: each group equals a whole
    step at its own rate (one Adam update, the moments alike), on both step implementations."""
    rng = np.random.default_rng(3)
    optimizer = AdamW(max_grad_norm=0.5) if with_step == "in place" else OptaxAdamW(max_grad_norm=0.5)
    params = _params(rng)
    state = optimizer.init(params)
    params, state = apply(optimizer, _gradients(rng, params), state, params, 1e-2)  # non-zero moments
    grads = _gradients(rng, params)
    critic_leaf = lambda path: path[0].key == "value"  # noqa: E731
    mixed = jax.jit(lambda: apply(optimizer, grads, state, params, 1e-2, critic_lr=3e-4, critic_leaf=critic_leaf))()
    at_lr, at_critic_lr = (jax.jit(lambda lr=lr: apply(optimizer, grads, state, params, lr))() for lr in (1e-2, 3e-4))
    _assert_same(mixed[0]["policy"], at_lr[0]["policy"])
    _assert_same(mixed[0]["value"], at_critic_lr[0]["value"])
    assert not np.allclose(at_lr[0]["value"]["head"], at_critic_lr[0]["value"]["head"])  # the rates differ there
    _assert_same(mixed[1], at_lr[1])  # the moments do not depend on the rate
    with pytest.raises(ValueError, match="critic_lr and critic_leaf come together"):
        apply(optimizer, grads, state, params, 1e-2, critic_lr=3e-4)


def _scanned_step(optimizer, grads):
    """Three optimizer steps in a scan, each behind a `lax.cond` (as `ppojax.rl.update.learn` runs them), donated."""
    def run(params, state):
        def body(carry, i):
            p, s = carry
            return jax.lax.cond(i >= 0, lambda p, s: apply(optimizer, grads, s, p, 1e-2), lambda p, s: (p, s),
                                p, s), None
        return jax.lax.scan(body, (params, state), jnp.arange(3))[0]
    return jax.jit(run, donate_argnums=(0, 1))


def test_the_step_writes_the_parameters_and_moments_where_they_lie():
    """One custom call per step and no copy of a parameter-sized buffer in the compiled loop; optax's path has no
    custom call. The results equal three steps compiled one by one."""
    rng = np.random.default_rng(3)
    optimizer = AdamW(weight_decay=0.1)
    params = _params(rng)
    grads = _gradients(rng, params)
    hlo = _scanned_step(optimizer, grads).lower(params, optimizer.init(params)).compile().as_text()
    assert len(re.findall(rf'custom_call_target="{adam_in_place.TARGET}"', hlo)) == 1
    assert not re.findall(r"f32\[300,257\]\{[^}]*\} copy\(", hlo)
    optax_hlo = _scanned_step(OptaxAdamW(weight_decay=0.1), grads).lower(
        params, optimizer.init(params)).compile().as_text()
    assert adam_in_place.TARGET not in optax_hlo
    expected, one = (params, optimizer.init(params)), jax.jit(lambda p, s: apply(optimizer, grads, s, p, 1e-2))
    for _ in range(3):
        expected = one(*expected)
    _assert_same(_scanned_step(optimizer, grads)(jax.tree.map(jnp.copy, params), optimizer.init(params)), expected)


def test_vmapped_steps_equal_each_step_alone():
    """Seeds vmapped over (examples/vmap_seeds.py): the handler runs once per batch element, each with its own norm
    and clipping."""
    rng = np.random.default_rng(4)
    optimizer = AdamW(max_grad_norm=3.0)
    batch = [_params(rng) for _ in range(3)]
    grads = [_gradients(rng, p, scale) for p, scale in zip(batch, (0.01, 1.0, 0.1))]
    stacked = lambda trees: jax.tree.map(lambda *x: jnp.stack(x), *trees)  # noqa: E731
    vmapped = jax.vmap(lambda p, g: apply(optimizer, g, optimizer.init(p), p, 1e-2))(stacked(batch), stacked(grads))
    _assert_same(vmapped, stacked([apply(optimizer, g, optimizer.init(p), p, 1e-2) for p, g in zip(batch, grads)]))


def test_where_it_does_not_apply_optax_steps(monkeypatch):
    """16-bit parameters, an optax transformation of the user's, 'optax' and a mesh of devices take optax's step."""
    one_cpu = jax.devices()[:1]
    assert backends.optimizer_step_for("auto", one_cpu) == adam_in_place.InPlaceAdamStep()
    assert backends.optimizer_step_for("optax", one_cpu) is None
    assert backends.optimizer_step_for("auto", one_cpu * 2) is None  # a mesh: XLA cannot partition the call
    rng = np.random.default_rng(5)
    params = _params(rng)
    optimizer = AdamW()
    state = optimizer.init(params)
    assert in_place(optimizer, params, state)
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    assert not in_place(optimizer, half, optimizer.init(half))
    assert not in_place(optax.adamw(1.0), params, optax.adamw(1.0).init(params))
    assert not in_place(OptaxAdamW(), params, state)
    new_half, _ = apply(optimizer, _gradients(rng, params), optimizer.init(half), half, 1e-2)
    assert jax.tree.leaves(new_half)[0].dtype == jnp.bfloat16


def test_without_a_compiler_the_step_is_optaxs(monkeypatch, tmp_path):
    """No g++ and nothing built before: the handler is unavailable, says why, and the step falls back to optax's."""
    monkeypatch.setenv("PATH", str(tmp_path / "no-compiler-here"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for cached in (adam_in_place._built, adam_in_place._registered):
        monkeypatch.setattr(adam_in_place, cached.__name__, cached.__wrapped__)  # not the process's answers
    assert adam_in_place.unavailable_reason() == "no C++ compiler (g++) on PATH to build ppojax's in-place Adam step"
    assert backends.optimizer_step_for("auto", jax.devices()[:1]) is None
    monkeypatch.undo()
    assert backends.optimizer_step_for("auto", jax.devices()[:1]) == adam_in_place.InPlaceAdamStep()


def test_a_step_that_is_not_one_is_refused():
    with pytest.raises(TypeError, match="step='fused' is not an optimizer step"):
        OptaxAdamW(step="fused")

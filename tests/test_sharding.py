"""Sharding over device meshes (ppojax.parallel: meshes, rules, placement, distributed start-up).

The main test process has ONE device, so this file runs twice:
- in the main process: rule/spec/mesh-size checks that need no devices, and
  ``test_multi_device_suite``, which re-runs this file in a subprocess with 8 virtual CPU devices
  (``XLA_FLAGS=--xla_force_host_platform_device_count=8``, ``PPOJAX_SHARDING_CHILD=1``);
- in that subprocess: the tests below ``if CHILD:`` (one rollout + update per mesh against one device,
  FSDP memory per device, global whitening, the KV-cache constraint).
"""
import dataclasses
import functools
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

from ppojax import parallel as sh
from ppojax.parallel import distributed
from ppojax.rl.settings import Hyperparams
from ppojax.rl import placement
from tests.tiny_setup import run_environment
from tests.xla_test_flags import CHEAP_COMPILES

CHILD = os.environ.get("PPOJAX_SHARDING_CHILD") == "1"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def abstract_mesh(data, fsdp, tensor):
    return AbstractMesh((data, fsdp, tensor), sh.MESH_AXES, axis_types=(AxisType.Auto,) * 3)


# ------------------------------------------------------------------------------------------------------
# No devices needed
# ------------------------------------------------------------------------------------------------------
def test_mesh_shape_resolves_minus_one_and_rejects_bad_products():
    assert sh.mesh_shape(-1, 1, 1, num_devices=8) == (8, 1, 1)
    assert sh.mesh_shape(2, -1, 2, num_devices=8) == (2, 2, 2)
    assert sh.mesh_shape(1, 1, 8, num_devices=8) == (1, 1, 8)
    with pytest.raises(ValueError, match=r"has 4 devices but 8 are in use.*data \* fsdp \* tensor == 8"):
        sh.mesh_shape(2, 2, 1, num_devices=8)
    with pytest.raises(ValueError, match="do not split"):
        sh.mesh_shape(-1, 3, 1, num_devices=8)
    with pytest.raises(ValueError, match="at most one -1"):
        sh.mesh_shape(-1, -1, 1, num_devices=8)
    with pytest.raises(ValueError, match=f"has 16 devices but {jax.device_count()} are in use"):
        sh.make_mesh(data=16)


def test_rules_map_logical_axes_with_divisibility_fallback():
    mesh = abstract_mesh(2, 2, 2)
    spec = lambda shape, names, rules=sh.TRAIN_RULES: sh.logical_to_spec(shape, names, mesh, rules)  # noqa
    # q kernel [L, D, H, hd]: embed -> fsdp, heads -> tensor
    assert spec((2, 32, 4, 8), ("layers", "embed", "heads", "head_dim")) == P(None, "fsdp", "tensor")
    assert spec((128, 32), ("vocab", "embed")) == P("tensor", "fsdp")
    assert spec((2, 32), ("layers", "norm")) == P()
    # 3 heads do not split over tensor=2: that dimension is replicated, the rest still sharded
    assert spec((2, 32, 3, 8), ("layers", "embed", "heads", "head_dim")) == P(None, "fsdp")
    # generation gathers over fsdp, keeps tensor
    assert spec((2, 32, 4, 8), ("layers", "embed", "heads", "head_dim"), sh.GENERATE_RULES) == P(
        None, None, "tensor")
    # batch over (data, fsdp); 6 rows only split over data
    assert spec((16, 5), ("batch", None)) == P(("data", "fsdp"))
    assert spec((6, 5), ("batch", None)) == P("data")
    # a mesh axis is used once per array
    assert sh.logical_to_spec((8, 8), ("mlp", "heads"), mesh, sh.TRAIN_RULES) == P("tensor")
    # size-1 mesh axes are omitted
    assert sh.logical_to_spec((128, 32), ("vocab", "embed"), abstract_mesh(8, 1, 1), sh.TRAIN_RULES) == P()
    with pytest.raises(ValueError, match="one name"):
        spec((2, 3), ("embed",))


def test_unnamed_parameters_shard_their_largest_divisible_dim_over_fsdp():
    mesh = abstract_mesh(1, 4, 2)
    assert sh.logical_to_spec((8, 16), (), mesh) == P(None, "fsdp")
    assert sh.logical_to_spec((16, 6), None, mesh) == P("fsdp")
    assert sh.logical_to_spec((6, 3), (), mesh) == P()         # nothing divides: replicated
    assert sh.logical_to_spec((), (), mesh) == P()             # scalars
    assert sh.logical_to_spec((8, 16), (), mesh, sh.GENERATE_RULES) == P()


def test_param_logical_axes_reads_model_annotations_and_marks_plain_arrays_unnamed():
    from ppojax.models import CausalLM, ModelConfig, logical_axes
    from tests.toy_models import ToyLM

    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=16, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8, intermediate_size=32)
    abstract = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))
    _, params = nnx.split(abstract)
    names = sh.param_logical_axes({"policy": params, "plain": {"b": jnp.zeros(()), "w": jnp.zeros((16, 2))}})
    leaves = lambda tree: jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, tuple))  # noqa: E731
    # the same names ppojax.models reports
    assert leaves(names["policy"]) == leaves(logical_axes(params))
    assert ("layers", "embed", "heads", "head_dim") in leaves(names["policy"])
    assert leaves(names["plain"]) == [(), ()]  # plain arrays: unnamed
    # the models' own logical_axes tree gives the same shardings, with the structure of the params
    mesh = abstract_mesh(2, 2, 2)
    from_models = sh.logical_to_sharding(logical_axes(params), mesh, shapes=params)
    assert jax.tree.structure(from_models) == jax.tree.structure(params)
    assert from_models == sh.param_shardings(params, mesh)
    q = from_models["backbone"]["layers"]["attn"]["q"]["kernel"]
    assert q.spec == P(None, "fsdp", "tensor")
    _, toy = nnx.split(nnx.eval_shape(lambda: ToyLM(16, 8, rngs=nnx.Rngs(0))))
    assert all(n == () for n in leaves(sh.param_logical_axes(toy)))


def test_initialize_distributed_is_a_noop_for_a_single_process(monkeypatch):
    for var in ("PPOJAX_COORDINATOR", "PPOJAX_NUM_PROCESSES", "PPOJAX_PROCESS_ID", "PPOJAX_DISTRIBUTED",
                "JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri", "TPU_WORKER_HOSTNAMES",
                "TPU_PROCESS_ADDRESSES", "MEGASCALE_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(distributed, "_cluster_env", lambda: None)  # e.g. when the tests run on a TPU VM
    assert sh.initialize_distributed() is False
    assert sh.initialize_distributed(num_processes=1) is False
    monkeypatch.setenv("PPOJAX_NUM_PROCESSES", "2")
    with pytest.raises(ValueError, match="missing coordinator_address"):
        sh.initialize_distributed()
    monkeypatch.setenv("PPOJAX_PROCESS_ID", "two")
    with pytest.raises(ValueError, match="PPOJAX_PROCESS_ID"):
        sh.initialize_distributed()
    assert sh.is_main_process()


def test_a_donated_init_holds_the_given_buffers_and_copies_a_shared_one():
    """init_sharded_train_state(donate=True): the state's params and frozen models ARE the given buffers (no
    second copy while building), the given arrays are deleted, and a buffer given twice (one module in two
    roles) becomes two (a buffer is donated once); without donate the state holds copies."""
    from ppojax.rl.optimizer import make_optimizer

    mesh = sh.make_mesh(devices=jax.devices()[:1])
    pointer = lambda x: x.unsafe_buffer_pointer()  # noqa: E731

    def trees():
        w = jnp.arange(12.0).reshape(3, 4)
        return {"policy": {"w": w}, "value": {"w": w + 1}}, {"ref": {"w": w}, "reward": None}

    params, frozen = trees()
    given = pointer(params["policy"]["w"]), pointer(params["value"]["w"])
    state, _ = placement.init_sharded_train_state(params, make_optimizer(), mesh, hyperparams=Hyperparams.create(),
                                                  frozen=frozen, donate=True)
    held = [pointer(state.params["policy"]["w"]), pointer(state.params["value"]["w"]),
            pointer(state.frozen["ref"]["w"])]
    assert held[:2] == list(given) and held[2] not in given
    assert params["policy"]["w"].is_deleted() and params["value"]["w"].is_deleted()
    np.testing.assert_array_equal(state.frozen["ref"]["w"], np.arange(12.0).reshape(3, 4))
    np.testing.assert_array_equal(state.params["policy"]["w"], state.frozen["ref"]["w"])

    params, frozen = trees()
    state, _ = placement.init_sharded_train_state(params, make_optimizer(), mesh, hyperparams=Hyperparams.create(),
                                                  frozen=frozen)
    assert not params["policy"]["w"].is_deleted()
    assert pointer(state.params["policy"]["w"]) != pointer(params["policy"]["w"])

if not CHILD:
    def test_multi_device_suite():
        """Runs the tests of this file that need 8 devices in a subprocess that has them."""
        flags = os.environ.get("XLA_FLAGS", "")
        env = dict(run_environment(), PPOJAX_SHARDING_CHILD="1",
                   XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=8 {CHEAP_COMPILES}")
        start = time.time()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                               "-o", "addopts=-ra", os.path.abspath(__file__)],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        print(proc.stdout[-4000:])
        assert proc.returncode == 0, (f"8-device sharding tests failed after {time.time() - start:.0f}s:\n"
                                      f"{proc.stdout[-8000:]}\n{proc.stderr[-3000:]}")

# ------------------------------------------------------------------------------------------------------
# 8 virtual devices (subprocess)
# ------------------------------------------------------------------------------------------------------
if CHILD:
    from tests import sharding_helpers as H

    MESHES = [(8, 1, 1), (2, 4, 1), (2, 2, 2), (1, 1, 8)]

    def assert_trees_close(actual, expected, atol=1e-5, rtol=1e-5, what=""):
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=rtol,
                                       err_msg=f"{what}{jax.tree_util.keystr(path)}")

    @pytest.fixture(scope="module")
    def reference():
        """The same rollout + one update on ONE device: mesh (1, 1, 1) over devices[:1]."""
        assert jax.device_count() == 8
        ac, params, frozen, graphdefs = H.build_models()
        one = sh.make_mesh(devices=jax.devices()[:1])
        experience = H.rollout(one, params, frozen, graphdefs, H.prompts(), jax.random.key(0))
        experience = jax.tree.map(np.asarray, experience)
        assert experience.padding_mask.any() and not experience.padding_mask.all()  # stop tokens happened
        state, history = H.run_updates(one, ac, params, experience, num_updates=1)
        return dict(ac=ac, params=params, frozen=frozen, graphdefs=graphdefs, experience=experience,
                    params_after=jax.tree.map(np.asarray, state.params), metrics=history[0])

    @pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
    def test_rollout_and_update_match_one_device(reference, shape):
        mesh = sh.make_mesh(*shape)
        ref = reference
        experience = H.rollout(mesh, ref["params"], ref["frozen"], ref["graphdefs"], H.prompts(),
                               jax.random.key(0))
        rows_per_device = {shard.data.shape[0] for shard in experience.logprobs.addressable_shards}
        assert rows_per_device == {H.B // sh.data_parallel_size(mesh)}  # rows split over (data, fsdp)
        np.testing.assert_array_equal(np.asarray(experience.query_responses),
                                      ref["experience"].query_responses)  # same samples
        assert_trees_close(experience, ref["experience"], what="experience")

        state, history = H.run_updates(mesh, ref["ac"], ref["params"], ref["experience"], num_updates=1)
        embed = state.params["policy"]["backbone"]["embed"]["embedding"]
        assert embed.sharding.mesh.shape == mesh.shape and len(embed.sharding.device_set) == 8
        if shape[1] > 1:  # the state really is split over fsdp (and kept that way by out_shardings)
            assert "fsdp" in str(embed.sharding.spec)
            assert "fsdp" in str(state.opt_state[0].mu["policy"]["backbone"]["embed"]["embedding"].sharding.spec)
        metrics = history[0]
        assert metrics.keys() == ref["metrics"].keys()
        for name, value in metrics.items():
            np.testing.assert_allclose(value, ref["metrics"][name], atol=1e-5, rtol=1e-5, err_msg=name)
        assert_trees_close(state.params, ref["params_after"], what="params")
        moved = max(float(np.abs(a - np.asarray(b)).max())
                    for a, b in zip(jax.tree.leaves(ref["params_after"]), jax.tree.leaves(ref["params"])))
        assert moved > 1e-4  # the update did change the parameters

    def test_fsdp8_holds_an_eighth_of_params_and_optimizer_state_per_device(reference):
        mesh = sh.make_mesh(data=1, fsdp=8)
        from ppojax.rl.optimizer import make_optimizer

        state, _ = placement.init_sharded_train_state(reference["params"], make_optimizer(), mesh,
                                                      hyperparams=Hyperparams.create())
        total_params = sum(x.nbytes for x in jax.tree.leaves(state.params))
        total_opt = sum(x.nbytes for x in jax.tree.leaves(state.opt_state))
        for device in jax.devices():
            held_params = sh.addressable_bytes(state.params, device)
            held_opt = sh.addressable_bytes(state.opt_state, device)
            # norms (1-D, "norm" axis) stay replicated: a few percent above 1/8
            assert total_params / 8 <= held_params <= 1.1 * total_params / 8, (held_params, total_params)
            assert total_opt / 8 <= held_opt <= 1.1 * total_opt / 8, (held_opt, total_opt)

    def test_lora_rollout_and_update_match_one_device():
        """LoRA on a mesh with every axis split (2, 2, 2): the same samples, metrics and adapters as on one
        device; the frozen base weights (the reference too) are split over fsdp like a full model's, each
        adapter is laid out as its kernel, and Adam's moments hold the adapters and the value model only."""
        rolled_one, state_one, metrics_one = H.lora_rollout_and_update(sh.make_mesh(devices=jax.devices()[:1]))
        rolled_one = jax.tree.map(np.asarray, rolled_one)
        assert np.abs(rolled_one.logprobs - rolled_one.ref_logprobs)[~rolled_one.padding_mask].max() > 1e-3
        rolled, state, metrics = H.lora_rollout_and_update(sh.make_mesh(2, 2, 2), experience=rolled_one)
        np.testing.assert_array_equal(np.asarray(rolled.query_responses), rolled_one.query_responses)
        assert_trees_close(rolled, rolled_one, what="experience")
        assert metrics.keys() == metrics_one.keys()
        for name, value in metrics.items():
            np.testing.assert_allclose(value, metrics_one[name], atol=1e-5, rtol=1e-5, err_msg=name)
        assert_trees_close(state.params, jax.tree.map(np.asarray, state_one.params), what="params")

        base_q = state.frozen["base"]["backbone"]["layers"]["attn"]["q"]
        assert "fsdp" in str(base_q["kernel"].sharding.spec) and len(base_q["kernel"].sharding.device_set) == 8
        assert "fsdp" in str(state.frozen["base"]["backbone"]["embed"]["embedding"].sharding.spec)
        adapters = state.params["policy"]["backbone"]["layers"]
        assert adapters["attn"]["q"]["lora_a"].sharding.spec[:2] == base_q["kernel"].sharding.spec[:2]
        mu = state.opt_state[0].mu["policy"]
        mu_paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(mu)]
        assert mu_paths and all("lora_" in p for p in mu_paths), mu_paths
        assert set(adapters) == {"attn", "mlp"} and set(adapters["attn"]) == {"q", "v"}
        moved = np.abs(np.asarray(adapters["mlp"]["down"]["lora_b"]) - 0.01).max()
        assert moved > 1e-4  # the update trained the adapters

    def test_whitening_statistics_are_global():
        """jnp.sum inside jit over a batch-sharded array is the global sum: the whitened advantages on 8
        devices equal the numpy whitening over the WHOLE batch, not per-device whitening."""
        from ppojax import core as ppo

        rng = np.random.default_rng(0)
        rows, length = 16, 6
        rewards = rng.normal(size=(rows, length)).astype(np.float32) + np.arange(rows)[:, None]
        values = rng.normal(size=(rows, length)).astype(np.float32)
        padding = np.arange(length)[None, :] > rng.integers(0, length, size=rows)[:, None]
        mesh = sh.make_mesh(data=8)
        fn = jax.jit(lambda r, v, m: ppo.advantages_and_returns(r, v, m, 1.0, 0.95).advantages)
        sharded = fn(*sh.shard_batch((rewards, values, padding), mesh))
        assert sharded.sharding.spec[0] is not None  # still split by rows
        raw = np.asarray(jax.jit(ppo.gae, static_argnums=(2, 3))(rewards, values, 1.0, 0.95))

        def whiten(x, live):
            mean = x[live].mean()
            var = ((x[live] - mean) ** 2).sum() / (live.sum() - 1)
            return np.where(live, (x - mean) / np.sqrt(var + 1e-8), 0.0)

        np.testing.assert_allclose(np.asarray(sharded), whiten(raw, ~padding), atol=1e-5)
        per_device = np.concatenate([whiten(raw[i:i + 2], ~padding[i:i + 2]) for i in range(0, rows, 2)])
        assert np.abs(per_device - whiten(raw, ~padding)).max() > 0.5  # so the check above means something

    def test_shard_batch_rejects_rows_that_do_not_split():
        mesh = sh.make_mesh(data=2, fsdp=4)
        with pytest.raises(ValueError, match="12 rows, which do not split over 8 data-parallel devices"):
            sh.shard_batch({"x": np.zeros((12, 3))}, mesh)

    def test_kv_cache_is_constrained_batch_and_kv_heads():
        from ppojax.rl.sampler import generate
        from ppojax.models import init_cache

        mesh = sh.make_mesh(data=2, fsdp=2, tensor=2)
        cache = jax.eval_shape(lambda: init_cache(H.CFG, 8, 12, jnp.float32))
        shardings = sh.kv_cache_shardings(cache, mesh)
        assert shardings.keys.spec == P(None, ("data", "fsdp"), None, "tensor")
        assert shardings.key_mask.spec == P(("data", "fsdp")) and shardings.index.spec == P()
        ac, params, _, _ = H.build_models()
        policy = sh.shard_params(params["policy"], mesh, sh.GENERATE_RULES)
        prompts = sh.shard_batch(jnp.asarray(H.prompts()[:8]), mesh)
        lowered = jax.jit(lambda p, q, k: generate(
            ac.policy_graphdef, p, q, k, response_length=4, pad_token_id=H.PAD,
            init_cache_fn=placement.make_init_cache_fn(mesh))).lower(policy, prompts, jax.random.key(0))
        text = lowered.as_text()
        assert "sharding_constraint" in text and '{"tensor"}' in text, text[:2000]

    @pytest.mark.parametrize("head_dim", [8, 64], ids=["slots-minor", "merged-slots"])
    def test_the_tpu_decode_kernel_runs_per_shard_and_equals_one_device(head_dim):
        """The TPU's Pallas decode attention (interpreted) on a (data 2, fsdp 2, tensor 2) mesh runs per shard (4
        rows and one of the 2 key heads each) and samples the tokens XLA's attention samples on one device, with
        their log-probs within 1e-5; with 2 key heads of 64 (128 lanes) the cache stores them side by side,
        [L, B, T, 128], split over `tensor` as the heads."""
        from ppojax import backends
        from ppojax.backends.tpu.kernels import TpuKernels
        from ppojax.models import CausalLM, init_cache
        from ppojax.rl.sampler import generate

        mesh = sh.make_mesh(data=2, fsdp=2, tensor=2)
        cfg = dataclasses.replace(H.CFG, head_dim=head_dim)
        graphdef, policy_params = nnx.split(CausalLM(cfg, rngs=nnx.Rngs(0)))
        params = {"policy": policy_params}
        kernels = TpuKernels(mesh=mesh, interpret=True)
        model = nnx.merge(graphdef, params["policy"])
        backends.use_kernels(kernels, model)
        tpu_graphdef = nnx.split(model)[0]
        queries = jnp.asarray(H.prompts())
        stored = jax.eval_shape(lambda: init_cache(cfg, H.B, 16, jnp.float32, kernels)).keys.shape
        assert stored == ((2, H.B, 16, 2 * head_dim) if head_dim == 64 else (2, H.B, 16, 2, head_dim))
        if head_dim == 64:  # the merged axis splits over `tensor` as the key heads would
            sharding = sh.kv_cache_shardings(jax.eval_shape(lambda: init_cache(cfg, H.B, 16, jnp.float32, kernels)),
                                             mesh).keys
            assert sharding.spec[3] == "tensor", sharding

        def sample(graphdef, policy, queries, init_cache_fn=None):
            return jax.jit(lambda p, q, k: generate(graphdef, p, q, k, response_length=H.R, pad_token_id=H.PAD,
                                                    return_logprobs=True, init_cache_fn=init_cache_fn))(
                policy, queries, jax.random.key(3))

        policy = sh.shard_params(params["policy"], mesh, sh.GENERATE_RULES)
        program = str(jax.make_jaxpr(lambda p, q, k: generate(tpu_graphdef, p, q, k, response_length=H.R,
                                                              pad_token_id=H.PAD))(policy, queries, jax.random.key(3)))
        assert "pallas_call" in program and "shard_map" in program
        got = sample(tpu_graphdef, policy, sh.shard_batch(queries, mesh), placement.make_init_cache_fn(mesh))
        want = sample(graphdef, params["policy"], queries)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), atol=1e-5)

    def test_the_tpu_splash_kernel_runs_per_shard_and_equals_one_device():
        """TPUs' splash attention (interpreted) in a forward and backward on a (data 2, fsdp 2, tensor 2) mesh runs
        per shard (one row and one of the 2 key heads with its 3 query heads each) and gives the hidden states,
        loss and gradients XLA's attention gives on one device (left padding, a hole, a packed row)."""
        from ppojax.backends.tpu.kernels import TpuKernels
        from ppojax.models import XLA, CausalLM, ModelConfig
        from tests.test_splash_attention import CONFIG, assert_equal_forwards, loss_and_grads, model_inputs

        mesh = sh.make_mesh(data=2, fsdp=2, tensor=2)
        cfg = ModelConfig.from_hf(CONFIG)
        inputs = model_inputs(rows=4)
        want = loss_and_grads(*nnx.split(CausalLM(cfg, rngs=nnx.Rngs(0), kernels=XLA)), inputs)[0]
        graphdef, params = nnx.split(CausalLM(cfg, rngs=nnx.Rngs(0), kernels=TpuKernels(mesh=mesh, interpret=True)))
        placed = sh.shard_batch(inputs[:4], mesh) + inputs[4:]
        got, program = loss_and_grads(graphdef, sh.shard_params(params, mesh), placed)
        assert "pallas_call" in program and "shard_map" in program
        assert_equal_forwards(got, want, inputs[-1])

    @pytest.mark.parametrize("mesh_shape, rows, kv_heads, rows_axes, heads_axis", [
        ((1, 2, 4), 4, 4, "fsdp", "tensor"),
        ((1, 2, 4), 4, 2, "fsdp", None),  # 2 key heads do not split 4 ways: no operand splits its heads
        ((2, 2, 2), 6, 4, "data", "tensor"),  # 6 rows split over data only
        ((2, 2, 2), 3, 4, None, "tensor"),
    ])
    def test_attention_operands_are_placed_alike(mesh_shape, rows, kv_heads, rows_axes, heads_axis):
        mesh = sh.make_mesh(*mesh_shape)
        q = jnp.zeros((rows, 6, 8, 16), jnp.bfloat16)
        k = v = jnp.zeros((rows, 10, kv_heads, 16), jnp.bfloat16)
        mask = jnp.ones((rows, 6, 10), bool)
        placed = jax.jit(sh.attention_operand_placement(mesh))(q, k, v, mask)
        for x in placed[:3]:  # cuDNN's partitioner takes q, k and v only sharded alike
            assert x.sharding.is_equivalent_to(NamedSharding(mesh, P(rows_axes, None, heads_axis, None)), 4), \
                x.sharding
        assert placed[3].sharding.is_equivalent_to(NamedSharding(mesh, P(rows_axes)), 3), placed[3].sharding

    # ---- critic-free estimators: group statistics over a sharded batch ----
    from ppojax.rl.actor_critic import ActorCritic
    def _critic_free_updates(mesh, estimator):
        """One update of the critic-free ``estimator`` (groups of 4 consecutive rows, KL in the loss) on the
        synthetic experience: no value model, params {"policy"} only."""
        ac, params, _, (policy_def, _) = H.build_models()
        ac = ActorCritic(policy_def, None, H.PAD, temperature=0.7, has_critic=False)
        settings, hyperparams = H.settings_of(advantage_estimator=estimator, num_generations=4, kl_loss_coef=0.04,
                                              loss_agg_mode="seq-mean-token-mean", cliprange_high=0.28)
        return H.run_updates(mesh, ac, {"policy": params["policy"]}, H.synthetic_experience(), 1, settings,
                             hyperparams)

    @functools.cache
    def _one_device_critic_free_updates(estimator):
        """The reference on ONE device, computed once per estimator (grpo is compared on three meshes)."""
        return _critic_free_updates(sh.make_mesh(devices=jax.devices()[:1]), estimator)

    @pytest.mark.parametrize("estimator, shape", [("grpo", (8, 1, 1)), ("grpo", (2, 4, 1)), ("grpo", (4, 2, 1)),
                                                  ("rloo", (2, 4, 1)), ("reinforce_pp", (2, 4, 1))])
    def test_group_statistics_equal_one_device(estimator, shape):
        """The group mean/std (and REINFORCE++'s global whitening) inside the program see the whole batch on
        every mesh, even where a group's 4 rows straddle data-parallel shards (8 shards of 2 rows)."""
        one_state, one = _one_device_critic_free_updates(estimator)
        state, history = _critic_free_updates(sh.make_mesh(*shape), estimator)
        assert "loss/value_avg" not in history[0] and "loss/kl_avg" in history[0]
        for name, value in history[0].items():
            np.testing.assert_allclose(value, one[0][name], atol=1e-5, rtol=1e-5, err_msg=name)
        assert_trees_close(state.params, one_state.params, what="params")

    # ---- padding-free updates on a mesh ----
    def test_packed_train_step_equals_padded_on_a_2x2_mesh():
        """padding_free on a (data 2, fsdp 2) mesh: each data-parallel shard packs its own rows, and the packed
        train_step's metrics and parameters equal the padded one's on the same mesh (which the one-device
        programs above equal), the parameters sharded as the rules say."""
        from ppojax.rl.program import make_train_step
        from tests.test_packing import assert_steps_equal, train_step_program
        from tests.test_train_step import init_state, prompt_blocks

        mesh = sh.make_mesh(2, 2, 1, devices=jax.devices()[:4])
        results = []
        for padding_free in (False, True):
            program = train_step_program(padding_free, mesh)
            plain = init_state(program, 0)
            state, shardings = placement.init_sharded_train_state(
                plain.params, program.optimizer, mesh, hyperparams=plain.hyperparams, frozen=plain.frozen,
                kl_coef=0.05)
            results.append(make_train_step(program, shardings)(state, prompt_blocks(1)[0], jax.random.key(11)))
        assert float(results[0][1]["perf/padding_fraction"]) > 0.2  # the sampled lengths vary: padding to skip
        assert_steps_equal(*results)
        embed = results[1][0].params["policy"]["backbone"]["embed"]["embedding"]
        assert embed.sharding.mesh.shape == mesh.shape and len(embed.sharding.device_set) == 4

    # ---- multi-turn episodes on a mesh ----
    @pytest.mark.parametrize("slots", [0, 8], ids=["row-per-episode", "8-rows"])
    def test_episodes_on_a_mesh_call_the_host_per_device_and_equal_one_device(slots):
        """generate_episodes with the prompts split over 8 data-parallel devices: the host callback runs once per
        device with that device's rows (shard_map), and the episodes equal those of one device with the host
        traced; with 8 cache rows for the 16 episodes the refills cross the shards."""
        from ppojax.rl.episodes import EpisodeShape, HostAnswer, generate_episodes, host_callback
        from tests.tiny_setup import tiny_policy

        B, pad, stop = 16, 0, 5
        shape = EpisodeShape(turn_length=5, observation_length=3, max_turns=3, episode_length=20)
        prompts = np.random.default_rng(2).integers(2, 16, size=(B, 4)).astype(np.int32)
        calls = []

        def numpy_host(turn, episode, tokens, ended, running, stream_length):
            calls.append(len(episode))
            turn, episode = np.asarray(turn), np.asarray(episode)
            obs = np.full((len(episode), 3), pad, np.int32)
            obs[:, 1:] = (episode[:, None] + turn[:, None] + np.arange(2)) % 14 + 2
            return (obs, np.full(len(episode), 2, np.int32), np.asarray(running) & (episode % 3 != 0),
                    np.where(running, turn.astype(np.float32), np.nan).astype(np.float32))

        def traced_host(turn, episode, tokens, ended, running, stream_length):
            obs = jnp.concatenate([jnp.full((episode.shape[0], 1), pad, jnp.int32),
                                   (episode[:, None] + turn[:, None] + jnp.arange(2)) % 14 + 2], axis=1)
            return HostAnswer(obs, jnp.full(episode.shape, 2, jnp.int32), running & (episode % 3 != 0),
                              jnp.where(running, turn.astype(jnp.float32), jnp.nan))

        graphdef, params = nnx.split(tiny_policy(0))

        def play(host, placed_prompts):
            return jax.jit(lambda p, x, k: generate_episodes(graphdef, p, x, k, shape=shape, host_turn=host,
                                                             pad_token_id=pad, stop_token_id=stop, top_k=3,
                                                             slots=slots))(params, placed_prompts, jax.random.key(1))

        mesh = sh.make_mesh(8, 1, 1)
        on_mesh = play(host_callback(numpy_host, shape, mesh), jax.device_put(prompts, NamedSharding(mesh, P("data"))))
        one = play(traced_host, jnp.asarray(prompts))
        assert set(calls) == {(slots or B) // 8}  # each device's own rows
        assert int(jnp.max(one.turns)) > 1
        for a, b in zip(on_mesh, one):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=0)

    # ---- dynamic sampling on a mesh ----
    def test_dynamic_sampling_step_equals_one_device_on_a_2x2_mesh():
        """filter_groups on a (data 2, fsdp 2) mesh: the rounds' prompts split over the batch axes, the selected
        groups moved into the batch's rows across shards; the step's metrics and parameters equal one device's."""
        from ppojax.rl.program import make_train_step
        from tests.test_dynamic_sampling import critic_free_state, program_with_dynamic_sampling, round_prompts

        results = []
        for mesh, data_parallel in ((sh.make_mesh(devices=jax.devices()[:1]), 1),
                                    (sh.make_mesh(2, 2, 1, devices=jax.devices()[:4]), 4)):
            program = program_with_dynamic_sampling(mesh, data_parallel)
            plain = critic_free_state(program, learning_rate=1e-3)  # as the tests above: Adam's first steps
            # at 1e-2 magnify float32 rounding of near-zero gradients past the tolerance
            state, shardings = placement.init_sharded_train_state(
                plain.params, program.optimizer, mesh, hyperparams=plain.hyperparams, frozen=plain.frozen,
                kl_coef=0.05)
            state, metrics = make_train_step(program, shardings)(state, round_prompts()[2], jax.random.key(3))
            results.append((state, {k: float(v) for k, v in sh.to_host(metrics).items()}))
        (one_state, one), (state, metrics) = results
        assert one["dynamic_sampling/rounds"] == 3 and one["dynamic_sampling/groups_dropped"] == 7
        for name, value in one.items():
            np.testing.assert_allclose(metrics[name], value, atol=1e-5, rtol=1e-5, err_msg=name)
        assert_trees_close(state.params, one_state.params, what="params")

    # ---- in-flight weight updates on a mesh ----
    def in_flight_run(mesh, **config):
        """The fill and 2 updates of tests.test_in_flight_updates' program (k = 1, learning rate 1e-3: Adam at 1e-2
        magnifies float32 rounding) on ``mesh`` -> (final state, each update's metrics on the host)."""
        import dataclasses

        from ppojax.rl.in_flight_updates import in_flight_shapes
        from ppojax.rl.program import make_fill, make_train_step
        from tests.test_in_flight_updates import in_flight_program
        from tests.test_pipeline import fill_keys
        from tests.test_train_step import init_state, prompt_blocks

        prompts = prompt_blocks(3)
        program = in_flight_program(1, learning_rate=1e-3, **config)
        batch = dataclasses.replace(program.settings.batch, data_parallel_size=sh.data_parallel_size(mesh))
        program = dataclasses.replace(program, mesh=mesh, settings=dataclasses.replace(program.settings, batch=batch))
        plain = init_state(program, 0)
        state, shardings = placement.init_sharded_train_state(
            plain.params, program.optimizer, mesh, hyperparams=plain.hyperparams, frozen=plain.frozen,
            kl_coef=0.05, in_flight=in_flight_shapes(program, plain.params, plain.frozen, 6))
        state, _ = make_fill(program, shardings)(state, prompts[:1], jnp.stack(fill_keys(1)))
        step, history = make_train_step(program, shardings), []
        for i in range(2):
            state, metrics = step(state, prompts[1 + i], jax.random.key(i))
            history.append({k: float(v) for k, v in sh.to_host(metrics).items()})
        return state, history

    def test_in_flight_updates_equal_one_device_on_a_2x2x2_mesh():
        """k = 1 part-decoded batch in the state (its KV cache rows split over the batch axes like every batch in
        flight): the fill and 2 updates on a (data 2, fsdp 2, tensor 2) mesh equal one device's."""
        one_state, one = in_flight_run(sh.make_mesh(devices=jax.devices()[:1]))
        state, history = in_flight_run(sh.make_mesh(2, 2, 2))
        keys = state.in_flight.state.cache.keys
        assert {shard.data.shape[1] for shard in keys.addressable_shards} == {16 // 4}  # rows over data x fsdp
        for update, (got, want) in enumerate(zip(history, one)):
            for name, value in want.items():
                np.testing.assert_allclose(got[name], value, atol=1e-5, rtol=1e-5, err_msg=f"{update}: {name}")
        assert one[1]["offpolicy/staleness_max"] == 1
        assert_trees_close(state.params, one_state.params, what="params")
        np.testing.assert_array_equal(np.asarray(state.in_flight.state.responses),
                                      np.asarray(one_state.in_flight.state.responses))

    def test_in_flight_updates_on_slots_run_per_shard():
        """rollout_slots 4 on a (data 2, fsdp 2) mesh: each shard keeps 1 slot of its own in the state (the slots
        split by rows like the batch's rows) and swaps each update's policy into it. Update 1 learns a batch the
        initial policy sampled whole (the fill and update 1 run the same policy), so its metrics equal one
        device's; later batches differ by design (each shard cuts its own chunks)."""
        _, one = in_flight_run(sh.make_mesh(devices=jax.devices()[:1]), rollout_slots=4)
        state, history = in_flight_run(sh.make_mesh(2, 2, 1, devices=jax.devices()[:4]), rollout_slots=4)
        slots = state.in_flight.state
        assert {shard.data.shape[1] for shard in slots.cache.keys.addressable_shards} == {1}  # a slot a shard
        assert {shard.data.shape[1] for shard in slots.responses.addressable_shards} == {4}
        for name, value in one[0].items():
            if name != "sampling/slot_occupancy":
                np.testing.assert_allclose(history[0][name], value, atol=1e-5, rtol=1e-5, err_msg=name)
        assert history[1]["offpolicy/staleness_max"] == 1 and np.isfinite(history[1]["loss/policy_avg"])

    # ---- continuous batching per data-parallel shard ----
    def test_a_train_step_with_slots_per_shard_equals_one_device():
        """rollout_slots 4 on a (data 2, fsdp 2) mesh: each of the 4 shards decodes its 4 rows in 1 slot of its own;
        the step's metrics (the slot occupancy included: each shard's steps x its slot) and weights equal one
        device's 4 slots over the 16 rows (the occupancy is each schedule's own)."""
        import dataclasses

        from ppojax.rl.program import make_train_step
        from tests.test_pipeline import program_with
        from tests.test_train_step import init_state, prompt_blocks

        results = []
        for mesh in (sh.make_mesh(devices=jax.devices()[:1]), sh.make_mesh(2, 2, 1, devices=jax.devices()[:4])):
            program = program_with(None, rollout_slots=4, learning_rate=1e-3, behaviour_logprobs="forward")
            batch = dataclasses.replace(program.settings.batch, data_parallel_size=sh.data_parallel_size(mesh))
            program = dataclasses.replace(program, mesh=mesh,
                                          settings=dataclasses.replace(program.settings, batch=batch))
            plain = init_state(program, 0)
            state, shardings = placement.init_sharded_train_state(
                plain.params, program.optimizer, mesh, hyperparams=plain.hyperparams, frozen=plain.frozen,
                kl_coef=0.05)
            state, metrics = make_train_step(program, shardings)(state, prompt_blocks(1)[0], jax.random.key(5))
            results.append((state, {k: float(v) for k, v in sh.to_host(metrics).items()}))
        (one_state, one), (state, metrics) = results
        occupancy = "sampling/slot_occupancy"
        for name, value in one.items():
            if name != occupancy:
                np.testing.assert_allclose(metrics[name], value, atol=1e-5, rtol=1e-5, err_msg=name)
        assert 0 < metrics[occupancy] <= 1 and 0 < one[occupancy] <= 1
        # Adam's first step (about lr x sign(g)) turns the float rounding of near-zero gradients, 4 shards' sums
        # against one, into differences up to a tenth of the learning rate
        assert_trees_close(state.params, one_state.params, atol=1e-4, what="params")

    # ---- checkpoints load straight into their shards ----
    GPT2_FUSED = dict(model_type="gpt2", vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=32)

    @pytest.mark.parametrize("hf_config", [None, GPT2_FUSED], ids=["llama", "gpt2-fused-qkv"])
    def test_a_checkpoint_loads_straight_into_its_shards(tmp_path, hf_config):
        """``load_pretrained(mesh=)`` puts every weight in its rule's sharding reading one shard per device (no
        array is ever formed whole, on the host or on a device, unless replicated), with the checkpoint's
        values: GPT-2's fused q|k|v split per layer, transposed kernels, stacked layers, an untied head."""
        from ppojax.models import CausalLM, ModelConfig, load_pretrained, read_params, save_pretrained
        cfg = H.CFG if hf_config is None else ModelConfig.from_hf(hf_config)
        save_pretrained(CausalLM(cfg, rngs=nnx.Rngs(3)), cfg, tmp_path / "ckpt")
        mesh = sh.make_mesh(1, 4, 2)
        with H.shard_reads() as reads:
            model, _ = load_pretrained(tmp_path / "ckpt", mesh=mesh)
        state = nnx.to_pure_dict(nnx.state(model))
        H.assert_read_shard_by_shard(state, reads)
        expected = sh.param_shardings(nnx.state(model), mesh)
        for (path, leaf), target in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(expected)):
            assert leaf.sharding.is_equivalent_to(target, leaf.ndim), (jax.tree_util.keystr(path), leaf.sharding)
        q = state["backbone"]["layers"]["attn"]["q"]["kernel"]
        assert q.addressable_shards[0].data.shape == (cfg.num_layers, cfg.hidden_size // 4, 2, cfg.head_dim)
        stored = read_params(tmp_path / "ckpt", cfg)
        for (path, leaf), value in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(stored)):
            np.testing.assert_array_equal(np.asarray(leaf), value, err_msg=jax.tree_util.keystr(path))

    def test_a_run_reads_its_checkpoints_into_the_meshs_shards(tmp_path):
        """``build_run`` on a (1, 4, 2) mesh: the policy and the reward model are read shard by shard into the
        train state's shardings; the state holds the checkpoints' values (the reference and the value model
        as copies of them)."""
        from ppojax.trainer.config import PPOConfig
        from ppojax.models import ScoreModel, load_config, read_params, save_pretrained
        from ppojax.trainer.build import build_run
        from tests.tiny_setup import tiny_config, write_tiny_run_inputs
        root = write_tiny_run_inputs(tmp_path)
        save_pretrained(ScoreModel(tiny_config(), rngs=nnx.Rngs(5)), tiny_config(), root / "reward")
        config = PPOConfig.from_dict(dict(
            model_name_or_path=str(root / "model"), reward_model_path=str(root / "reward"),
            dataset=str(root / "prompts.jsonl"), output_dir=str(tmp_path / "out"), max_prompt_length=6,
            response_length=4, batch_size=8, total_episodes=16, compilation_cache_dir="none",
            mesh_data=1, mesh_fsdp=4, mesh_tensor=2))
        with H.shard_reads() as reads:
            run = build_run(config)
        state = run.state
        H.assert_read_shard_by_shard({"policy": state.params["policy"], "reward": state.frozen["reward"]}, reads)
        for tree, shardings in ((state.params, run.state_shardings.params), (state.frozen, run.state_shardings.frozen)):
            for leaf, target in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
                assert leaf.sharding.is_equivalent_to(target, leaf.ndim)
        policy = read_params(root / "model", tiny_config())
        reward = read_params(root / "reward", load_config(root / "reward"), kind="score")
        for tree, stored in ((state.params["policy"], policy), (state.frozen["ref"], policy),
                             (state.frozen["reward"], reward), (state.params["value"], reward)):
            for leaf, value in zip(jax.tree.leaves(tree), jax.tree.leaves(stored)):
                np.testing.assert_array_equal(np.asarray(leaf), value)

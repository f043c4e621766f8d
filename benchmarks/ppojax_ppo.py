"""ppojax's side of the PPO benchmark: the same work as ``benchmarks.trl_ppo`` (contract in
``benchmarks/common.py``): policy + frozen reference + reward model + value model (reward/value = the policy's
backbone shape + a Linear(hidden, 1) score head), fixed-length responses, ``num_ppo_epochs`` epochs.

    python -m benchmarks.ppojax_ppo --size tiny [--updates N] [--model-dir DIR] [--json out.json]

Each update is ONE call of ``ppojax.rl.program`` (sampling, reference/value/reward forwards, rewards,
advantages and the epochs of optimizer steps in one compiled program), timed after ``jax.block_until_ready``:
that is the headline (episodes/s, time to the first update). The phases inside one program cannot be timed
apart, so after the timed updates the same work runs as separate programs (the sampler alone, the rollout,
the update) for the per-phase figures (generation / update tokens per second and MFU); ``--no-phases``
skips them. ``--compile-ahead`` compiles ``train_step`` on a background thread while the models load (the
config's ``compile_ahead``), so ``setup_s`` then holds part of the compile: compare ``setup_and_first_update_s``
across sides. ``--scan K`` runs the updates as ``train_steps`` blocks of K iterations in one ``lax.scan``.
``--estimator grpo`` (or rloo, reinforce_pp) runs the same work with a critic-free advantage estimator: no
value model (its forward, loss, parameters and optimizer state are gone), 4 samples per prompt for the group
estimators; ``state_mb`` reports the trainable state's size either way. The behaviour log-probs come from the
sampler, as TRL's (``--behaviour-logprobs forward``: ppojax's default, one more policy forward per rollout).
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.common import Turns, make_config, peak_rss_mb, status_mb, summarize
from ppojax.io.strict_json import write_json
from ppojax.rl.optimizer import make_optimizer
from ppojax.trainer.config import MATMUL_IMPLEMENTATIONS, PPOConfig

DEFAULT_REMAT = PPOConfig().remat  # ppojax's default, so the benchmark runs what a user's run does
DEFAULT_COMPILE_AHEAD = PPOConfig().compile_ahead


def _models(config, abstract: bool = False):
    """(policy, reward ScoreModel, ModelConfig) for the benchmark's shapes, in ``config['precision']``
    (default float32). abstract: the same models' structure with ``jax.ShapeDtypeStruct`` weights (no weight
    read or drawn), what the step is compiled for while the weights load."""
    from ppojax import backends
    from ppojax.models import CausalLM, ModelConfig, ScoreModel, abstract_pretrained, load_pretrained, precision_dtypes

    dtype, param_dtype = precision_dtypes(config.get("precision", "float32"))
    options = dict(dtype=dtype, param_dtype=param_dtype, remat=config.get("remat", DEFAULT_REMAT))
    if config.get("model_dir"):
        load = abstract_pretrained if abstract else load_pretrained
        policy, cfg = load(config["model_dir"], **options)
        reward, _ = load(config["model_dir"], kind="score", seed=1, **options)
    else:
        cfg = ModelConfig.from_hf(dict(config["model"], model_type="llama"))

        def random(cls, seed):  # random init compiled once (an eager init of a large model is slow)
            graphdef = nnx.graphdef(nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(seed), **options)))
            return nnx.merge(graphdef, jax.jit(lambda: nnx.state(cls(cfg, rngs=nnx.Rngs(seed), **options)))())

        new = (lambda cls, seed: nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(seed), **options))) if abstract \
            else random
        policy, reward = new(CausalLM, 0), new(ScoreModel, 1)
    # the backend's kernels, chosen once for the models' shapes as a run chooses them
    kernels = backends.kernels_for([policy, reward], matmul_implementation=config.get("matmul_implementation", "auto"),
                                   attention_implementation=config.get("attention_implementation", "auto"),
                                   devices=jax.devices()[:1])
    backends.use_kernels(kernels, policy, reward)
    return policy, reward, cfg


def build(config: dict):
    """(PPOProgram, TrainState, shardings) for the benchmark: reward model in the program, value model = its
    copy."""
    return build_compiling_ahead(config, compile_ahead=False)[:3]


def build_compiling_ahead(config: dict, compile_ahead: bool = True):
    """:func:`build`, and (CompileAhead or None): with compile_ahead, the program is made from the models'
    structure first and its ``train_step`` compiles on a background thread while the weights load (as
    ``ppojax train`` does)."""
    from ppojax import backends
    from ppojax import parallel
    from ppojax.rl import placement
    from ppojax.rl.actor_critic import ActorCritic
    from ppojax.trainer.config import PPOConfig
    from ppojax.core import advantage_estimator
    from ppojax.rl.rewards import ModelScores
    from ppojax.rl.settings import Hyperparams, StepSettings
    from ppojax.trainer.compile_ahead import start_train_step
    from ppojax.rl.program import PPOProgram

    abstract_policy, abstract_reward, cfg = _models(config, abstract=True)
    policy_graphdef, reward_graphdef = nnx.graphdef(abstract_policy), nnx.graphdef(abstract_reward)
    pad = config["pad_token_id"]
    estimator = advantage_estimator(config.get("advantage_estimator", "gae"))
    ppo_config = PPOConfig(batch_size=config["batch_size"], response_length=config["response_length"],
                           max_prompt_length=config["prompt_length"], num_ppo_epochs=config["num_ppo_epochs"],
                           num_mini_batches=config["num_mini_batches"], temperature=config["temperature"],
                           learning_rate=config["learning_rate"], seed=config["seed"], reward_function="vader",
                           mesh_data=1, advantage_estimator=estimator.name,
                           behaviour_logprobs=config.get("behaviour_logprobs", "forward"),
                           num_generations=4 if estimator.needs_groups else 1)
    # logits chunking as PPOTrainer sizes it (logits_chunk_size=None)
    settings = StepSettings.from_config(ppo_config, pad_token_id=pad, num_updates=config["num_updates"],
                                        eos_token_id=config["eos_token_id"], vocab_size=cfg.vocab_size)
    actor_critic = ActorCritic(policy_graphdef, reward_graphdef if estimator.uses_critic else None, pad,
                               config["temperature"], has_critic=estimator.uses_critic)
    optimizer = make_optimizer(step=backends.optimizer_step_for(config.get("optimizer_implementation", "auto"),
                                                                jax.devices()[:1]))
    mesh = parallel.make_mesh(devices=jax.devices()[:1])
    program = PPOProgram(actor_critic, ModelScores(reward_graphdef, pad), settings, optimizer, mesh)

    def trees(policy_state, reward_state, copy):
        """TRL's models: the reference is a copy of the policy, the value model starts as the reward model."""
        params = {"policy": policy_state}
        if estimator.uses_critic:
            params["value"] = copy(reward_state)
        return params, {"ref": copy(policy_state), "reward": reward_state}

    ahead = None
    if compile_ahead:
        params, frozen = trees(nnx.state(abstract_policy), nnx.state(abstract_reward), lambda tree: tree)
        ahead = start_train_step(program, params, frozen, hyperparams=Hyperparams.from_config(ppo_config),
                                 kl_coef=0.05, prompts_shape=(config["batch_size"] // settings.sampling.num_generations,
                                                config["prompt_length"]))
    policy, reward, _ = _models(config)
    if (nnx.graphdef(policy), nnx.graphdef(reward)) != (policy_graphdef, reward_graphdef):
        raise AssertionError("the loaded models' structure differs from abstract_pretrained's")
    params, frozen = trees(nnx.state(policy), nnx.state(reward), parallel.copy_arrays)
    state, shardings = placement.init_sharded_train_state(params, optimizer, mesh,
                                                         hyperparams=Hyperparams.from_config(ppo_config),
                                                         frozen=frozen, kl_coef=0.05,
                                                         donate=True)  # the models are this function's
    return program, state, shardings, ahead


def run(config: dict) -> dict:
    from ppojax.backends.cpu import host_memory
    from ppojax.rl.program import make_train_step, make_train_steps

    t_setup = time.perf_counter()
    scan = config.get("scan") or 1
    program, state, shardings, ahead = build_compiling_ahead(
        config, scan == 1 and config.get("compile_ahead", DEFAULT_COMPILE_AHEAD))
    prompts = np.asarray(config["prompts"], np.int32)
    B = config["batch_size"] // program.settings.sampling.num_generations  # prompts per update
    seed_key = jax.random.key(config["seed"])
    jax.block_until_ready(state)
    setup_s = time.perf_counter() - t_setup

    records = []
    previous_end = time.perf_counter()
    # ``stop_after_updates``: time only the first updates of a run configured for ``num_updates`` (the
    # learning-rate schedule, hence the compiled program, depends on num_updates).
    n = config.get("stop_after_updates") or config["num_updates"]
    turns = Turns(config, "ppojax")  # run.py --interleave: the updates alternate with TRL's
    if turns.active and scan != 1:
        raise ValueError("interleaved runs time single train_step calls (scan=1)")
    if scan == 1:
        step = ahead.train_step if ahead is not None else make_train_step(program, shardings)
        for u in range(n):
            if turns.active:
                turns.wait(u)
                previous_end = time.perf_counter()  # the clock starts with the turn
            cpu0, faults0 = time.process_time(), _page_faults()
            state, metrics = step(state, prompts[u * B:(u + 1) * B], jax.random.fold_in(seed_key, u))
            jax.block_until_ready((state, metrics))
            end = time.perf_counter()
            records.append({"total_s": end - previous_end, "cpu_s": time.process_time() - cpu0,
                            "page_faults": _page_faults() - faults0, "rss_mb": status_mb("VmRSS")})
            turns.done(u)
            previous_end = end
        compilations = step.jitted._cache_size()
    else:  # blocks of `scan` iterations, one program each; a block's time is shared by its iterations
        steps = make_train_steps(program, shardings)
        for first in range(0, n - n % scan, scan):
            cpu0 = time.process_time()
            block = prompts[first * B:(first + scan) * B].reshape(scan, B, -1)
            keys = jax.vmap(lambda u: jax.random.fold_in(seed_key, u))(jnp.arange(first, first + scan))
            state, metrics = steps(state, block, keys)
            jax.block_until_ready((state, metrics))
            end = time.perf_counter()
            # the first block (it compiles) is ONE record, the warm-up that summarize() leaves out
            parts = 1 if first == 0 else scan
            records += [{"total_s": (end - previous_end) / parts, "cpu_s": (time.process_time() - cpu0) / parts}
                        for _ in range(parts)]
            previous_end = end
        compilations = steps.jitted._cache_size()
    train_peak_rss = peak_rss_mb()  # the training loop's own; the phase programs below hold extra copies
    turns.wait(n)  # interleaved: the phase timings run once the other side has finished
    phases = measure_phases(program, state, prompts[:B], seed_key) if config.get("phases", True) else {}
    for record in records:
        record.update(phases or {"generation_s": float("nan"), "rollout_s": float("nan"), "update_s": float("nan")})
    out = summarize(config, records, setup_s)
    out["peak_rss_mb"] = train_peak_rss
    out["peak_rss_mb_with_phases"] = peak_rss_mb()
    out["jax_version"] = jax.__version__
    out["device"] = str(jax.devices()[0].platform)
    out["update_compilations"] = compilations
    out["scan"] = scan
    out["compile_ahead"] = ahead is not None
    if ahead is not None:  # the background thread's trace, lowering and compile of train_step
        out["compile_ahead_s"] = ahead.seconds
        out["compile_ahead_error"] = None if ahead.error is None else repr(ahead.error)
    out["advantage_estimator"] = program.settings.algorithm.advantage_estimator
    out["precision"] = config.get("precision", "float32")
    out["allocator"] = "mimalloc" if host_memory.mimalloc_preloaded() else "glibc"
    out["matmul_implementation"] = _matmul_used(config, program, state.params)
    step_impl = program.optimizer.step
    out["optimizer_in_place"] = step_impl is not None and step_impl.applies(program.optimizer, state.params,
                                                                            state.opt_state)
    out["state_mb"] = sum(x.nbytes for x in jax.tree.leaves((state.params, state.opt_state))) / 1e6
    return out


def _page_faults() -> int:
    """This process's page faults so far (minor: first touches of memory the allocator took from the OS)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _matmul_used(config: dict, program, params) -> str:
    """What the policy's layer projections ran on in the update: the library (e.g. "onednn", "mkl") where the CPU's
    kernels multiply them in place, else "xla" (with the reason when oneDNN's handlers were missing)."""
    from ppojax.backends.cpu import matmul_tuning, stacked_matmul

    kernels = nnx.merge(program.actor_critic.policy_graphdef, params["policy"]).kernels

    def scanned_layers(tree):  # the policy's `layers` dict (the layer scan's stacked weights)
        if not hasattr(tree, "items"):
            return None
        if "layers" in tree:
            return tree["layers"]
        return next(filter(None, map(scanned_layers, tree.values())), None)

    layers = nnx.to_pure_dict(scanned_layers(params["policy"]) or {})
    rows = config["batch_size"] * (config["prompt_length"] + config["response_length"])
    compute = jnp.float32 if config.get("precision", "float32") == "float32" else jnp.bfloat16
    if kernels.split_layer_kernels(layers, rows, compute)[1] is not None:
        return matmul_tuning.choice_str(dict(kernels.libraries))
    # why not, where the default library's handlers are the reason
    why = stacked_matmul.unavailable_reason() if jax.default_backend() == "cpu" else ""
    return f"xla ({why})" if why else "xla"


def measure_phases(program, state, prompts, key, repeats: int = 2) -> dict:
    """Mean seconds of the phases run as separate programs (after one untimed call of each, which compiles):
    ``generation_s`` (the sampler), ``rollout_s`` (sampling + forwards + reward: ``make_rollout``) and
    ``update_s`` (``learn`` on that experience). The update donates its state and the next calls use the new
    one, as the training loop's program does: a non-donated update would write a fresh copy of the whole
    state (weights and Adam moments) every call, work the training loop never does."""
    from ppojax.rl import rollout
    from ppojax.rl.program import make_rollout
    from ppojax.rl.update import learn

    sample = jax.jit(lambda s, q, k: rollout.sample(program, s, q, k)[0])
    run_rollout = make_rollout(program)
    update = jax.jit(lambda s, e, k: learn(program, s, e, k)[0], donate_argnums=0)
    state = jax.tree.map(jnp.copy, state)  # the caller's state stays valid
    experience, _ = jax.block_until_ready(run_rollout(state, prompts, key))
    jax.block_until_ready(sample(state, prompts, key))
    state = jax.block_until_ready(update(state, experience, key))
    times = {"generation_s": [], "rollout_s": [], "update_s": []}
    for i in range(repeats):
        k = jax.random.fold_in(key, 1000 + i)
        for name in ("generation_s", "rollout_s", "update_s"):
            t0 = time.perf_counter()
            if name == "generation_s":
                jax.block_until_ready(sample(state, prompts, k))
            elif name == "rollout_s":
                jax.block_until_ready(run_rollout(state, prompts, k))
            else:
                state = jax.block_until_ready(update(state, experience, k))
            times[name].append(time.perf_counter() - t0)
    return {name: sum(v) / len(v) for name, v in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--updates", type=int, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--scan", type=int, default=1, help="iterations per train_steps block (1: train_step)")
    parser.add_argument("--no-phases", action="store_true", help="skip the per-phase timing")
    parser.add_argument("--estimator", default="gae", help="advantage_estimator (gae, grpo, rloo, reinforce_pp)")
    parser.add_argument("--remat", default=DEFAULT_REMAT, choices=["none", "full", "dots"],
                        help="rematerialisation of the layer scan (the same gradients; default: ppojax's, "
                             f"{DEFAULT_REMAT!r})")
    parser.add_argument("--compile-ahead", action=argparse.BooleanOptionalAction, default=DEFAULT_COMPILE_AHEAD,
                        help="compile train_step on a background thread while the models load (the config's "
                             f"compile_ahead; default {DEFAULT_COMPILE_AHEAD}), else at the first update")
    parser.add_argument("--matmul", default="auto", choices=MATMUL_IMPLEMENTATIONS,
                        help="matmul_implementation of the models (default: ppojax's, 'auto')")
    parser.add_argument("--optimizer", default="auto", choices=("auto", "optax"),
                        help="optimizer_implementation (default: ppojax's, 'auto': AdamW's step in one pass where it "
                             "applies; 'optax': optax's)")
    parser.add_argument("--behaviour-logprobs", default="sampler", choices=["sampler", "forward"],
                        help="'sampler': the decode loop's log-probs, as TRL's PPOTrainer (the benchmark's work); "
                             "'forward': one more policy forward in the rollout (ppojax's default)")
    args = parser.parse_args(argv)
    from ppojax.backends import start_program

    start_program()  # as the ppojax command does (ppojax.backends.start_program)
    config = make_config(args.size, quick=args.quick, num_updates=args.updates, model_dir=args.model_dir)
    result = run(dict(config, scan=args.scan, phases=not args.no_phases, advantage_estimator=args.estimator,
                      remat=args.remat, behaviour_logprobs=args.behaviour_logprobs,
                      compile_ahead=args.compile_ahead, matmul_implementation=args.matmul,
                      optimizer_implementation=args.optimizer))
    text = json.dumps({k: v for k, v in result.items() if k != "updates"}, indent=2)
    print(text)
    if args.json:
        write_json(args.json, result, indent=2)


if __name__ == "__main__":
    main()

"""Check an exported policy against ppojax itself: transformers (torch) must write the same greedy
continuations as ppojax's sampler. Needs torch; the library itself does not."""
from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ppojax import backends, parallel
from ppojax.core.masks import truncate_response
from ppojax.models.kernels import XLA
from ppojax.rl.sampler import generate


def float32_compute(graphdef, params):
    """The same model (`nnx.split` parts) computing in float32: every module's compute `dtype` set to float32 on a
    merged copy; the parameters keep their values and dtype. The export check decodes with it: transformers
    runs the saved weights in float32, and a 16-bit policy's own greedy decode may part from float32's at a
    near tie, which would say nothing about the export."""
    model = nnx.merge(graphdef, params)
    for _, module in nnx.iter_modules(model):
        if getattr(module, "dtype", None) is not None and jnp.dtype(module.dtype) != jnp.float32:
            module.dtype = jnp.float32
    backends.use_kernels(XLA, model)  # XLA's float32 operations: the values transformers is held against
    return nnx.split(model)


#: export_check: null (auto) checks policies up to this many parameters: transformers holds the whole export in
#: float32 in the main process's memory and decodes on its CPU
AUTO_MAX_PARAMS = 3_000_000_000


def export_check_skipped(setting: bool | None, *, held_out: bool, torch_available: bool,
                         num_params: int) -> str | None:
    """Why `ppojax train` does not check its export (a line for the user), or None when it does.
    setting: the config's export_check (None: auto); held_out: the run has held-out prompts to decode."""
    if setting is False:
        return "export_check is false"
    if not held_out:
        return "the run holds out no prompts to decode (num_eval_prompts: 0)"
    if not torch_available:
        return "torch is not installed (transformers loads the export with it)"
    if setting is None and num_params > AUTO_MAX_PARAMS:
        return (f"the policy has {num_params / 1e9:.1f}e9 parameters, and export_check: null (auto) checks "
                f"policies up to {AUTO_MAX_PARAMS / 1e9:.0f}e9 (transformers would hold the whole export in float32 "
                f"in this process's memory and decode on its CPU); set export_check: true to check it anyway")
    return None


def greedy_continuations_agree(policy_dir, policy_graphdef, policy_params, queries, max_new_tokens: int, *,
                               pad_token_id: int, stop_token_id: int | None) -> dict:
    """Greedy-decode ``queries`` (np i32[B, P], left padded) with ppojax's policy (``policy_graphdef`` +
    ``policy_params``, one plain causal LM) and with transformers loading ``policy_dir``. Returns
    {"agree": bool, "ppojax": [[ids]], "transformers": [[ids]]} (ids up to and including the stop token).
    ppojax's side computes in float32 whatever the policy's precision (`float32_compute`). Every process of a
    multi-process run calls it (ppojax's decode is a collective); only the main one loads the export and
    compares (the others return {"agree": None})."""
    import torch  # noqa: PLC0415 - optional (the test extra); export_check_skipped says when it is missing
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 - loads the export with torch (optional)

    pad, stop = pad_token_id, stop_token_id  # short names for the lines below
    policy_graphdef, policy_params = float32_compute(policy_graphdef, policy_params)
    ours = generate(policy_graphdef, policy_params, jnp.asarray(queries),
                    jax.random.key(0),
                    response_length=max_new_tokens, pad_token_id=pad, greedy=True, stop_token_id=stop)
    ours = parallel.to_host(truncate_response(ours, stop, pad))  # a collective: every process takes part
    if not parallel.is_main_process():
        return {"agree": None}

    model = AutoModelForCausalLM.from_pretrained(Path(policy_dir), dtype=torch.float32).eval()
    ids = torch.as_tensor(np.asarray(queries), dtype=torch.long)
    mask = ids != pad
    # ppojax's positions: the exclusive cumsum of the mask, so a left-padded prompt starts at 0.
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad, eos_token_id=stop if stop is not None else None,
                             min_new_tokens=0)
    theirs = out[:, ids.shape[1]:].numpy()
    theirs = np.pad(theirs, [(0, 0), (0, max_new_tokens - theirs.shape[1])], constant_values=pad)
    theirs = np.asarray(truncate_response(jnp.asarray(theirs), stop, pad))

    def strip(rows):
        return [[int(t) for t in row if t != pad] for row in rows]

    return {"agree": bool(np.array_equal(ours, theirs)), "ppojax": strip(ours), "transformers": strip(theirs)}

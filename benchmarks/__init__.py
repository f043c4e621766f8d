"""ppojax's benchmark harness (benchmarks/README.md): the PPO comparison with TRL 1.12.0 (``run``), the
accelerator's update MFU and decode roofline (``gpu``, ``decode_bytes``), the padding study (``padding_free``),
the TPU plan table (``plan_table``) and the math run on several seeds (``math_grpo``).

Nothing here is imported by the ``ppojax`` library; TRL runs in its own interpreter (``.venv-bench``).
"""

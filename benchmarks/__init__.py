"""Throughput benchmarks: ppojax against TRL 1.12.0's PPO trainer and against the machine's matmul peak.

Entry point: ``python -m benchmarks.run [--quick] [--json out.json] [--only trl|ppojax]``.
Nothing here is imported by the ``ppojax`` library; TRL runs in its own interpreter (``.venv-bench``).
"""

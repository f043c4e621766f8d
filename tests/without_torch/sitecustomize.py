"""Run at the start of a process the suite launches with this directory on ``PYTHONPATH``
(:func:`tests.tiny_setup.run_environment`): the process sees a user's install of ppojax, which has no torch (only the
tests compare against it). With ``sys.modules["torch"]`` None, ``importlib.util.find_spec("torch")`` is None and
``import torch`` fails, as where torch is not installed: transformers then leaves it out (and says so at import), and
ppojax's runs skip what needs it.
"""
import sys

sys.modules.setdefault("torch", None)

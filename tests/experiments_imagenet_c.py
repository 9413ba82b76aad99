"""Imports experiments/imagenet_c.py as a module for in-process CLI tests."""

import importlib.util
import os

_path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments", "imagenet_c.py")
_spec = importlib.util.spec_from_file_location("experiments_imagenet_c_main", _path)
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
main = _mod.main

"""Pretrained weights in, Flax params out: one module per concern.

* `readers` -- checkpoint formats (safetensors, torch pickles, AugReg/big_vision npz, timm's hub) -> timm names;
* `big_vision` -- AugReg / big_vision npz names <-> timm names;
* `timm_map` -- timm names <-> the Flax tree, the config a state dict implies, key/shape checks;
* `guided_diffusion` -- guided-diffusion UNet state dicts <-> `pcsr_jax.models.unet`'s tree, configs from the
  official flags or a published checkpoint's name, checks that name the flag;
* `pipeline` -- read, check, map, save (verify): what ``convert_weights.py`` runs.
"""

from pcsr_jax.weights.big_vision import bigvision_to_timm, timm_to_bigvision
from pcsr_jax.weights.pipeline import convert_checkpoint, convert_unet
from pcsr_jax.weights.readers import read_state_dict
from pcsr_jax.weights.timm_map import (check_state_dict, expected_shapes, flax_to_timm, infer_config,
                                       preprocessing_meta, timm_to_flax)

__all__ = ["bigvision_to_timm", "check_state_dict", "convert_checkpoint", "convert_unet", "expected_shapes",
           "flax_to_timm", "infer_config", "preprocessing_meta", "read_state_dict", "timm_to_bigvision",
           "timm_to_flax"]

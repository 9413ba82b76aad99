"""Models: the timm-exact Vision Transformer and its architecture registry; guided-diffusion's UNet (`unet`)."""

from pcsr_jax.models.configs import ViTConfig, get_config, known_archs
from pcsr_jax.models.unet import UNet, UNetConfig
from pcsr_jax.models.vit import VisionTransformer, create, init_params

__all__ = ["UNet", "UNetConfig", "ViTConfig", "VisionTransformer", "create", "get_config", "init_params", "known_archs"]
